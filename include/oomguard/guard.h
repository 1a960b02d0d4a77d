// Guard: runs one optimizer step so that out-of-memory errors inside it are
// survived without changing the result, on one rank or on many. (libtorch:
// oomguard/torch.h's TrainStep drives a Guard for you.)
//
//   auto created = oomguard::Guard::Create(options);
//   if (!created.ok()) { std::cerr << created.status() << "\n"; return 1; }  // names the bad field
//   std::unique_ptr<oomguard::Guard> guard = std::move(created).value();
//   oomguard::StepRequest req;
//   req.samples = batch.size();
//   req.micro = [&](const oomguard::MicroBatch& mb) {
//     guard->MarkPhase(oomguard::Phase::kForward);   ... forward on [mb.offset, mb.offset+mb.size)
//     guard->MarkPhase(oomguard::Phase::kBackward);  ... backward of loss * mb.weight
//   };
//   req.sync = [&] { return std::vector<oomguard::SumBuffer>{oomguard::SumBuffer::Host(grads, n)}; };
//   req.apply = [&] { optimizer.step(); };
//   req.reset = [&] { zero_grad(); };
//   oomguard::StepReport report;
//   oomguard::Status s = guard->Step(req, &report);
//   ...
//   oomguard::StatusOr<int64_t> last = guard->Finish();  // after the last step
//
// On an OOM the guard records an incident, releases caches, re-plans the step
// into smaller micro-batches (same global batch, same gradient) and retries;
// an OOM at the minimum size rolls back through the RecoveryStore or gives up
// with kResourceExhausted. Micro-batches that finished before an OOM in the
// data or forward phase are kept; an OOM after backward started calls the
// reset hook and redoes the step. A non-OOM exception from user code passes
// through unchanged, after the other ranks have been told.
//
// With several ranks one step is atomic: every rank commits it, or every rank
// redoes it, rolls back to the same step, or stops — whatever fails on
// whichever ranks. The guard owns the gradient synchronisation to make that
// so: after a vote every rank sums the buffers `sync` names, with a status
// word, whether or not it failed; the optimizer `apply` runs only when every
// rank's sum succeeded; an agreement after the apply decides a rollback that
// every rank executes on the same step (docs/distributed.md).
//
// Thread-safety: one thread drives a Guard (Step, MarkPhase, Finish). Several
// guards (one per rank/thread) may share a Device, an IncidentSink and the logger.
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

#include "oomguard/coordinator.h"
#include "oomguard/export.h"
#include "oomguard/incident.h"
#include "oomguard/options.h"
#include "oomguard/plan.h"
#include "oomguard/recovery.h"
#include "oomguard/status.h"

namespace oomguard {

struct StepRequest {
  // This rank's samples for this optimizer step (>= 1).
  int64_t samples = 0;
  // Optional per-sample cost (e.g. tokens); when set, size(costs) == samples and
  // the micro-batch limit is in cost units.
  std::span<const int64_t> costs;
  // Optional per-sample loss units (e.g. valid tokens of a mean-over-tokens
  // loss); when set, size(units) == samples, every entry >= 0, and their sum
  // (over every rank) within int64 (kInvalidArgument otherwise). A micro-batch's
  // weight is then its units over this rank's units, and the sync scales each
  // rank by its units over the global batch's, so that the gradient is the
  // mean over every unit of the global batch, exactly. Empty: one per sample.
  std::span<const int64_t> units;
  // Forward + backward of one micro-batch; scale the micro-batch's mean loss
  // (over its samples, or its units) by mb.weight.
  std::function<void(const MicroBatch&)> micro;
  // The buffers to sum over ranks (gradients, the loss), called after the
  // last micro-batch and before the vote: allocate here whatever they need
  // (an OOM here goes through the ladder). After a vote that every rank
  // passed the guard sums them in place over ranks, each rank's contribution
  // scaled by its share of the global batch, so they then hold the global
  // batch's mean. Every rank returns the same shapes. Buffers of at most 8
  // host float32/float64 elements in all (a loss, a few metrics) travel in
  // the vote and cost no collective of their own. Not set: nothing is summed
  // (one rank, or gradients synchronised elsewhere): the vote and the
  // agreement are the step's collectives. With one rank there is nothing to
  // sum: leave it unset.
  std::function<std::vector<SumBuffer>()> sync;
  // The optimizer step. Runs once per step, after every rank's sync
  // succeeded; an OOM inside rolls every rank back to the same step.
  std::function<void()> apply;
  // Zeroes accumulated gradients (and whatever `sync` sums). Called only to
  // redo a step (after an OOM in backward, or after another rank failed
  // before its apply), not at the start of every step: zero your own
  // per-step accumulators (the loss sum) where the step begins, too. Required when the step trains (`apply` or `sync` set) or runs on
  // more than one rank: without it Step returns kFailedPrecondition on entry,
  // before any micro-batch runs, instead of at the first OOM in backward.
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
  int redone = 0;                  // whole-step redos because a rank failed between vote and apply
  std::optional<int64_t> rolled_back_to;  // set when the step ended in a rollback
  int failed_rank = -1;            // the rank whose failure ended the step (-1: none)
  int64_t global_units = 0;        // loss units of the global batch (samples without units)
  int64_t checkpoint_step = -1;    // newest checkpoint committed on every rank (-1: none known)
  std::vector<Incident> incidents;        // this step's incidents, with outcome
  int64_t peak_allocated = 0;             // device peak during the step (0 without a device)
  double wall_ms = 0;
  double recovery_ms = 0;                 // SDK time from OOMs to their retries
};

// One batch of evaluation or inference: no gradient, no optimizer step,
// nothing that changes the model, so nothing to agree on with other ranks or
// to roll back.
struct EvalRequest {
  // This rank's samples of the batch (>= 1).
  int64_t samples = 0;
  // Optional per-sample cost; the evaluation limit is then in cost units.
  std::span<const int64_t> costs;
  // Optional per-sample units: mb.weight becomes the micro-batch's share of them.
  std::span<const int64_t> units;
  // Forward of one micro-batch [mb.offset, mb.offset + mb.size); a result
  // that is a mean over the micro-batch is weighed by mb.weight.
  std::function<void(const MicroBatch&)> micro;
};

class OOMGUARD_EXPORT Guard {
 public:
  // Validates the options (and OOMGUARD_FAULTS) and creates a guard.
  static StatusOr<std::unique_ptr<Guard>> Create(const GuardOptions& options);
  virtual ~Guard();

  // Runs one optimizer step. Returns OK, kResourceExhausted (OOM not
  // recoverable, on this rank or another: the message names the rank, the
  // incident and remedies), kAborted (rolled back: report->rolled_back_to and
  // step() say where to continue), kUnavailable (a peer rank did not answer:
  // exit with kExitCoordinationTimeout), kInvalidArgument (bad request),
  // kFailedPrecondition (no reset hook where one is required, see
  // StepRequest::reset; or an OOM after backward started and none set),
  // kCancelled (another rank stopped with an error; the message names it),
  // kDataLoss (no step every rank can restore), kInternal (the ranks' collectives
  // diverged). Rethrows a non-OOM exception raised by user code, after the
  // other ranks were told. Every rank returns at the same step.
  // An exception that is not a std::exception (the host language's own, such
  // as a Python KeyboardInterrupt carried through C++) raised by a cache
  // releaser or a checkpoint object's save is rethrown too; a std::exception
  // there is logged and counted (the releaser is skipped, the checkpoint of
  // the step is lost), and the step goes on.
  // kFailedPrecondition, at once and without a vote, when called from inside
  // a step's own callbacks (Step is not re-entrant); kInvalidArgument when the
  // step counter is past kMaxStep.
  virtual Status Step(const StepRequest& request, StepReport* report = nullptr) = 0;

  // Runs one batch of evaluation on this rank alone, split into micro-batches
  // that fit: an OOM releases caches, halves the evaluation's own limit (it
  // starts at the training limit, since evaluation holds less, and grows back
  // after clean batches) and re-runs the micro-batches not yet done; completed
  // ones are kept. Each OOM is recorded as an incident (phase kEval unless
  // marked otherwise). Returns OK, kResourceExhausted (a micro-batch of one
  // sample, or max_ooms_per_step OOMs), kInvalidArgument (bad request);
  // rethrows a non-OOM exception of user code. Not collective: ranks may
  // evaluate different numbers of batches. The step number does not change.
  virtual Status Evaluate(const EvalRequest& request, StepReport* report = nullptr) = 0;

  // Starts a run from its checkpoints: every rank restores the newest
  // checkpoint that every rank holds and can load (a corrupt one on any rank
  // makes all move to the next), confirmed by all, and step() becomes the
  // step after it. Returns that step; kNotFound when no checkpoint is common
  // to every rank (start from scratch), kDataLoss when none could be loaded,
  // kFailedPrecondition without a RecoveryStore. Collective.
  virtual StatusOr<int64_t> Resume() = 0;

  // Ends the run: waits until the checkpoint saves in flight are durable and
  // agrees with every rank on the newest checkpoint complete everywhere
  // (rank 0 commits it). Returns that step (-1: none, or no RecoveryStore).
  // An error when a rank's newest save failed, the commit failed, or a peer
  // did not answer; every rank returns the same outcome. Collective.
  virtual StatusOr<int64_t> Finish() = 0;

  // Marks the phase of user code running inside micro/apply (incidents carry
  // it; fault rules with site=forward/backward/optimizer fire here).
  virtual void MarkPhase(Phase phase) = 0;

  // A user cache releaser called on every OOM before the retry (allocator
  // caches, memoised buffers). Called in registration order.
  virtual void AddCacheReleaser(std::string name, std::function<void()> release) = 0;

  // The number of the next step (starts at 0; Step advances it on success).
  virtual int64_t step() const = 0;
  // Sets the next step number. Not needed to resume: Resume() sets it (the
  // one resume idiom); this is for a run that numbers its steps itself.
  // kInvalidArgument unless 0 <= step <= kMaxStep (a checkpoint of a step
  // outside could never be loaded); kFailedPrecondition inside a step.
  [[nodiscard]] virtual Status SetStep(int64_t step) = 0;
  // The micro-batch limit the next step will use (INT64_MAX: no limit
  // known yet, every step runs whole until an OOM says otherwise).
  virtual int64_t micro_limit() const = 0;
  // The limit the next Evaluate will use (INT64_MAX likewise).
  virtual int64_t eval_micro_limit() const = 0;
  // Sets the limit (a learned prior). Clamped to [min_micro_batch, max].
  virtual void SetMicroLimit(int64_t limit) = 0;
  // OOMs handled since creation.
  virtual int64_t total_ooms() const = 0;
  virtual const std::string& run_id() const = 0;
  virtual const GuardOptions& options() const = 0;
};

}  // namespace oomguard

#endif  // OOMGUARD_GUARD_H_
