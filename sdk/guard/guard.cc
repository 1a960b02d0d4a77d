// The guarded step: a state machine that every rank runs through the same
// collectives in the same order, whatever fails on which rank.
//
//   kLocal     micro-batches with local OOM recovery, then the sync buffers
//              and the vote fault site (an OOM anywhere here: the ladder)
//   kVote      every rank's outcome (Allgather). failed -> kDone for all;
//              rollback -> kRollback for all; ok -> kSync
//   kSync      the commit and sync fault sites, then the sum of the sync
//              buffers with status words, on every rank (a rank that failed
//              contributes zeros). Some rank failed with an OOM: nobody
//              changed parameters, every rank resets and redoes the step
//              (kLocal); with another error: kDone for all
//   kApply     the optimizer apply
//   kAgree     every rank's apply outcome. An OOM on some rank: kRollback
//              for all; an error: kDone for all; else the step commits
//   kRollback  every rank restores the same step, chosen from the steps
//              every rank holds, confirmed after restoring
// Every exit goes through Conclude, and a rank leaves Step only at a point
// where every other rank leaves it too.
//
// Invariant that makes recovery exact: a micro-batch's weight is its share of
// this rank's samples (or loss units), and the sync scales each rank by its
// share of the global batch's, so micro-batches that completed before an OOM
// in the data or forward phase keep their contribution and only the rest of
// the step is re-planned; an OOM after backward started may have added part of
// a gradient, so the reset hook zeroes the gradients and the whole step is
// re-planned.
#include "oomguard/guard.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <exception>
#include <utility>

#include "oomguard/coordinator.h"
#include "oomguard/device.h"
#include "oomguard/faults.h"
#include "oomguard/logging.h"
#include "oomguard/oom.h"
#include "oomguard/priors.h"
#include "oomguard/recovery.h"
#include "oomguard/size_controller.h"
#include "sdk/core/format.h"
#include "sdk/core/ids.h"
#include "sdk/guard/step_protocol.h"

namespace oomguard {

std::string_view PhaseName(Phase p) {
  switch (p) {
    case Phase::kUnknown: return "unknown";
    case Phase::kData: return "data";
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kOptimizer: return "optimizer";
    case Phase::kCommit: return "commit";
    case Phase::kCheckpoint: return "checkpoint";
  }
  return "unknown";
}

Guard::~Guard() = default;

namespace {

using internal::FormatBytes;
using internal::VoteStatus;
using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The memory figures at the moment of failure when the exception carries them
// (the SDK's own error), otherwise what the device says now.
MemoryStats StatsAtFailure(const std::exception_ptr& e, Device* device) {
  try {
    std::rethrow_exception(e);
  } catch (const DeviceOomError& oom) {
    const MemoryStats& s = oom.stats();
    if (s.total > 0 || s.reserved > 0) return s;
  } catch (...) {
  }
  return device != nullptr ? device->Stats() : MemoryStats{};
}

// Fault sites that MarkPhase arms, one per phase (unknown/data/checkpoint have none).
std::optional<FaultSite> SiteOfPhase(Phase p) {
  switch (p) {
    case Phase::kForward: return FaultSite::kForward;
    case Phase::kBackward: return FaultSite::kBackward;
    case Phase::kOptimizer: return FaultSite::kOptimizer;
    default: return std::nullopt;
  }
}

const char* kGenericRemedies =
    "reduce activation memory (mixed precision saves about 30-50%; activation checkpointing "
    "saves about 60-70% of activations for 20-30% more compute); lower min_micro_batch or the "
    "sequence length; leave 20-30% headroom; shard optimizer state (ZeRO) or offload it";

enum class State { kLocal, kVote, kSync, kApply, kAgree, kRollback, kDone };

// What this rank concluded from its own work, before the vote.
enum class Local { kOk, kRollback, kFailed };

// Where an OOM was caught: it decides what survives it.
enum class Where {
  kLocal,   // micro-batches, sync buffers, vote site: this rank alone redoes work
  kCommit,  // commit and sync sites, after the vote: every rank redoes the step
};

// The apply outcome as it travels in the agreement.
enum ApplyOutcome : int64_t { kApplied = 0, kApplyOom = 1, kApplyError = 2 };

// One call of Step: the request and everything the states hand each other.
struct Run {
  Run(const StepRequest& r, StepReport& p) : req(r), rep(p) {}
  const StepRequest& req;
  StepReport& rep;
  Clock::time_point started = Clock::now();
  std::function<void()> reset;         // the request's or the guard's hook
  std::vector<int64_t> unit_prefix;    // prefix sums of req.units (empty: one per sample)
  int64_t local_units = 0;
  std::vector<MicroBatch> plan;
  size_t pos = 0;                      // next micro-batch of `plan` to run
  int64_t largest = 0;                 // largest micro-batch that completed
  bool release_retry_used = false;
  Local local = Local::kOk;
  Status failure;                      // why this rank failed (local == kFailed)
  std::exception_ptr error;            // a non-OOM exception: rethrown once the others know
  std::vector<SumBuffer> buffers;      // what req.sync returned
  internal::VoteOutcome vote;
  ApplyOutcome applied = kApplied;
  std::string rollback_why;            // the same text on every rank
  int64_t rollback_size = 0;           // the micro-batch limit of the rank that asked
  Status status;                       // what Step returns
  IncidentOutcome outcome = IncidentOutcome::kRecovered;
};

class GuardImpl final : public Guard {
 public:
  explicit GuardImpl(const GuardOptions& o)
      : options_(o),
        controller_(ControllerOptions(o)),
        run_id_(o.run_id.empty() ? internal::RandomHex16() : o.run_id),
        own_coordinator_(o.coordinator == nullptr ? MakeLocalCoordinator() : nullptr),
        coordinator_(o.coordinator != nullptr ? o.coordinator : own_coordinator_.get()),
        channel_(coordinator_, std::chrono::milliseconds(o.vote_deadline_ms)) {
    if (options_.priors != nullptr && !options_.workload.empty()) {
      if (auto prior = options_.priors->PriorMicroBatch(options_.workload);
          prior && *prior >= 1 && *prior < controller_.limit()) {
        controller_.AdoptPrior(*prior);
        Logger()->info("workload '{}': starting at the learned micro-batch {}", options_.workload, controller_.limit());
      }
    }
    // The guard is created on its training thread: its log lines carry its rank.
    SetLogRank(coordinator_->rank());
  }

  static SizeControllerOptions ControllerOptions(const GuardOptions& o) {
    SizeControllerOptions c;
    c.min = o.min_micro_batch;
    c.max = o.max_micro_batch > 0 ? o.max_micro_batch : INT64_MAX;
    c.initial = o.initial_micro_batch > 0 ? std::min(o.initial_micro_batch, c.max) : c.max;
    c.grow_after = o.grow_after;
    c.tolerance = o.grow_tolerance;
    c.forget_bad_after = o.forget_bad_after;
    return c;
  }

  Status Step(const StepRequest& req, StepReport* report) override;
  StatusOr<int64_t> Resume() override;
  StatusOr<int64_t> Finish() override;

  void MarkPhase(Phase phase) override {
    phase_ = phase;
    if (auto site = SiteOfPhase(phase)) FaultPoint(*site, fault_ctx_);
  }
  void SetResetHook(std::function<void()> reset) override { reset_ = std::move(reset); }
  void AddCacheReleaser(std::string name, std::function<void()> release) override {
    releasers_.emplace_back(std::move(name), std::move(release));
  }
  int64_t step() const override { return step_; }
  void SetStep(int64_t step) override { step_ = step; }
  int64_t micro_limit() const override { return controller_.limit(); }
  void SetMicroLimit(int64_t limit) override { controller_.SetLimit(limit); }
  int64_t total_ooms() const override { return total_ooms_; }
  const std::string& run_id() const override { return run_id_; }
  const GuardOptions& options() const override { return options_; }

 private:
  // ---- the states ----
  State RunLocal(Run& run);
  State Vote(Run& run);
  State Sync(Run& run);
  State Apply(Run& run);
  State Agree(Run& run);
  State Rollback(Run& run);
  Status Conclude(Run& run);

  // ---- the pieces they share ----
  // The one OOM handler before the apply: records the incident, releases
  // caches and walks the ladder. True when the work was re-planned and can be
  // retried; false when this rank stops (run.local says how).
  bool HandleOom(Run& run, std::exception_ptr error, Where where);
  // An exception in the apply: parameters may be half-updated.
  void HandleApplyFailure(Run& run, std::exception_ptr error);
  // Calls the reset hook. Its own exception makes this rank fail (kept to be
  // rethrown once the others know); false then.
  bool Reset(Run& run) {
    try {
      run.reset();
      return true;
    } catch (...) {
      run.error = std::current_exception();
      run.local = Local::kFailed;
      run.failure = Status::Cancelled("the reset hook raised: " + FailureText(run));
      return false;
    }
  }
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
  void EnsureInitialSnapshot();
  internal::RankVote MyVote(const Run& run);

  // The limit as it applies to this request: "whole step" when it is larger.
  int64_t EffectiveLimit(const StepRequest& req) const {
    int64_t whole = req.samples;
    if (!req.costs.empty()) {
      whole = 0;
      for (int64_t c : req.costs) whole += c;
    }
    return std::min(controller_.limit(), std::max<int64_t>(whole, 1));
  }

  // Plans samples [begin, n) and weighs each micro-batch by its share of
  // this rank's samples or units.
  StatusOr<std::vector<MicroBatch>> MakePlan(const Run& run, int64_t begin, int first_index) const {
    const StepRequest& req = run.req;
    StatusOr<std::vector<MicroBatch>> plan =
        !req.costs.empty()
            ? PlanByCost(req.costs, controller_.limit(), begin, first_index)
            : StatusOr<std::vector<MicroBatch>>(PlanBySamples(
                  req.samples, std::max<int64_t>(1, std::min(controller_.limit(), req.samples)), begin, first_index));
    if (plan.ok() && !run.unit_prefix.empty()) {
      for (MicroBatch& mb : *plan) {
        const int64_t u = run.unit_prefix[static_cast<size_t>(mb.offset + mb.size)] -
                          run.unit_prefix[static_cast<size_t>(mb.offset)];
        mb.weight = run.local_units > 0 ? static_cast<double>(u) / static_cast<double>(run.local_units) : 0.0;
      }
    }
    return plan;
  }

  // Re-plans the whole step from its first sample.
  void PlanAnew(Run& run) {
    auto plan = MakePlan(run, 0, 0);
    if (plan.ok()) run.plan = std::move(plan).value();  // the first plan succeeded, so this one does
    run.pos = 0;
    run.largest = 0;
  }

  // Rung 1: the retry must see the memory. User releasers first (they drop
  // references), then the device's allocator cache. Returns the time spent in
  // user releasers, which recovery time excludes.
  double ReleaseCaches() {
    auto t0 = Clock::now();
    for (auto& [name, fn] : releasers_) {
      try {
        fn();
      } catch (const std::exception& e) {
        Logger()->warn("cache releaser '{}' threw: {}", name, e.what());
      } catch (...) {
        Logger()->warn("cache releaser '{}' threw a non-standard exception", name);
      }
    }
    double user_ms = MsSince(t0);
    if (options_.device != nullptr) options_.device->ReleaseCaches();
    return user_ms;
  }

  Incident NewIncident(const OomInfo& info, const MemoryStats& mem, const MicroBatch& mb,
                       const StepRequest& req) const {
    Incident inc;
    inc.id = internal::RandomHex16();
    inc.run_id = run_id_;
    inc.time_unix_ms = internal::NowUnixMs();
    inc.host = internal::HostName();
    inc.rank = coordinator_->rank();
    inc.world_size = coordinator_->size();
    inc.step = step_;
    inc.micro_index = mb.index;
    inc.phase = std::string(PhaseName(phase_));
    inc.kind = std::string(OomKindName(info.kind));
    inc.exception_type = info.exception_type;
    inc.message = info.message;
    inc.requested_bytes = info.requested_bytes;
    inc.memory = mem;
    inc.step_peaks.assign(peaks_.begin(), peaks_.end());
    inc.steps_ok_before = steps_ok_since_oom_;
    if (!req.costs.empty()) {
      std::vector<int64_t> c(req.costs.begin(), req.costs.end());
      auto mid = c.begin() + static_cast<std::ptrdiff_t>(c.size() / 2);
      std::nth_element(c.begin(), mid, c.end());
      inc.sample_cost_median = static_cast<double>(*mid);
      int64_t top = 0;
      for (int64_t i = mb.offset; i < mb.offset + mb.size; ++i) top = std::max(top, req.costs[static_cast<size_t>(i)]);
      inc.sample_cost_this = static_cast<double>(top);
    }
    inc.micro_before = mb.cost;
    inc.workload = options_.workload;
    inc.injected = info.injected;
    inc.outcome = std::string(IncidentOutcomeName(IncidentOutcome::kPending));
    return inc;
  }

  void RecordIncident(Run& run, Incident inc) {
    if (options_.incidents != nullptr) {
      try {
        options_.incidents->Record(inc);
      } catch (...) {
        // A failing knowledge base must never stop training.
        Logger()->warn("incident sink failed to record incident {}", inc.id);
      }
    }
    run.rep.incidents.push_back(std::move(inc));
  }

  void FinishIncidents(std::vector<Incident>& incs, IncidentOutcome outcome) {
    for (auto& inc : incs) {
      if (inc.outcome != IncidentOutcomeName(IncidentOutcome::kPending)) continue;
      inc.outcome = std::string(IncidentOutcomeName(outcome));
      if (options_.incidents != nullptr) {
        try {
          options_.incidents->UpdateOutcome(inc);
        } catch (...) {
          Logger()->warn("incident sink failed to update incident {}", inc.id);
        }
      }
    }
  }

  // Runs a RecoveryStore call between collectives: whatever it throws becomes
  // a status, so that this rank still takes part in the collective that follows.
  template <typename F>
  static Status Contained(F&& call) {
    try {
      return call();
    } catch (...) {
      return Status::Internal(DescribeException(std::current_exception()));
    }
  }

  static std::string DescribeException(const std::exception_ptr& e) {
    OomInfo info = ClassifyException(e);
    return "exception " + info.exception_type + (info.message.empty() ? "" : ": " + info.message);
  }

  // What this rank tells the others about its own failure.
  std::string FailureText(const Run& run) const {
    if (run.error) return DescribeException(run.error);
    return run.failure.ToString();
  }

  GuardOptions options_;
  SizeController controller_;
  std::string run_id_;
  std::unique_ptr<Coordinator> own_coordinator_;
  Coordinator* coordinator_ = nullptr;
  internal::StepChannel channel_;
  std::function<void()> reset_;
  std::vector<std::pair<std::string, std::function<void()>>> releasers_;
  int64_t step_ = 0;
  Phase phase_ = Phase::kUnknown;
  FaultContext fault_ctx_;
  std::deque<int64_t> peaks_;
  int64_t steps_ok_since_oom_ = 0;
  int64_t total_ooms_ = 0;
  bool snapshot_checked_ = false;
  int64_t committed_step_ = -1;          // newest checkpoint committed on every rank
  int64_t rollback_target_ = INT64_MIN;  // the last rollback's step
  int rollback_repeats_ = 0;             // rollbacks to it in a row
  int64_t rollback_from_ = -1;           // the step that last asked for a rollback
};

Status GuardImpl::ValidateRequest(const StepRequest& req) const {
  if (req.samples < 1) return Status::InvalidArgument("StepRequest.samples must be >= 1 (got " + std::to_string(req.samples) + ")");
  if (!req.micro) return Status::InvalidArgument("StepRequest.micro must be set");
  if (!req.costs.empty() && static_cast<int64_t>(req.costs.size()) != req.samples)
    return Status::InvalidArgument("StepRequest.costs has " + std::to_string(req.costs.size()) + " entries for " +
                                   std::to_string(req.samples) + " samples");
  if (!req.units.empty()) {
    if (static_cast<int64_t>(req.units.size()) != req.samples)
      return Status::InvalidArgument("StepRequest.units has " + std::to_string(req.units.size()) + " entries for " +
                                     std::to_string(req.samples) + " samples");
    for (size_t i = 0; i < req.units.size(); ++i)
      if (req.units[i] < 0)
        return Status::InvalidArgument("StepRequest.units[" + std::to_string(i) + "] is negative (" +
                                       std::to_string(req.units[i]) + ")");
  }
  return Status::Ok();
}

// An OOM in the very first apply (optimizer state allocation, the most common
// real OOM) can roll back only if the state before it is kept somewhere.
void GuardImpl::EnsureInitialSnapshot() {
  if (snapshot_checked_ || options_.recovery == nullptr) return;
  snapshot_checked_ = true;
  RecoveryStore* store = options_.recovery;
  try {
    std::vector<int64_t> durable = store->DurableSteps();
    if (store->SnapshotStep() || std::binary_search(durable.begin(), durable.end(), step_ - 1)) return;
    Status s = store->Snapshot(step_ - 1);
    if (!s.ok() && s.code() != StatusCode::kUnimplemented)
      Logger()->warn("no in-memory snapshot of the initial state (an OOM in the first optimizer step cannot roll "
                     "back): {}", s.ToString());
  } catch (const std::exception& e) {
    Logger()->warn("no in-memory snapshot of the initial state: {}", e.what());
  } catch (...) {
    Logger()->warn("no in-memory snapshot of the initial state: {}", DescribeException(std::current_exception()));
  }
}

Status GuardImpl::Step(const StepRequest& req, StepReport* report_out) {
  StepReport local_report;
  StepReport& rep = report_out != nullptr ? *report_out : local_report;
  rep = StepReport{};
  rep.step = step_;
  rep.checkpoint_step = committed_step_;
  Run run(req, rep);
  run.reset = req.reset ? req.reset : reset_;
  if (options_.device != nullptr) options_.device->ResetPeak();
  fault_ctx_ = FaultContext{step_, coordinator_->rank(), -1, 0};
  phase_ = Phase::kUnknown;

  // A bad request still takes part in the vote (as a failure), so that the
  // other ranks stop at once instead of waiting out their deadline.
  Status bad = ValidateRequest(req);
  if (bad.ok()) {
    if (req.units.empty()) {
      run.local_units = req.samples;
    } else {
      run.unit_prefix.resize(req.units.size() + 1, 0);
      for (size_t i = 0; i < req.units.size(); ++i) run.unit_prefix[i + 1] = run.unit_prefix[i] + req.units[i];
      run.local_units = run.unit_prefix.back();
    }
    auto plan = MakePlan(run, 0, 0);
    if (plan.ok()) {
      run.plan = std::move(plan).value();
    } else {
      bad = Status::InvalidArgument(plan.status().message());
    }
  }
  if (!bad.ok()) {
    run.local = Local::kFailed;
    run.failure = bad;
  }
  rep.limit_before = EffectiveLimit(req);
  EnsureInitialSnapshot();

  State state = State::kLocal;
  for (;;) {
    switch (state) {
      case State::kLocal: state = RunLocal(run); break;
      case State::kVote: state = Vote(run); break;
      case State::kSync: state = Sync(run); break;
      case State::kApply: state = Apply(run); break;
      case State::kAgree: state = Agree(run); break;
      case State::kRollback: state = Rollback(run); break;
      case State::kDone: return Conclude(run);
    }
  }
}

State GuardImpl::RunLocal(Run& run) {
  while (run.local == Local::kOk) {
    std::exception_ptr error;
    try {
      for (; run.pos < run.plan.size(); ++run.pos) {
        const MicroBatch& mb = run.plan[run.pos];
        phase_ = Phase::kUnknown;
        fault_ctx_.micro = mb.index;
        fault_ctx_.size = mb.cost;
        SetCurrentFaultContext(fault_ctx_);
        FaultPoint(FaultSite::kMicroBatch, fault_ctx_);
        run.req.micro(mb);
        run.largest = std::max(run.largest, mb.cost);
      }
      // The end of local work: what the sync sums (allocated now, before the
      // vote, so that an OOM here is still this rank's own), then the vote site.
      fault_ctx_.micro = -1;
      SetCurrentFaultContext(fault_ctx_);
      phase_ = Phase::kCommit;
      run.buffers.clear();
      if (run.req.sync) run.buffers = run.req.sync();
      FaultPoint(FaultSite::kVote, fault_ctx_);
      return State::kVote;
    } catch (...) {
      error = std::current_exception();
    }
    if (!HandleOom(run, std::move(error), Where::kLocal)) break;
  }
  return State::kVote;
}

bool GuardImpl::HandleOom(Run& run, std::exception_ptr error, Where where) {
  const auto t_oom = Clock::now();
  OomInfo info = ClassifyException(error);
  if (!info.is_oom()) {
    // Not ours: it passes through unchanged, once the other ranks know.
    run.error = std::move(error);
    run.local = Local::kFailed;
    run.failure = Status::Cancelled(FailureText(run));
    return false;
  }
  Device* device = options_.device;
  MicroBatch failed;
  if (where == Where::kLocal && run.pos < run.plan.size()) {
    failed = run.plan[run.pos];
  } else {
    failed.index = -1;
    failed.cost = std::max<int64_t>(run.largest, options_.min_micro_batch);
    failed.size = failed.cost;
  }
  const Phase phase = phase_;
  MemoryStats before = StatsAtFailure(error, device);
  // Drop the exception before releasing memory: it (or, in Python, its
  // traceback's frames) may be what still holds the memory.
  error = nullptr;
  Incident inc = NewIncident(info, before, failed, run.req);
  StepReport& rep = run.rep;
  ++rep.ooms;
  ++total_ooms_;
  steps_ok_since_oom_ = 0;

  const int64_t free_before = device != nullptr ? device->Stats().free : 0;
  const double user_ms = ReleaseCaches();
  ++rep.cache_releases;
  inc.actions.emplace_back(LadderActionName(LadderAction::kRelease));

  // Completed micro-batches survive an OOM before backward; otherwise the
  // gradients may hold part of the failed micro-batch.
  const bool keep = where == Where::kLocal && (phase == Phase::kData || phase == Phase::kForward) &&
                    run.pos < run.plan.size();
  if (!keep && !run.reset) {
    inc.action = std::string(LadderActionName(LadderAction::kGiveUp));
    run.failure = Status::FailedPrecondition(
        "OOM in phase '" + std::string(PhaseName(phase)) + "' at step " + std::to_string(step_) +
        " after gradients may have been accumulated, and no reset hook is set (StepRequest.reset "
        "or Guard::SetResetHook); incident " + inc.id);
    inc.micro_after = EffectiveLimit(run.req);
    RecordIncident(run, std::move(inc));
    run.local = Local::kFailed;
    return false;
  }

  LadderAction action;
  const int64_t free_after = device != nullptr ? device->Stats().free : 0;
  const int64_t need = std::max<int64_t>(1, info.requested_bytes);
  RecoveryStore* store = options_.recovery;
  if (options_.retry_after_release && !run.release_retry_used && device != nullptr &&
      free_after - free_before >= need) {
    // Releasing made room for the request: retry at the same size once.
    run.release_retry_used = true;
    action = LadderAction::kRelease;
  } else if (rep.ooms > options_.max_ooms_per_step) {
    action = LadderAction::kGiveUp;
  } else if (controller_.OnOom(failed.cost) && failed.size > 1) {
    // (A lone sample cannot be split, whatever its cost: it escalates.)
    action = LadderAction::kHalve;
    inc.actions.emplace_back(LadderActionName(action));
  } else if (store != nullptr && (store->SnapshotStep() || !store->DurableSteps().empty())) {
    // Whether every rank holds a common step is decided together, in Rollback.
    action = LadderAction::kRollback;
    inc.actions.emplace_back(LadderActionName(action));
  } else {
    action = LadderAction::kGiveUp;
  }
  inc.action = std::string(LadderActionName(action));
  inc.micro_after = EffectiveLimit(run.req);

  Logger()->warn("OOM ({}) in {} at step {} micro-batch {}/{} (size {}): requested {}, allocated {}, "
                 "reserved {}; released caches; {} -> micro-batch {}",
                 inc.kind, inc.phase, step_, failed.index + 1, failed.count, failed.cost,
                 FormatBytes(info.requested_bytes), FormatBytes(before.allocated), FormatBytes(before.reserved),
                 inc.action, inc.micro_after);
  rep.recovery_ms += std::max(0.0, MsSince(t_oom) - user_ms);

  if (action == LadderAction::kGiveUp || action == LadderAction::kRollback) {
    if (action == LadderAction::kGiveUp) {
      const bool bounded = rep.ooms > options_.max_ooms_per_step;
      run.failure = Status::ResourceExhausted(
          "out of memory at step " + std::to_string(step_) + " in phase '" + inc.phase + "' (" + inc.kind +
          ", requested " + FormatBytes(info.requested_bytes) + ") " +
          (bounded ? "after " + std::to_string(rep.ooms - 1) + " OOMs in one step (max_ooms_per_step)"
           : failed.size == 1 && failed.cost > options_.min_micro_batch
               ? "in a micro-batch of one sample (cost " + std::to_string(failed.cost) +
                     ") that cannot be split, with no checkpoint to roll back to"
               : "at the minimum micro-batch (" + std::to_string(options_.min_micro_batch) +
                     ") with no checkpoint to roll back to") +
          "; incident " + inc.id + "; remedies: " + kGenericRemedies);
      run.local = Local::kFailed;
    } else {
      run.local = Local::kRollback;
    }
    RecordIncident(run, std::move(inc));
    return false;
  }

  // Re-plan: from the failed micro-batch when earlier work is kept, else from
  // scratch. After the vote every rank resets together (Sync), not here.
  if (keep) {
    auto replan = MakePlan(run, failed.offset, failed.index);
    if (replan.ok()) {
      run.plan = std::move(replan).value();
      run.pos = 0;
    }
  } else {
    if (where == Where::kLocal && !Reset(run)) return false;
    PlanAnew(run);
  }
  ++rep.replans;
  RecordIncident(run, std::move(inc));
  return true;
}

internal::RankVote GuardImpl::MyVote(const Run& run) {
  internal::RankVote v;
  v.status = run.local == Local::kOk         ? VoteStatus::kOk
             : run.local == Local::kRollback ? VoteStatus::kRollback
                                             : VoteStatus::kFailed;
  v.code = run.local == Local::kFailed ? run.failure.code() : StatusCode::kOk;
  v.step = step_;
  v.units = run.local_units;
  v.micro_limit = controller_.limit();
  v.had_oom = run.rep.ooms > 0;
  if (options_.device != nullptr) {
    MemoryStats m = options_.device->Stats();
    v.allocated = m.allocated;
    v.reserved = m.reserved;
    v.peak_allocated = m.peak_allocated;
  }
  v.committed = committed_step_;
  if (RecoveryStore* store = options_.recovery; store != nullptr) {
    v.snapshot = store->SnapshotStep();
    v.durable = store->DurableSteps();
  }
  return v;
}

State GuardImpl::Vote(Run& run) {
  auto vote = channel_.Vote(MyVote(run));
  if (!vote.ok()) return EndCoordination(run, vote.status());
  run.vote = std::move(vote).value();
  const internal::VoteOutcome& v = run.vote;
  run.rep.global_units = v.total_units;
  if (coordinator_->rank() != 0) committed_step_ = std::max(committed_step_, v.committed);
  // Every rank's memory, so that incidents show rank imbalance.
  if (v.any_oom && coordinator_->size() > 1) {
    std::vector<RankMemory> ranks;
    for (size_t r = 0; r < v.ranks.size(); ++r)
      ranks.push_back(RankMemory{static_cast<int>(r), v.ranks[r].allocated, v.ranks[r].reserved,
                                 v.ranks[r].peak_allocated});
    for (auto& inc : run.rep.incidents) inc.ranks = ranks;
  }
  if (options_.uniform_micro_batch && v.min_micro_limit < controller_.limit()) controller_.SetLimit(v.min_micro_limit);
  if (v.status == VoteStatus::kFailed) return EndFailed(run);
  if (v.status == VoteStatus::kRollback) {
    // The same words on every rank: a local rollback vote means an OOM that
    // splitting cannot fix.
    size_t asking = 0;
    while (asking + 1 < v.ranks.size() && v.ranks[asking].status != VoteStatus::kRollback) ++asking;
    run.rollback_why = (coordinator_->size() > 1 ? "rank " + std::to_string(asking) + " ran" : "ran") +
                       std::string(" out of memory at step ") + std::to_string(step_) + " at its smallest micro-batch (" +
                       std::to_string(v.ranks[asking].micro_limit) + ")";
    run.rollback_size = v.ranks[asking].micro_limit;
    return State::kRollback;
  }
  return State::kSync;
}

State GuardImpl::Sync(Run& run) {
  internal::SyncStatus mine;
  fault_ctx_.micro = -1;
  SetCurrentFaultContext(fault_ctx_);
  phase_ = Phase::kCommit;
  try {
    FaultPoint(FaultSite::kCommit, fault_ctx_);
    FaultPoint(FaultSite::kSync, fault_ctx_);
  } catch (...) {
    std::exception_ptr error = std::current_exception();
    if (ClassifyException(error).is_oom()) {
      mine.oom = true;
      HandleOom(run, std::move(error), Where::kCommit);
    } else {
      mine.error = true;
      run.error = std::move(error);
      run.local = Local::kFailed;
      run.failure = Status::Cancelled(FailureText(run));
    }
  }
  // This rank's share of the global batch: sum_r share_r * mean_r is the mean
  // over every unit of the global batch. A rank that failed contributes zeros.
  const double share = run.vote.total_units > 0
                           ? static_cast<double>(run.local_units) / static_cast<double>(run.vote.total_units)
                           : 0.0;
  const bool failed = mine.oom || mine.error;
  for (SumBuffer& b : run.buffers) b.scale = failed ? 0.0 : share;
  auto synced = channel_.Sync(run.buffers, mine);
  if (!synced.ok()) return EndCoordination(run, synced.status());
  if (synced->error_ranks > 0) return EndFailed(run);
  if (synced->oom_ranks > 0) {
    // Nobody applied anything: every rank resets and redoes the step, the
    // ranks that failed at their new size.
    ++run.rep.redone;
    if (run.rep.redone > options_.max_ooms_per_step)
      return Done(run,
                  Status::ResourceExhausted("step " + std::to_string(step_) + " was redone " +
                                            std::to_string(run.rep.redone - 1) +
                                            " times because ranks ran out of memory in the gradient sync "
                                            "(max_ooms_per_step); remedies: " + kGenericRemedies),
                  IncidentOutcome::kFailed);
    if (!run.reset) {
      run.local = Local::kFailed;
      run.failure = Status::FailedPrecondition(
          "another rank ran out of memory in the gradient sync of step " + std::to_string(step_) +
          ": the step must be redone, and no reset hook is set (StepRequest.reset or Guard::SetResetHook)");
      return State::kLocal;
    }
    if (Reset(run) && run.local == Local::kOk && !mine.oom) PlanAnew(run);
    Logger()->info("step {} is redone: {} rank(s) ran out of memory in the gradient sync", step_, synced->oom_ranks);
    return State::kLocal;
  }
  return State::kApply;
}

State GuardImpl::Apply(Run& run) {
  phase_ = Phase::kOptimizer;
  try {
    FaultPoint(FaultSite::kApply, fault_ctx_);
    if (run.req.apply) run.req.apply();
  } catch (...) {
    HandleApplyFailure(run, std::current_exception());
  }
  return State::kAgree;
}

void GuardImpl::HandleApplyFailure(Run& run, std::exception_ptr error) {
  const auto t_oom = Clock::now();
  OomInfo info = ClassifyException(error);
  if (!info.is_oom()) {
    run.applied = kApplyError;
    run.error = std::move(error);
    run.local = Local::kFailed;
    run.failure = Status::Cancelled(FailureText(run));
    return;
  }
  run.applied = kApplyOom;
  MemoryStats mem = StatsAtFailure(error, options_.device);
  error = nullptr;
  MicroBatch whole;
  whole.cost = run.largest;
  whole.index = -1;
  Incident inc = NewIncident(info, mem, whole, run.req);
  ++run.rep.ooms;
  ++total_ooms_;
  steps_ok_since_oom_ = 0;
  const double user_ms = ReleaseCaches();
  ++run.rep.cache_releases;
  inc.actions.emplace_back(LadderActionName(LadderAction::kRelease));
  // Parameters may be half-updated: only a restore can put them back. The redo
  // runs at a smaller micro-batch, freeing room for optimizer state.
  controller_.OnOom(std::max<int64_t>(run.largest, options_.min_micro_batch));
  inc.micro_after = EffectiveLimit(run.req);
  inc.action = std::string(LadderActionName(LadderAction::kRollback));
  inc.actions.emplace_back(inc.action);
  run.rep.recovery_ms += std::max(0.0, MsSince(t_oom) - user_ms);
  Logger()->warn("OOM ({}) in the optimizer apply at step {}: parameters may be half-updated", inc.kind, step_);
  RecordIncident(run, std::move(inc));
}

State GuardImpl::Agree(Run& run) {
  const int64_t mine[2] = {run.applied, controller_.limit()};
  auto all = channel_.Agree(mine);
  if (!all.ok()) return EndCoordination(run, all.status());
  int oom_rank = -1;
  bool error = false;
  for (size_t r = 0; r < all->size(); ++r) {
    if ((*all)[r][0] == kApplyError) error = true;
    if ((*all)[r][0] == kApplyOom && oom_rank < 0) oom_rank = static_cast<int>(r);
  }
  if (error) return EndFailed(run);
  if (oom_rank >= 0) {
    run.rollback_why = (coordinator_->size() > 1 ? "rank " + std::to_string(oom_rank) + " ran" : "ran") +
                       std::string(" out of memory in the optimizer apply at step ") + std::to_string(step_);
    run.rollback_size = (*all)[static_cast<size_t>(oom_rank)][1];
    return State::kRollback;
  }
  CommitStep(run);
  return Done(run, Status::Ok(), IncidentOutcome::kRecovered);
}

void GuardImpl::CommitStep(Run& run) {
  StepReport& rep = run.rep;
  rep.micro_batches = run.plan.empty() ? 0 : run.plan.back().index + 1;
  controller_.OnSuccess(run.largest, /*limit_bound=*/rep.micro_batches > 1);
  rep.largest_micro = run.largest;
  if (options_.device != nullptr) {
    peaks_.push_back(options_.device->Stats().peak_allocated);
    while (static_cast<int>(peaks_.size()) > options_.history_steps) peaks_.pop_front();
  }
  ++steps_ok_since_oom_;
  if (options_.priors != nullptr && !options_.workload.empty() && run.largest > 0) {
    Status p = options_.priors->RecordCleanMicroBatch(options_.workload, run.largest);
    if (!p.ok()) Logger()->debug("recording the clean micro-batch failed: {}", p.ToString());
  }
  const int64_t done = step_++;
  if (done >= rollback_from_) rollback_repeats_ = 0;
  RecoveryStore* store = options_.recovery;
  if (store == nullptr) return;
  // Rank 0 commits the checkpoints durable on every rank, oldest first (saves
  // lag behind training, so several may have completed since the last
  // vote; retention keeps the newest of them); the others learn of it from
  // rank 0's next vote.
  if (coordinator_->rank() == 0) {
    for (int64_t step : run.vote.common_durable) {
      if (step <= committed_step_) continue;
      Status c = Contained([&] { return store->CommitDurable(step, coordinator_->size()); });
      if (!c.ok()) {
        Logger()->warn("committing checkpoint of step {} failed (retried at a later step): {}", step, c.ToString());
        break;
      }
      committed_step_ = step;
    }
  }
  rep.checkpoint_step = committed_step_;
  // Every rank saves after the same steps: the trigger comes from the vote.
  // The step is committed on every rank: an error here (a user's save
  // callback raising) costs this rank's checkpoint of the step, which the
  // ranks' durable sets then lack, never the step itself.
  Status s;
  try {
    s = store->OnStepCommitted(done, run.vote.any_oom);
  } catch (...) {
    s = Status::Internal(DescribeException(std::current_exception()));
  }
  if (!s.ok()) Logger()->error("checkpoint after step {} failed: {}", done, s.ToString());
}

State GuardImpl::EndFailed(Run& run) {
  internal::StepChannel::Reason mine;
  if (run.local == Local::kFailed) mine = {run.failure.code(), FailureText(run)};
  auto reasons = channel_.ShareReasons(mine);
  if (!reasons.ok()) return EndCoordination(run, reasons.status());
  int first = -1, count = 0;
  for (size_t r = 0; r < reasons->size(); ++r) {
    if ((*reasons)[r].code == StatusCode::kOk) continue;
    if (first < 0) first = static_cast<int>(r);
    ++count;
  }
  run.rep.failed_rank = first;
  if (run.local == Local::kFailed) {
    Logger()->error("step {} stopped on this rank: {}", step_, FailureText(run));
    return Done(run, run.failure, IncidentOutcome::kFailed);
  }
  if (first < 0)  // cannot happen: a failure was seen; stay on the safe side
    return Done(run, Status::Internal("a rank failed at step " + std::to_string(step_) + " without a reason"),
                IncidentOutcome::kFailed);
  const internal::StepChannel::Reason& why = (*reasons)[static_cast<size_t>(first)];
  std::string msg = "rank " + std::to_string(first) + " stopped at step " + std::to_string(step_) + ": " + why.text;
  if (count > 1) msg += " (and " + std::to_string(count - 1) + " other rank(s))";
  Logger()->error("{}", msg);
  // The job cannot fit when the failing rank ran out of memory; otherwise this
  // rank's step was cancelled on the failing rank's account.
  Status s = why.code == StatusCode::kResourceExhausted ? Status::ResourceExhausted(msg) : Status::Cancelled(msg);
  return Done(run, s, IncidentOutcome::kFailed);
}

State GuardImpl::EndCoordination(Run& run, const Status& why) {
  if (why.code() == StatusCode::kUnavailable || why.code() == StatusCode::kAborted) {
    OomInfo info;
    info.exception_type = "oomguard::Coordinator";
    info.message = why.ToString();
    MicroBatch none;
    none.index = -1;
    Incident inc = NewIncident(info, options_.device != nullptr ? options_.device->Stats() : MemoryStats{}, none,
                               run.req);
    inc.kind = "coordination";
    inc.phase = "vote";
    inc.action = std::string(LadderActionName(LadderAction::kGiveUp));
    RecordIncident(run, std::move(inc));
    Logger()->error("coordination failed at step {}: {}; exit with code {} so that the launcher restarts every rank",
                    step_, why.ToString(), kExitCoordinationTimeout);
    return Done(run, why.code() == StatusCode::kUnavailable ? why : Status::Unavailable(why.message()),
                IncidentOutcome::kFailed);
  }
  Logger()->error("step {} stopped: {}", step_, why.ToString());
  return Done(run, why, IncidentOutcome::kFailed);
}

internal::RankPoints GuardImpl::MyPoints() {
  internal::RankPoints mine;
  RecoveryStore* store = options_.recovery;
  if (store == nullptr) return mine;
  // Saves in flight may land a newer common step; their failures show as
  // steps missing from the list.
  Status w = Contained([&] {
    Status waited = store->WaitDurable();
    mine.durable = store->DurableSteps();
    mine.snapshot = store->SnapshotStep();
    return waited;
  });
  if (!w.ok()) Logger()->warn("before restoring: {}", w.ToString());
  mine.has_store = true;
  return mine;
}

StatusOr<int64_t> GuardImpl::RestoreAgreed(const std::vector<internal::RankPoints>& points,
                                           const std::vector<int64_t>& candidates, std::string* tried) {
  RecoveryStore* store = options_.recovery;
  const int world = coordinator_->size();
  for (int64_t target : candidates) {
    // A rank without that snapshot loads it from disk: rank 0 commits its
    // manifest first, and every rank hears whether that worked before loading.
    const bool from_disk = std::any_of(points.begin(), points.end(), [&](const internal::RankPoints& p) {
      return !(p.snapshot && *p.snapshot == target);
    });
    if (from_disk && world > 1) {
      int64_t code = 0;
      if (coordinator_->rank() == 0)
        code = static_cast<int64_t>(Contained([&] { return store->CommitDurable(target, world); }).code());
      auto heard = channel_.Agree({&code, 1});
      if (!heard.ok()) return heard.status();
      if ((*heard)[0][0] != 0) {
        *tried += "; step " + std::to_string(target) + ": rank 0 could not commit its manifest";
        continue;
      }
      committed_step_ = std::max(committed_step_, target);
    }
    Status restored = store != nullptr ? Contained([&] { return store->Restore(target); })
                                       : Status::FailedPrecondition("no recovery store");
    const int64_t result[2] = {restored.ok() ? 0 : 1, target};
    auto confirmed = channel_.Agree(result);
    if (!confirmed.ok()) return confirmed.status();
    std::string failed_ranks;
    for (size_t r = 0; r < confirmed->size(); ++r)
      if ((*confirmed)[r][0] != 0 || (*confirmed)[r][1] != target) failed_ranks += " " + std::to_string(r);
    if (!restored.ok()) Logger()->warn("restoring step {} failed here: {}", target, restored.ToString());
    if (failed_ranks.empty()) return target;  // every rank holds `target` now
    *tried += "; step " + std::to_string(target) + ": could not be restored on rank(s)" + failed_ranks;
  }
  return Status::NotFound("no step that every rank holds could be restored" + *tried);
}

State GuardImpl::Rollback(Run& run) {
  const int world = coordinator_->size();
  const std::string& why = run.rollback_why;
  // The abandoned step's gradients must not leak into the redo. A reset that
  // raises leaves this rank with nothing to offer: every rank then stops.
  const bool reset_ok = !run.reset || Reset(run);
  auto points = channel_.ExchangePoints(reset_ok ? MyPoints() : internal::RankPoints{});
  if (!points.ok()) return EndCoordination(run, points.status());
  const std::vector<int64_t> candidates = internal::CommonRestorableSteps(*points, step_);
  const std::string size = "micro-batch " + std::to_string(run.rollback_size);
  if (candidates.empty())
    return Done(run,
                Status::ResourceExhausted(why + "; no checkpoint to roll back to" + (world > 1 ? " on every rank" : "") +
                                          "; remedies: " + kGenericRemedies),
                IncidentOutcome::kFailed);
  if (candidates.front() == rollback_target_ && rollback_repeats_ >= options_.max_rollbacks_per_step)
    return Done(run,
                Status::ResourceExhausted(why + "; rolled back to step " + std::to_string(rollback_target_) + " " +
                                          std::to_string(rollback_repeats_) +
                                          " times in a row without getting past step " + std::to_string(step_) +
                                          " (max_rollbacks_per_step), at " + size + "; remedies: " +
                                          kGenericRemedies),
                IncidentOutcome::kFailed);
  std::string tried;
  auto restored = RestoreAgreed(*points, candidates, &tried);
  if (!restored.ok()) {
    if (restored.status().code() != StatusCode::kNotFound) return EndCoordination(run, restored.status());
    return Done(run, Status::DataLoss(why + "; " + restored.status().message()), IncidentOutcome::kFailed);
  }
  const int64_t target = *restored;
  if (target == rollback_target_) {
    ++rollback_repeats_;
  } else {
    rollback_target_ = target;
    rollback_repeats_ = 1;
  }
  rollback_from_ = std::max(rollback_from_, step_);
  run.rep.rolled_back_to = target;
  step_ = target + 1;
  run.rep.checkpoint_step = committed_step_;
  Logger()->warn("rolled back to step {} ({}); continuing at {}", target, why, size);
  return Done(run,
              Status::Aborted(why + "; rolled back to step " + std::to_string(target) + ", continue from step " +
                              std::to_string(step_)),
              IncidentOutcome::kRolledBack);
}

StatusOr<int64_t> GuardImpl::Resume() {
  if (options_.recovery == nullptr)
    return Status::FailedPrecondition("Guard::Resume needs GuardOptions.recovery (a checkpointer)");
  auto points = channel_.ExchangePoints(MyPoints());
  if (!points.ok()) return points.status();
  const std::vector<int64_t> candidates = internal::CommonRestorableSteps(*points, INT64_MAX);
  if (candidates.empty()) return Status::NotFound("no checkpoint that every rank holds");
  std::string tried;
  auto restored = RestoreAgreed(*points, candidates, &tried);
  if (!restored.ok()) {
    if (restored.status().code() != StatusCode::kNotFound) return restored.status();
    return Status::DataLoss(restored.status().message());
  }
  step_ = *restored + 1;
  committed_step_ = std::max(committed_step_, *restored);
  snapshot_checked_ = true;  // the resumed step is durable: no initial snapshot needed
  Logger()->info("resumed from the checkpoint of step {} (every rank holds it)", *restored);
  return *restored;
}

Status GuardImpl::Conclude(Run& run) {
  StepReport& rep = run.rep;
  FinishIncidents(rep.incidents, run.outcome);
  for (auto& inc : rep.incidents) inc.recovery_ms = rep.recovery_ms;
  rep.status = run.status;
  rep.limit_after = EffectiveLimit(run.req);
  rep.wall_ms = MsSince(run.started);
  if (options_.device != nullptr) rep.peak_allocated = options_.device->Stats().peak_allocated;
  fault_ctx_.micro = -1;
  SetCurrentFaultContext(fault_ctx_);
  phase_ = Phase::kUnknown;
  // A user's own exception passes through unchanged, now that every rank knows.
  if (run.error) std::rethrow_exception(run.error);
  return run.status;
}

StatusOr<int64_t> GuardImpl::Finish() {
  RecoveryStore* store = options_.recovery;
  internal::RankPoints mine;
  Status saved;
  if (store != nullptr) {
    mine.has_store = true;
    try {
      saved = store->WaitDurable();
      mine.durable = store->DurableSteps();
    } catch (const std::exception& e) {
      saved = Status::Internal(std::string("waiting for the last checkpoint: ") + e.what());
    }
  }
  auto points = channel_.ExchangePoints(mine);
  if (!points.ok()) return points.status();
  // The steps durable on every rank not committed yet, oldest first (no
  // snapshots: only disk outlives the run). Rank 0 commits them.
  std::vector<int64_t> common;
  for (int64_t step : (*points)[0].durable)
    if (step > committed_step_ && std::all_of(points->begin(), points->end(), [&](const internal::RankPoints& p) {
          return p.has_store && std::binary_search(p.durable.begin(), p.durable.end(), step);
        }))
      common.push_back(step);
  Status commit;
  if (coordinator_->rank() == 0) {
    for (int64_t step : common) {
      commit = Contained([&] { return store->CommitDurable(step, coordinator_->size()); });
      if (!commit.ok()) break;
      committed_step_ = step;
    }
  }
  const int64_t words[3] = {static_cast<int64_t>(saved.code()), static_cast<int64_t>(commit.code()),
                            committed_step_};
  auto agreed = channel_.Agree(words);
  if (!agreed.ok()) return agreed.status();
  bool any_failed = false;
  for (const auto& w : *agreed) any_failed = any_failed || w[0] != 0 || w[1] != 0;
  committed_step_ = std::max(committed_step_, (*agreed)[0][2]);
  if (!any_failed) return committed_step_;
  internal::StepChannel::Reason reason;
  if (!saved.ok()) {
    reason = {saved.code(), "the newest checkpoint save failed: " + saved.message()};
  } else if (!commit.ok()) {
    reason = {commit.code(), commit.message()};
  }
  auto reasons = channel_.ShareReasons(reason);
  if (!reasons.ok()) return reasons.status();
  for (size_t r = 0; r < reasons->size(); ++r) {
    const auto& why = (*reasons)[r];
    if (why.code == StatusCode::kOk) continue;
    return Status(why.code, "rank " + std::to_string(r) + ": " + why.text + "; the newest checkpoint complete on "
                                                                          "every rank is step " +
                                std::to_string(committed_step_));
  }
  return committed_step_;
}

}  // namespace

StatusOr<std::unique_ptr<Guard>> Guard::Create(const GuardOptions& options) {
  OOMGUARD_RETURN_IF_ERROR(ValidateGuardOptions(options));
  Status faults = LoadFaultRulesFromEnv();
  if (!faults.ok()) return Status::InvalidArgument(faults.message());  // names the variable and the rule
  return std::unique_ptr<Guard>(new GuardImpl(options));
}

}  // namespace oomguard
