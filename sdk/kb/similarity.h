// Similar incidents: for one incident, the nearest past incidents of a case
// library (one or more knowledge bases), so a new failure is met with the
// cases already documented and what resolved them.
//
// Nearness adds three signals: the same grouping fingerprint (the same
// problem recurring: pattern, kind, phase, workload, size bucket), the same
// pattern, and how alike the two texts read (cosine of the text model's
// hashed features of message and context). Each neighbour says which of the
// three it shares.
//
// Thread-safety: pure function.
#ifndef OOMGUARD_SDK_KB_SIMILARITY_H_
#define OOMGUARD_SDK_KB_SIMILARITY_H_

#include <string>
#include <vector>

#include "oomguard/incident.h"

namespace oomguard::kb {

struct SimilarIncident {
  const Incident* incident = nullptr;  // points into the pool given to FindSimilar
  double score = 0;                    // 0..1
  std::string why;                     // "same fingerprint; same pattern; texts 62% alike"
};

// What an incident's record says resolved it: the guard's action and
// outcome, the micro-batch change, and the first remedy of its pattern.
std::string ResolutionOf(const Incident& incident);

// The `limit` incidents of `pool` nearest to `target`, nearest first,
// excluding `target` itself (same id) and anything sharing nothing with it
// (score below `min_score`).
std::vector<SimilarIncident> FindSimilar(const Incident& target, const std::vector<Incident>& pool, size_t limit,
                                         double min_score = 0.15);

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_SIMILARITY_H_
