// GuardImpl: the guarded step as a state machine, shared by the files that
// implement its parts (private to sdk/guard):
//   guard.cc            creation, the step's local work and its one OOM handler
//   guard_agreement.cc  the vote, the gradient sync, the apply, the agreement,
//                       and the ways every rank ends a step together
//   guard_restore.cc    rollback, Resume and Finish: restoring a step every
//                       rank holds
//   guard_pieces.cc     what the states share: creation and the learned
//                       priors, plans, cache release, incidents
//   checkpoint_commit.h the committed checkpoint: the one caller of
//                       RecoveryStore::Commit, and the steps every rank holds
// docs/distributed.md describes the protocol these files implement.
//
// Thread-safety: one thread drives a GuardImpl (guard.h).
#ifndef OOMGUARD_SDK_GUARD_GUARD_IMPL_H_
#define OOMGUARD_SDK_GUARD_GUARD_IMPL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "oomguard/coordinator.h"
#include "oomguard/device.h"
#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/logging.h"
#include "oomguard/oom.h"
#include "oomguard/priors.h"
#include "oomguard/recovery.h"
#include "oomguard/size_controller.h"
#include "sdk/core/format.h"
#include "sdk/core/ids.h"
#include "sdk/guard/checkpoint_commit.h"
#include "sdk/guard/step_protocol.h"
#include "sdk/memory/incident_kind.h"

namespace oomguard::guard_internal {

using internal::FormatBytes;
using internal::VoteStatus;
using Clock = std::chrono::steady_clock;

inline double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The memory figures at the moment of failure: the exception's when it
// carries them (the SDK's own error), otherwise what the device says now,
// while the exception (and, from Python, the frames its traceback holds) is
// still alive. *at_failure is true either way when there are figures; from
// the device they may miss what unwinding already freed, so allocated plus
// the request is a lower bound of what the micro-batch needed.
MemoryStats StatsAtFailure(const std::exception_ptr& e, Device* device, bool* at_failure = nullptr);

// Fault sites that MarkPhase arms, one per phase (unknown/data/checkpoint have none).
inline std::optional<FaultSite> SiteOfPhase(Phase p) {
  switch (p) {
    case Phase::kForward: return FaultSite::kForward;
    case Phase::kBackward: return FaultSite::kBackward;
    case Phase::kOptimizer: return FaultSite::kOptimizer;
    default: return std::nullopt;
  }
}

// What every give-up message offers, with the seeds' figures.
extern const char* const kGenericRemedies;

// kInvalidArgument naming `what` ("StepRequest", "EvalRequest") when costs or
// units do not have one entry per sample, or a unit count is negative.
Status ValidatePerSample(std::string_view what, int64_t samples, std::span<const int64_t> costs,
                         std::span<const int64_t> units);

// True for an error of a collective communicator (NCCL, or torch's
// ProcessGroupNCCL) rather than of the training step's own memory: even when
// its text says "out of memory", the communicator is unusable afterwards.
bool IsCommunicatorFailure(std::string_view message);

inline std::string DescribeException(const std::exception_ptr& e) {
  OomInfo info = ClassifyException(e);
  return "exception " + info.exception_type + (info.message.empty() ? "" : ": " + info.message);
}

// Runs a RecoveryStore call between collectives: whatever it throws becomes
// a status, so that this rank still takes part in the collective that follows.
template <typename F>
Status Contained(F&& call) {
  try {
    return call();
  } catch (...) {
    return Status::Internal(DescribeException(std::current_exception()));
  }
}

enum class State { kLocal, kVote, kSync, kApply, kAgree, kRollback, kDone };

// What this rank concluded from its own work, before the vote.
enum class Local { kOk, kRollback, kFailed };

// Where an OOM was caught: it decides what survives it.
enum class Where {
  kLocal,   // micro-batches, sync buffers, vote site: this rank alone redoes work
  kCommit,  // commit and sync sites, just before the vote: every rank redoes the step
};

// The apply outcome as it travels in the agreement.
enum ApplyOutcome : int64_t { kApplied = 0, kApplyOom = 1, kApplyError = 2 };

// One call of Step: the request and everything the states hand each other.
struct Run {
  Run(const StepRequest& r, StepReport& p) : req(r), rep(p) {}
  const StepRequest& req;
  StepReport& rep;
  Clock::time_point started = Clock::now();
  std::function<void()> reset;         // the request's hook
  std::vector<int64_t> unit_prefix;    // prefix sums of req.units (empty: one per sample)
  int64_t local_units = 0;
  std::vector<MicroBatch> plan;
  size_t pos = 0;                      // next micro-batch of `plan` to run
  int64_t largest = 0;                 // largest micro-batch that completed
  // Device figures between micro-batches (the size controller's input):
  // allocated and the allocator's retry count when the next micro-batch
  // starts (mem_base -1: read them again, memory was released), and the
  // step's peak, since the peak is reset before each micro-batch.
  int64_t mem_base = -1;
  int64_t mem_retries = 0;
  int64_t step_peak = 0;
  bool release_retry_used = false;
  bool outside_retry_used = false;     // the redo after an OOM outside the micro-batches
  std::vector<SumBuffer> buffers;      // what req.sync returned
  internal::VoteOutcome vote;
  ApplyOutcome applied = kApplied;
  Status status;                       // what Step returns
  IncidentOutcome outcome = IncidentOutcome::kRecovered;

  // This rank's own verdict on the step (what it votes), and the agreed
  // rollback. Each is written only through the methods below.
  Local local() const { return local_; }
  const Status& failure() const { return failure_; }          // why (local() == kFailed)
  const std::exception_ptr& error() const { return error_; }  // rethrown once the others know
  // What this rank tells the others about its own failure.
  std::string FailureText() const { return error_ ? DescribeException(error_) : failure_.ToString(); }
  // This rank cannot finish the step; `why` travels to the others.
  void Fail(Status why) {
    local_ = Local::kFailed;
    failure_ = std::move(why);
  }
  // An exception that is not the SDK's to swallow (not an OOM, or the host
  // language's own): this rank fails with it, `context` first.
  void FailWith(std::exception_ptr e, const std::string& context = {}) {
    error_ = std::move(e);
    Fail(Status::Cancelled(context + DescribeException(error_)));
  }
  // Such an exception after the step committed (a save callback's): the
  // step stands, and Step rethrows it at the end.
  void RaiseAfterCommit(std::exception_ptr e) { error_ = std::move(e); }
  // An OOM that a smaller micro-batch cannot fix: this rank votes rollback.
  void AskRollback() {
    if (local_ == Local::kOk) local_ = Local::kRollback;
  }
  // The ranks agreed to roll back: why (the same text on every rank) and the
  // micro-batch limit of the rank that asked.
  void AgreeRollback(std::string why, int64_t size) {
    rollback_why_ = std::move(why);
    rollback_size_ = size;
  }
  const std::string& rollback_why() const { return rollback_why_; }
  int64_t rollback_size() const { return rollback_size_; }

 private:
  Local local_ = Local::kOk;
  Status failure_;
  std::exception_ptr error_;
  std::string rollback_why_;
  int64_t rollback_size_ = 0;
};

class GuardImpl final : public Guard {
 public:
  explicit GuardImpl(const GuardOptions& o);

  static SizeControllerOptions ControllerOptions(const GuardOptions& o);

  Status Step(const StepRequest& req, StepReport* report) override;
  Status Evaluate(const EvalRequest& req, StepReport* report) override;
  StatusOr<int64_t> Resume() override;
  StatusOr<int64_t> Finish() override;

  void MarkPhase(Phase phase) override {
    phase_ = phase;
    if (auto site = SiteOfPhase(phase)) FaultPoint(*site, fault_ctx_);
  }
  void AddCacheReleaser(std::string name, std::function<void()> release) override {
    releasers_.emplace_back(std::move(name), std::move(release));
  }
  int64_t step() const override { return step_; }
  Status SetStep(int64_t step) override {
    if (in_step_) return Status::FailedPrecondition("Guard::SetStep called inside a step (from its callbacks)");
    if (step < 0 || step > kMaxStep)
      return Status::InvalidArgument("Guard::SetStep(" + std::to_string(step) + "): a step is in [0, " +
                                     std::to_string(kMaxStep) + "]");
    step_ = step;
    return Status::Ok();
  }
  int64_t micro_limit() const override { return controller_.limit(); }
  int64_t eval_micro_limit() const override {
    return eval_controller_ ? eval_controller_->limit() : controller_.limit();
  }
  void SetMicroLimit(int64_t limit) override { controller_.SetLimit(limit); }
  int64_t total_ooms() const override { return total_ooms_; }
  const std::string& run_id() const override { return run_id_; }
  const GuardOptions& options() const override { return options_; }

 private:
  // ---- the states ----
  State RunLocal(Run& run);
  State Vote(Run& run);
  // The commit and sync fault sites, before the vote: true when an OOM there
  // asks every rank to redo the step (this rank still ok); a non-OOM error
  // fails this rank.
  bool CommitSites(Run& run);
  // Every rank resets and redoes the step (`asked`: this rank asked for it).
  State Redo(Run& run, bool asked);
  State Sync(Run& run);
  State Apply(Run& run);
  State Agree(Run& run);
  State Rollback(Run& run);
  Status Conclude(Run& run);

  // ---- the pieces they share ----
  // Device figures around each micro-batch, for the size controller (only
  // with a device). Before: the base and a fresh peak. After: the figures go
  // to the controller; true when it changed the limit and the rest of the
  // step was re-planned.
  void BeforeMicroBatch(Run& run);
  void AfterMicroBatch(Run& run, const MicroBatch& mb);
  // The one OOM handler before the apply: records the incident, releases
  // caches and walks the ladder. True when the work was re-planned and can be
  // retried; false when this rank stops (run.local() says how).
  bool HandleOom(Run& run, std::exception_ptr error, Where where);
  // An exception in the apply: parameters may be half-updated.
  void HandleApplyFailure(Run& run, std::exception_ptr error);
  // What every OOM costs before a rung is chosen: counts it (in the step,
  // in total, and against steps_ok_since_oom_), releases the caches and notes
  // the release in `inc`. Returns the milliseconds the user's releasers took.
  double CountOomAndRelease(Run& run, Incident& inc);
  // After a halve or a retry: plans the rest of the step again, from the
  // failed micro-batch when earlier work is kept (`keep`), else from scratch
  // after the reset hook (an OOM in a local phase). False when the reset
  // hook threw (this rank fails; run.local() says so).
  bool Replan(Run& run, bool keep, const MicroBatch& failed, Where where);
  // Calls the reset hook. Its own exception makes this rank fail (kept to be
  // rethrown once the others know); false then.
  bool Reset(Run& run);
  // Every rank ends the step because some rank failed: the reasons travel,
  // the failing ranks return their own error, the others name the first.
  State EndFailed(Run& run);
  // A collective failed: a lost peer (kUnavailable) or diverged ranks.
  State EndCoordination(Run& run, const Status& why);
  // The step committed on every rank.
  void CommitStep(Run& run);
  State Done(Run& run, Status s, IncidentOutcome outcome) {
    run.status = std::move(s);
    run.outcome = outcome;
    return State::kDone;
  }

  // What this rank can restore (after its saves in flight landed).
  internal::RankPoints MyPoints();
  // Every rank restores the first of `candidates` that every rank can, with
  // rank 0 committing its manifest first when some rank loads from disk; the
  // ranks confirm they hold it. kNotFound when none worked; another error when
  // a collective failed.
  StatusOr<int64_t> RestoreAgreed(const std::vector<internal::RankPoints>& points,
                                  const std::vector<int64_t>& candidates, std::string* tried);
  Status ValidateRequest(const StepRequest& req) const;
  void EnsureInitialSnapshot(Run& run);
  internal::RankVote MyVote(const Run& run);

  // The limit as it applies to this request: "whole step" when it is larger.
  // The costs' sum saturates (a request whose sum overflows is refused, but
  // its report is still filled in).
  int64_t EffectiveLimit(const StepRequest& req) const;

  // Plans samples [begin, n) and weighs each micro-batch by its share of
  // this rank's samples or units.
  StatusOr<std::vector<MicroBatch>> MakePlan(const Run& run, int64_t begin, int first_index) const;

  // Re-plans the whole step from its first sample.
  void PlanAnew(Run& run);

  // Rung 1: the retry must see the memory. User releasers first (they drop
  // references), then the device's allocator cache. Returns the time spent in
  // user releasers, which recovery time excludes.
  // A releaser's std::exception is logged and the next releaser runs; any
  // other exception (the host language's own: a Python KeyboardInterrupt) is
  // not the SDK's to swallow: this rank fails the step with it (run.error()),
  // rethrown once the others know, and no further releaser runs.
  double ReleaseCaches(Run& run);
  // The same outside a step: *foreign receives the exception a releaser
  // raised that is not a std::exception (and *who its name), for the caller
  // to rethrow.
  double ReleaseCaches(std::exception_ptr* foreign, std::string* who);

  Incident NewIncident(const OomInfo& info, const MemoryStats& mem, const MicroBatch& mb,
                       const StepRequest& req) const {
    return NewIncident(info, mem, mb, req.costs);
  }
  Incident NewIncident(const OomInfo& info, const MemoryStats& mem, const MicroBatch& mb,
                       std::span<const int64_t> costs) const;

  void RecordIncident(Run& run, Incident inc) { RecordIncident(run.rep, std::move(inc)); }
  void RecordIncident(StepReport& rep, Incident inc);

  void FinishIncidents(std::vector<Incident>& incs, IncidentOutcome outcome);

  GuardOptions options_;
  SizeController controller_;
  // Evaluate's own limit (kSearch from the training limit), made on first use.
  std::optional<SizeController> eval_controller_;
  std::string run_id_;
  std::string prior_key_;  // PriorKey(workload, rank, world size): this rank's priors
  std::unique_ptr<Coordinator> own_coordinator_;
  Coordinator* coordinator_ = nullptr;
  internal::StepChannel channel_;
  CheckpointCommit commits_;  // the committed checkpoint (its only writer)
  std::vector<std::pair<std::string, std::function<void()>>> releasers_;
  int64_t step_ = 0;
  Phase phase_ = Phase::kUnknown;
  FaultContext fault_ctx_;
  std::deque<int64_t> peaks_;
  int64_t steps_ok_since_oom_ = 0;
  int64_t total_ooms_ = 0;
  bool snapshot_checked_ = false;
  int64_t rollback_target_ = INT64_MIN;  // the last rollback's step
  int rollback_repeats_ = 0;             // rollbacks to it in a row
  int64_t rollback_from_ = -1;           // the step that last asked for a rollback
  bool in_step_ = false;                 // Step is running (its callbacks may call back)
};

}  // namespace oomguard::guard_internal

#endif  // OOMGUARD_SDK_GUARD_GUARD_IMPL_H_
