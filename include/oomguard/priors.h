// MicroBatchPriors: what a guard learns about a workload and remembers across
// runs. The knowledge base implements it; a guard given one (GuardOptions.priors)
// with a workload signature starts at the largest micro-batch that ran clean
// for that signature before, instead of hitting the same OOMs again.
//
// Thread-safety: implementations may be called from several guards at once.
// RecordCleanMicroBatch is called after every clean step on the training
// thread: it must be cheap and must not block on I/O.
#ifndef OOMGUARD_PRIORS_H_
#define OOMGUARD_PRIORS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

class OOMGUARD_EXPORT MicroBatchPriors {
 public:
  virtual ~MicroBatchPriors();
  // The largest micro-batch that ran clean for `workload`, if known.
  virtual std::optional<int64_t> PriorMicroBatch(const std::string& workload) = 0;
  // A step of `workload` completed with micro-batches of up to `size`.
  virtual Status RecordCleanMicroBatch(const std::string& workload, int64_t size) = 0;
};

}  // namespace oomguard

#endif  // OOMGUARD_PRIORS_H_
