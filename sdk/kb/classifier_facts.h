// The classifier's view of one incident: every figure known or unknown, and
// the cues its text holds. Private to sdk/kb (classifier.cc builds Facts,
// classifier_rules.cc reads them).
//
// Thread-safety: Facts is a value built per classification.
#ifndef OOMGUARD_SDK_KB_CLASSIFIER_FACTS_H_
#define OOMGUARD_SDK_KB_CLASSIFIER_FACTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "oomguard/incident.h"
#include "sdk/kb/text_cues.h"
#include "sdk/memory/oom_message.h"

namespace oomguard::kb {

struct Facts {
  explicit Facts(const Incident& incident) : inc(incident) {}
  const Incident& inc;
  std::string kind;        // device, host, workspace; "" unknown
  std::string phase;       // "" unknown
  std::string phase_why;   // what decided the phase
  bool phase_recorded = false;  // the guard recorded the phase (not inferred from text)

  // Figures: nullopt is unknown, never zero.
  std::optional<int64_t> step, steps_ok_before;
  std::optional<int64_t> total, free, allocated, reserved, requested, inactive_split, process_in_use;
  int64_t other_processes = 0;  // processes the message lists, minus one that is this process seen from a container
  bool requested_lower_bound = false;

  internal::OomFigures fig;
  TextCues cues;
  std::vector<std::string> used;  // the evidence available, for the evidence sentence

  // Clean steps before the OOM, from the record, the logged progress or the description.
  std::optional<int64_t> CleanSteps() const;
  std::optional<int64_t> CleanEpochs() const;
  // The OOM came before any step completed, by the record or the text.
  bool AtFirstStep() const;
  // Some training ran cleanly before the OOM.
  bool RanBefore() const;
  // The device reports the requested size free with room to spare (the
  // driver's free figure is never all usable in one piece): capacity does
  // not explain the failure.
  bool FreeCoversRequest() const { return free && requested && *free >= *requested + (int64_t{256} << 20); }
  std::optional<int64_t> CachedFree() const {
    if (reserved && allocated && *reserved >= *allocated) return *reserved - *allocated;
    return std::nullopt;
  }
};

struct Candidate {
  std::string pattern;
  double confidence = 0;
  std::string evidence;
};

// One function per pattern (classifier_rules.cc); nullopt: the rule's evidence is absent.
using Rule = std::optional<Candidate> (*)(const Facts&);
extern const Rule kRules[];
extern const size_t kRuleCount;

// Every rule's candidate for `incident`, most confident first (ties in rule
// order); the text model's training script reads them through
// bench/diagnosis_bench --dump to fit how the two combine.
std::vector<Candidate> RuleCandidates(const Incident& incident);
// The patterns the evidence contradicts, whatever the wording says: a host
// OOM is not a device pattern, a device OOM is not host memory outside the
// data pipeline, an evaluation seen running under no_grad is not
// eval_without_no_grad. The text model never answers them.
std::vector<std::string_view> RuledOut(const Facts& f);
std::vector<std::string_view> RuledOut(const Incident& incident);
// The text the text model reads for `incident`: its context (which holds the
// OOM line) or, without one, its message.
std::string_view ModelText(const Incident& incident);

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_CLASSIFIER_FACTS_H_
