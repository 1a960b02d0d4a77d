// Fault injection: deterministic OOMs, kills and delays at named sites, for the
// SDK's own tests and for users' tests of their training loops.
//
// Rules come from the OOMGUARD_FAULTS environment variable (read once, at the
// first use) or from SetFaultRules. Grammar: rules separated by ';', each
//   KIND@key=value,key=value
// KIND: oom | host_oom | error | kill | delay. Keys:
//   step=N | step=A-B     optimizer step (inclusive range)
//   rank=N                only on this rank
//   site=NAME             micro_batch, forward, backward, optimizer, commit,
//                         sync, apply, ckpt_stage, ckpt_write, ckpt_manifest,
//                         vote, kb_write, eval
//   micro=N               micro-batch index within the step
//   times=N               how many times the rule fires (default 1; 0 = unlimited)
//   min_size=N            fire only while the micro-batch is at least this size
//   ms=N                  delay length (delay only, required there)
//   bytes=N               requested bytes reported by an injected OOM (default 1 MiB)
// `error` throws a non-OOM exception (std::runtime_error; RuntimeError in
// Python): what the guard must pass through unchanged, after its peers heard.
// Sites of the commit phase, in the order they are reached: `commit` (after
// the vote), `sync` (inside the guard's gradient sync, before the
// collective), `apply` (just before the optimizer apply callback).
// Example: oom@step=30,rank=1,site=backward;kill@step=57,site=ckpt_write
//
// Cost when no rule is set: a call and one relaxed atomic load per site.
// Thread-safety: all functions may be called from any thread.
#ifndef OOMGUARD_FAULTS_H_
#define OOMGUARD_FAULTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

enum class FaultSite {
  kMicroBatch,
  kForward,
  kBackward,
  kOptimizer,
  kCommit,
  kSync,
  kApply,
  kCkptStage,
  kCkptWrite,
  kCkptManifest,
  kVote,
  kKbWrite,
  kEval,  // before each micro-batch of Guard::Evaluate
};
inline constexpr int kNumFaultSites = 13;

OOMGUARD_EXPORT std::string_view FaultSiteName(FaultSite site);
OOMGUARD_EXPORT std::optional<FaultSite> ParseFaultSite(std::string_view name);

enum class FaultKind { kOom, kHostOom, kError, kKill, kDelay };

struct FaultRule {
  FaultKind kind = FaultKind::kOom;
  std::optional<int64_t> step_lo, step_hi;  // inclusive; unset: any step
  std::optional<int> rank;
  std::optional<FaultSite> site;            // unset: any site
  std::optional<int> micro;
  int64_t times = 1;                        // 0: unlimited
  int64_t min_size = 0;
  int64_t delay_ms = 0;
  int64_t bytes = 1 << 20;
  std::string text;                         // the rule as written, for messages
};

// Where a fault point is in the run.
struct FaultContext {
  int64_t step = -1;
  int rank = 0;
  int micro = -1;       // -1: not inside a micro-batch
  int64_t size = 0;     // current micro-batch size (samples or cost units)
};

// Parses a rule list. A bad rule is kInvalidArgument naming the rule and what is wrong.
OOMGUARD_EXPORT StatusOr<std::vector<FaultRule>> ParseFaultRules(std::string_view spec);

// Replaces the active rules (and their fire counters). An empty spec clears them.
OOMGUARD_EXPORT Status SetFaultRules(std::string_view spec);
OOMGUARD_EXPORT void ClearFaultRules();
// The spec now in force ("" when none).
OOMGUARD_EXPORT std::string ActiveFaultRules();
// How many times rules have fired since they were set.
OOMGUARD_EXPORT int64_t FaultsFired();

// Loads OOMGUARD_FAULTS once. Returns its parse error, if any (the guard turns
// that into an error at construction, so a typo is never silently ignored).
OOMGUARD_EXPORT Status LoadFaultRulesFromEnv();

// A fault point. Throws DeviceOomError / HostOomError / std::runtime_error,
// kills the process, or sleeps when a matching rule says so; otherwise
// returns at once. Out of line, so that the armed flag stays private to the
// library; costs a call and one relaxed atomic load when no rule is set.
OOMGUARD_EXPORT void FaultPoint(FaultSite site, const FaultContext& ctx);

// The fault context of the step running on this thread (set by the guard), so
// that user code can place fault points without passing the context around.
OOMGUARD_EXPORT const FaultContext& CurrentFaultContext();
OOMGUARD_EXPORT void SetCurrentFaultContext(const FaultContext& ctx);

}  // namespace oomguard

#endif  // OOMGUARD_FAULTS_H_
