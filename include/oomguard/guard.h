// Guard: runs one optimizer step so that out-of-memory errors inside it are
// survived without changing the result.
//
//   auto guard = oomguard::Guard::Create(options).value();
//   oomguard::StepRequest req;
//   req.samples = batch.size();
//   req.micro = [&](const oomguard::MicroBatch& mb) {
//     guard->MarkPhase(oomguard::Phase::kForward);   ... forward on [mb.offset, mb.offset+mb.size)
//     guard->MarkPhase(oomguard::Phase::kBackward);  ... backward of loss * mb.weight
//   };
//   req.commit = [&] { optimizer.step(); };
//   req.reset = [&] { zero_grad(); };
//   oomguard::StepReport report;
//   oomguard::Status s = guard->Step(req, &report);
//
// On an OOM the guard records an incident, releases caches, re-plans the step
// into smaller micro-batches (same global batch, same gradient) and retries;
// an OOM at the minimum size rolls back through the RecoveryStore or gives up
// with kResourceExhausted. Micro-batches that finished before an OOM in the
// data or forward phase are kept; an OOM after backward started calls the
// reset hook and redoes the step. A non-OOM exception from user code passes
// through unchanged.
//
// Thread-safety: one thread drives a Guard (Step, MarkPhase). Several guards
// (one per rank/thread) may share a Device, an IncidentSink and the logger.
#ifndef OOMGUARD_GUARD_H_
#define OOMGUARD_GUARD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "oomguard/export.h"
#include "oomguard/incident.h"
#include "oomguard/options.h"
#include "oomguard/plan.h"
#include "oomguard/status.h"

namespace oomguard {

enum class Phase { kUnknown, kData, kForward, kBackward, kOptimizer, kCommit, kCheckpoint };
OOMGUARD_EXPORT std::string_view PhaseName(Phase p);  // "forward", ...

struct StepRequest {
  // This rank's samples for this optimizer step (>= 1).
  int64_t samples = 0;
  // Optional per-sample cost (e.g. tokens); when set, size(costs) == samples and
  // the micro-batch limit is in cost units.
  std::span<const int64_t> costs;
  // Forward + backward of one micro-batch; scale the mean loss by mb.weight.
  std::function<void(const MicroBatch&)> micro;
  // Gradient synchronisation and optimizer step; runs once, after every rank is ready.
  std::function<void()> commit;
  // Zeroes accumulated gradients. Needed to redo a step after an OOM in
  // backward; falls back to the guard's SetResetHook.
  std::function<void()> reset;
};

struct StepReport {
  int64_t step = 0;
  Status status;
  int micro_batches = 0;           // micro-batches run to completion in the final plan
  int64_t limit_before = 0;        // limit at the start of the step
  int64_t limit_after = 0;         // limit for the next step
  int64_t largest_micro = 0;       // largest micro-batch that completed (size or cost)
  int ooms = 0;
  int cache_releases = 0;
  int replans = 0;
  std::optional<int64_t> rolled_back_to;  // set when the step ended in a rollback
  std::vector<Incident> incidents;        // this step's incidents, with outcome
  int64_t peak_allocated = 0;             // device peak during the step (0 without a device)
  double wall_ms = 0;
  double recovery_ms = 0;                 // SDK time from OOMs to their retries
};

class OOMGUARD_EXPORT Guard {
 public:
  // Validates the options (and OOMGUARD_FAULTS) and creates a guard.
  static StatusOr<std::unique_ptr<Guard>> Create(const GuardOptions& options);
  virtual ~Guard();

  // Runs one optimizer step. Returns OK, kResourceExhausted (OOM not
  // recoverable: the message names the incident and remedies), kAborted (rolled
  // back: report->rolled_back_to and step() say where to continue),
  // kUnavailable (a peer rank did not answer), kInvalidArgument (bad request),
  // kFailedPrecondition (an OOM after backward started and no reset hook).
  // Rethrows a non-OOM exception raised by user code.
  virtual Status Step(const StepRequest& request, StepReport* report = nullptr) = 0;

  // Marks the phase of user code running inside micro/commit (incidents carry
  // it; fault rules with site=forward/backward/optimizer fire here).
  virtual void MarkPhase(Phase phase) = 0;

  // The zero-gradients hook used when a request has none.
  virtual void SetResetHook(std::function<void()> reset) = 0;
  // A user cache releaser called on every OOM before the retry (allocator
  // caches, memoised buffers). Called in registration order.
  virtual void AddCacheReleaser(std::string name, std::function<void()> release) = 0;

  // The number of the next step (starts at 0; Step advances it on success).
  virtual int64_t step() const = 0;
  // Sets the next step number (after resuming from a checkpoint).
  virtual void SetStep(int64_t step) = 0;
  // The micro-batch limit the next step will use.
  virtual int64_t micro_limit() const = 0;
  // Sets the limit (a learned prior). Clamped to [min_micro_batch, max].
  virtual void SetMicroLimit(int64_t limit) = 0;
  // OOMs handled since creation.
  virtual int64_t total_ooms() const = 0;
  virtual const std::string& run_id() const = 0;
  virtual const GuardOptions& options() const = 0;
};

}  // namespace oomguard

#endif  // OOMGUARD_GUARD_H_
