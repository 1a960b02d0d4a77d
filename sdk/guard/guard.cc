// The guarded step: plan, run micro-batches, catch OOMs, walk the escalation
// ladder, vote, commit.
//
// Invariant that makes recovery exact: a micro-batch's weight is size / n, so
// micro-batches that completed before an OOM in the data or forward phase keep
// their contribution and only the rest of the step is re-planned; an OOM after
// backward started may have added part of a gradient, so the reset hook zeroes
// the gradients and the whole step is re-planned.
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

class GuardImpl final : public Guard {
 public:
  explicit GuardImpl(const GuardOptions& o)
      : options_(o),
        controller_(ControllerOptions(o)),
        run_id_(o.run_id.empty() ? internal::RandomHex16() : o.run_id) {
    if (options_.priors != nullptr && !options_.workload.empty()) {
      if (auto prior = options_.priors->PriorMicroBatch(options_.workload);
          prior && *prior >= 1 && *prior < controller_.limit()) {
        controller_.AdoptPrior(*prior);
        Logger()->info("workload '{}': starting at the learned micro-batch {}", options_.workload, controller_.limit());
      }
    }
    if (options_.coordinator == nullptr) {
      own_coordinator_ = MakeLocalCoordinator();
      coordinator_ = own_coordinator_.get();
    } else {
      coordinator_ = options_.coordinator;
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
  // The outcome of running the planned micro-batches of one step locally.
  enum class Local { kOk, kRollback, kFailed };

  // The limit as it applies to this request: "whole step" when it is larger.
  int64_t EffectiveLimit(const StepRequest& req) const {
    int64_t whole = req.samples;
    if (!req.costs.empty()) {
      whole = 0;
      for (int64_t c : req.costs) whole += c;
    }
    return std::min(controller_.limit(), std::max<int64_t>(whole, 1));
  }

  StatusOr<std::vector<MicroBatch>> MakePlan(const StepRequest& req, int64_t begin, int first_index) const {
    if (!req.costs.empty()) return PlanByCost(req.costs, controller_.limit(), begin, first_index);
    return PlanBySamples(req.samples, std::max<int64_t>(1, std::min(controller_.limit(), req.samples)),
                         begin, first_index);
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

  void RecordIncident(const Incident& inc) {
    if (options_.incidents == nullptr) return;
    try {
      options_.incidents->Record(inc);
    } catch (...) {
      // A failing knowledge base must never stop training.
      Logger()->warn("incident sink failed to record incident {}", inc.id);
    }
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

  // A collective failed (a peer stopped answering): record it and end the step.
  template <typename Finish>
  Status CoordinationFailure(const Status& why, const StepRequest& req, StepReport& rep, Finish& finish) {
    OomInfo info;
    info.exception_type = "oomguard::Coordinator";
    info.message = why.ToString();
    MicroBatch none;
    none.index = -1;
    Incident inc = NewIncident(info, options_.device != nullptr ? options_.device->Stats() : MemoryStats{}, none, req);
    inc.kind = "coordination";
    inc.phase = "vote";
    inc.action = std::string(LadderActionName(LadderAction::kGiveUp));
    RecordIncident(inc);
    rep.incidents.push_back(std::move(inc));
    Logger()->error("coordination failed at step {}: {}; exit with code {} so that the launcher restarts every rank",
                    step_, why.ToString(), kExitCoordinationTimeout);
    Status s = why.code() == StatusCode::kUnavailable ? why : Status::Unavailable(why.message());
    return finish(s, IncidentOutcome::kFailed);
  }

  GuardOptions options_;
  SizeController controller_;
  std::string run_id_;
  std::unique_ptr<Coordinator> own_coordinator_;
  Coordinator* coordinator_ = nullptr;
  std::function<void()> reset_;
  std::vector<std::pair<std::string, std::function<void()>>> releasers_;
  int64_t step_ = 0;
  Phase phase_ = Phase::kUnknown;
  FaultContext fault_ctx_;
  std::deque<int64_t> peaks_;
  int64_t steps_ok_since_oom_ = 0;
  int64_t total_ooms_ = 0;
  bool pending_rollback_ = false;
  int64_t committed_durable_ = -1;
};

Status GuardImpl::Step(const StepRequest& req, StepReport* report_out) {
  const auto t_step = Clock::now();
  StepReport local_report;
  StepReport& rep = report_out != nullptr ? *report_out : local_report;
  rep = StepReport{};
  rep.step = step_;

  // A bad request still takes part in the vote (as a failure), so that the
  // other ranks stop at once instead of waiting out their deadline.
  auto invalid = [&](std::string why) -> Status {
    if (coordinator_->size() > 1) {
      VoteInput v;
      v.status = VoteStatus::kFailed;
      (void)coordinator_->Vote(v, std::chrono::milliseconds(options_.vote_deadline_ms));
    }
    rep.status = Status::InvalidArgument(std::move(why));
    return rep.status;
  };
  if (req.samples < 1) return invalid("StepRequest.samples must be >= 1 (got " + std::to_string(req.samples) + ")");
  if (!req.micro) return invalid("StepRequest.micro must be set");
  if (!req.costs.empty() && static_cast<int64_t>(req.costs.size()) != req.samples)
    return invalid("StepRequest.costs has " + std::to_string(req.costs.size()) + " entries for " +
                   std::to_string(req.samples) + " samples");
  const std::function<void()>& reset = req.reset ? req.reset : reset_;
  rep.limit_before = EffectiveLimit(req);

  Device* device = options_.device;
  if (device != nullptr) device->ResetPeak();
  fault_ctx_ = FaultContext{step_, coordinator_->rank(), -1, 0};

  auto plan_or = MakePlan(req, 0, 0);
  if (!plan_or.ok()) return invalid(plan_or.status().message());
  std::vector<MicroBatch> plan = std::move(plan_or).value();

  Local local = Local::kOk;
  Status failure;  // why the step failed locally (kFailed)
  bool release_retry_used = false;
  int64_t largest = 0;
  size_t pos = 0;  // next micro-batch of `plan` to run

  // A rank whose commit failed already restored its snapshot; it runs no work
  // until the others have rolled back too (in this step's vote).
  if (pending_rollback_) pos = plan.size();

  // ---- micro-batches, with local recovery ----
  while (local == Local::kOk && pos < plan.size()) {
    std::exception_ptr error;
    try {
      for (; pos < plan.size(); ++pos) {
        const MicroBatch& mb = plan[pos];
        phase_ = Phase::kUnknown;
        fault_ctx_.micro = mb.index;
        fault_ctx_.size = mb.cost;
        SetCurrentFaultContext(fault_ctx_);
        FaultPoint(FaultSite::kMicroBatch, fault_ctx_);
        req.micro(mb);
        largest = std::max(largest, mb.cost);
      }
    } catch (...) {
      error = std::current_exception();
    }
    if (!error) break;

    const auto t_oom = Clock::now();
    OomInfo info = ClassifyException(error);
    if (!info.is_oom()) std::rethrow_exception(error);  // not ours: passes through unchanged

    const MicroBatch failed = plan[pos];
    const Phase phase = phase_;
    MemoryStats before = StatsAtFailure(error, device);
    // Drop the exception before releasing memory: it (or, in Python, its
    // traceback's frames) may be what still holds the memory.
    error = nullptr;
    Incident inc = NewIncident(info, before, failed, req);
    ++rep.ooms;
    ++total_ooms_;
    steps_ok_since_oom_ = 0;

    const int64_t free_before = device != nullptr ? device->Stats().free : 0;
    double user_ms = ReleaseCaches();
    ++rep.cache_releases;
    inc.actions.emplace_back(LadderActionName(LadderAction::kRelease));

    // Completed micro-batches survive an OOM before backward; otherwise the
    // gradients may hold part of the failed micro-batch.
    const bool keep = phase == Phase::kData || phase == Phase::kForward;
    if (!keep) {
      if (!reset) {
        inc.action = std::string(LadderActionName(LadderAction::kGiveUp));
        failure = Status::FailedPrecondition(
            "OOM in phase '" + std::string(PhaseName(phase)) + "' at step " + std::to_string(step_) +
            " after gradients may have been accumulated, and no reset hook is set (StepRequest.reset "
            "or Guard::SetResetHook); incident " + inc.id);
        inc.micro_after = EffectiveLimit(req);
        RecordIncident(inc);
        rep.incidents.push_back(std::move(inc));
        local = Local::kFailed;
        break;
      }
    }

    LadderAction action;
    const int64_t free_after = device != nullptr ? device->Stats().free : 0;
    const int64_t need = std::max<int64_t>(1, info.requested_bytes);
    if (options_.retry_after_release && !release_retry_used && device != nullptr &&
        free_after - free_before >= need) {
      // Releasing made room for the request: retry at the same size once.
      release_retry_used = true;
      action = LadderAction::kRelease;
    } else if (rep.ooms > options_.max_ooms_per_step) {
      action = LadderAction::kGiveUp;
    } else if (controller_.OnOom(failed.cost) && failed.size > 1) {
      // (A lone sample cannot be split, whatever its cost: it escalates.)
      action = LadderAction::kHalve;
      inc.actions.emplace_back(LadderActionName(action));
    } else if (options_.recovery != nullptr &&
               std::max(options_.recovery->DurableStep(), options_.recovery->SnapshotStep()) >= 0) {
      action = LadderAction::kRollback;
      inc.actions.emplace_back(LadderActionName(action));
    } else {
      action = LadderAction::kGiveUp;
    }
    inc.action = std::string(LadderActionName(action));
    inc.micro_after = EffectiveLimit(req);

    Logger()->warn("OOM ({}) in {} at step {} micro-batch {}/{} (size {}): requested {}, allocated {}, "
                   "reserved {}; released caches; {} -> micro-batch {}",
                   inc.kind, inc.phase, step_, failed.index + 1, failed.count, failed.cost,
                   FormatBytes(info.requested_bytes), FormatBytes(before.allocated),
                   FormatBytes(before.reserved), inc.action, inc.micro_after);

    if (action == LadderAction::kGiveUp || action == LadderAction::kRollback) {
      if (action == LadderAction::kGiveUp) {
        const bool bounded = rep.ooms > options_.max_ooms_per_step;
        failure = Status::ResourceExhausted(
            "out of memory at step " + std::to_string(step_) + " in phase '" + inc.phase + "' (" + inc.kind +
            ", requested " + FormatBytes(info.requested_bytes) + ") " +
            (bounded ? "after " + std::to_string(rep.ooms - 1) + " OOMs in one step (max_ooms_per_step)"
             : failed.size == 1 && failed.cost > options_.min_micro_batch
                 ? "in a micro-batch of one sample (cost " + std::to_string(failed.cost) +
                       ") that cannot be split, with no checkpoint to roll back to"
                 : "at the minimum micro-batch (" + std::to_string(options_.min_micro_batch) +
                       ") with no checkpoint to roll back to") +
            "; incident " + inc.id + "; remedies: " + kGenericRemedies);
        local = Local::kFailed;
      } else {
        local = Local::kRollback;
      }
      rep.recovery_ms += std::max(0.0, MsSince(t_oom) - user_ms);
      RecordIncident(inc);
      rep.incidents.push_back(std::move(inc));
      break;
    }

    // Re-plan: from the failed micro-batch when earlier work is kept, else from scratch.
    int64_t begin = failed.offset;
    int first_index = failed.index;
    if (!keep) {
      reset();
      begin = 0;
      first_index = 0;
      largest = 0;
    }
    auto replan = MakePlan(req, begin, first_index);
    if (!replan.ok()) return replan.status();
    plan = std::move(replan).value();
    pos = 0;
    ++rep.replans;
    rep.recovery_ms += std::max(0.0, MsSince(t_oom) - user_ms);
    RecordIncident(inc);
    rep.incidents.push_back(std::move(inc));
  }

  // ---- agreement, then commit ----
  auto finish = [&](Status s, IncidentOutcome outcome) {
    FinishIncidents(rep.incidents, outcome);
    for (auto& inc : rep.incidents) inc.recovery_ms = rep.recovery_ms;
    rep.status = s;
    rep.limit_after = EffectiveLimit(req);
    rep.wall_ms = MsSince(t_step);
    if (device != nullptr) rep.peak_allocated = device->Stats().peak_allocated;
    fault_ctx_.micro = -1;
    SetCurrentFaultContext(fault_ctx_);
    return s;
  };

  RecoveryStore* recovery = options_.recovery;
  const int world = coordinator_->size();
  // Restores `target` (agreed by every rank) and ends the step with kAborted.
  auto rollback = [&](int64_t target, const std::string& why) -> Status {
    if (recovery == nullptr || target < 0)
      return finish(Status::ResourceExhausted(why + "; no checkpoint to roll back to" +
                                              (world > 1 ? " on every rank" : "") +
                                              "; remedies: " + kGenericRemedies),
                    IncidentOutcome::kFailed);
    auto restored = recovery->Restore(target);
    if (!restored.ok()) return finish(restored.status(), IncidentOutcome::kFailed);
    // The abandoned step's gradients must not leak into the redo.
    if (reset) reset();
    rep.rolled_back_to = *restored;
    step_ = *restored + 1;
    Logger()->warn("rolled back to step {} ({}); continuing at micro-batch {}", *restored, why, EffectiveLimit(req));
    return finish(Status::Aborted(why + "; rolled back to step " + std::to_string(*restored) +
                                  ", continue from step " + std::to_string(step_)),
                  IncidentOutcome::kRolledBack);
  };
  auto restorable = [&]() -> int64_t {
    return recovery == nullptr ? -1 : std::max(recovery->DurableStep(), recovery->SnapshotStep());
  };

  VoteInput vin;
  vin.status = local == Local::kOk ? VoteStatus::kOk
               : local == Local::kRollback ? VoteStatus::kRollback
                                           : VoteStatus::kFailed;
  if (pending_rollback_) vin.status = std::max(vin.status, VoteStatus::kRollback);
  vin.durable_step = recovery != nullptr ? recovery->DurableStep() : -1;
  vin.snapshot_step = recovery != nullptr ? recovery->SnapshotStep() : -1;
  vin.micro_limit = controller_.limit();
  vin.had_oom = rep.ooms > 0;
  try {
    FaultPoint(FaultSite::kVote, fault_ctx_);
  } catch (...) {
    // An injected OOM at the vote site: there is nothing to split here, so
    // this rank fails the step, but it still votes so its peers never wait.
    OomInfo info = ClassifyException(std::current_exception());
    if (!info.is_oom()) throw;
    failure = Status::ResourceExhausted("out of memory at the vote of step " + std::to_string(step_) + ": " +
                                        info.message);
    vin.status = VoteStatus::kFailed;
    local = Local::kFailed;
  }
  const auto deadline = std::chrono::milliseconds(options_.vote_deadline_ms);
  auto vote = coordinator_->Vote(vin, deadline);
  if (!vote.ok()) return CoordinationFailure(vote.status(), req, rep, finish);

  // Every rank's memory, gathered only when some rank had an OOM (collective:
  // every rank takes part), so incidents show rank imbalance.
  if (vote->any_oom && world > 1) {
    MemoryStats m = device != nullptr ? device->Stats() : MemoryStats{};
    RankMemory mine{coordinator_->rank(), m.allocated, m.reserved, m.peak_allocated};
    auto ranks = coordinator_->GatherMemory(mine, deadline);
    if (!ranks.ok()) return CoordinationFailure(ranks.status(), req, rep, finish);
    for (auto& inc : rep.incidents) inc.ranks = *ranks;
  }
  // Rank 0 commits a checkpoint once every rank's state of it is durable.
  // Every rank tracks the committed step, so that all take the same branches.
  bool committed_now = recovery != nullptr && vote->min_durable_step > committed_durable_;
  if (committed_now) {
    if (coordinator_->rank() == 0) {
      Status c = recovery->CommitDurable(vote->min_durable_step, world);
      if (!c.ok()) Logger()->warn("committing checkpoint of step {} failed: {}", vote->min_durable_step, c.ToString());
    }
    committed_durable_ = vote->min_durable_step;
  }

  if (options_.uniform_micro_batch && vote->min_micro_limit < controller_.limit())
    controller_.SetLimit(vote->min_micro_limit);
  if (local == Local::kFailed) return finish(failure, IncidentOutcome::kFailed);
  if (vote->status == VoteStatus::kFailed)
    return finish(Status::ResourceExhausted("another rank could not recover from an OOM at step " +
                                            std::to_string(step_) + " (or stopped with an error); stopping with it"),
                  IncidentOutcome::kFailed);
  if (vote->status == VoteStatus::kRollback) {
    pending_rollback_ = false;
    // The newest step every rank can restore: a snapshot that every rank holds
    // in memory (instant), else the newest checkpoint durable on every rank.
    const bool same_snapshot = vote->min_snapshot_step >= 0 && vote->min_snapshot_step == vote->max_snapshot_step;
    int64_t target = same_snapshot ? std::max(vote->min_durable_step, vote->min_snapshot_step) : vote->min_durable_step;
    if (world > 1 && !same_snapshot && recovery != nullptr) {
      // The ranks' snapshots differ (one rank's commit failed while the others
      // saved): only the disk has a common step. Let the saves in flight land
      // and agree once more on the newest step durable everywhere. Rare, so the
      // second collective costs nothing in normal steps.
      VoteInput again;
      again.status = VoteStatus::kRollback;
      again.durable_step = recovery->WaitDurable();
      again.snapshot_step = recovery->SnapshotStep();
      again.micro_limit = controller_.limit();
      auto v2 = coordinator_->Vote(again, deadline);
      if (!v2.ok()) return CoordinationFailure(v2.status(), req, rep, finish);
      target = v2->min_durable_step;
      if (target > committed_durable_) {
        if (coordinator_->rank() == 0) {
          Status c = recovery->CommitDurable(target, world);
          if (!c.ok()) Logger()->warn("committing checkpoint of step {} failed: {}", target, c.ToString());
        }
        committed_durable_ = target;
        committed_now = true;
      }
    }
    Logger()->info("rollback agreed at step {}: durable on every rank {}, snapshots {}..{}, target {}", step_,
                   vote->min_durable_step, vote->min_snapshot_step, vote->max_snapshot_step, target);
    if (world > 1 && committed_now && target == committed_durable_) {
      // Rank 0 has just written that checkpoint's manifest: nobody loads it
      // before it exists.
      Status b = coordinator_->Barrier(deadline);
      if (!b.ok()) return CoordinationFailure(b, req, rep, finish);
    }
    return rollback(target,
                    local == Local::kRollback ? "out of memory at the minimum micro-batch at step " + std::to_string(step_)
                                              : "a rank asked for a rollback at step " + std::to_string(step_));
  }
  // Every rank is ready: gradient synchronisation and the optimizer step.
  if (req.commit) {
    std::exception_ptr error;
    try {
      fault_ctx_.micro = -1;
      phase_ = Phase::kCommit;
      FaultPoint(FaultSite::kCommit, fault_ctx_);
      req.commit();
    } catch (...) {
      error = std::current_exception();
    }
    if (error) {
      const auto t_oom = Clock::now();
      OomInfo info = ClassifyException(error);
      if (!info.is_oom()) std::rethrow_exception(error);
      MemoryStats mem = StatsAtFailure(error, device);
      error = nullptr;
      MicroBatch whole;
      whole.cost = largest;
      whole.index = -1;
      Incident inc = NewIncident(info, mem, whole, req);
      ++rep.ooms;
      ++total_ooms_;
      steps_ok_since_oom_ = 0;
      double user_ms = ReleaseCaches();
      ++rep.cache_releases;
      inc.actions.emplace_back(LadderActionName(LadderAction::kRelease));
      // Parameters may be half-updated: only a snapshot can put them back. The
      // redo runs at a smaller micro-batch, freeing room for optimizer state.
      controller_.OnOom(std::max<int64_t>(largest, options_.min_micro_batch));
      inc.micro_after = EffectiveLimit(req);
      inc.action = std::string(LadderActionName(LadderAction::kRollback));
      inc.actions.emplace_back(inc.action);
      rep.recovery_ms += std::max(0.0, MsSince(t_oom) - user_ms);
      Logger()->warn("OOM ({}) in the optimizer step at step {}: parameters may be half-updated", inc.kind, step_);
      RecordIncident(inc);
      rep.incidents.push_back(std::move(inc));
      // The other ranks committed: the next vote carries the rollback to them,
      // and every rank then restores the same step.
      if (world > 1) pending_rollback_ = true;
      return rollback(restorable(), "out of memory inside commit (optimizer step) at step " + std::to_string(step_));
    }
  }

  rep.micro_batches = plan.empty() ? 0 : plan.back().index + 1;
  controller_.OnSuccess(largest, /*limit_bound=*/rep.micro_batches > 1);
  rep.largest_micro = largest;
  if (device != nullptr) {
    peaks_.push_back(device->Stats().peak_allocated);
    while (static_cast<int>(peaks_.size()) > options_.history_steps) peaks_.pop_front();
  }
  ++steps_ok_since_oom_;
  if (options_.priors != nullptr && !options_.workload.empty() && largest > 0) {
    Status p = options_.priors->RecordCleanMicroBatch(options_.workload, largest);
    if (!p.ok()) Logger()->debug("recording the clean micro-batch failed: {}", p.ToString());
  }
  const int64_t done_step = step_++;
  if (recovery != nullptr) {
    // Agreed by the vote, so that every rank snapshots the same steps.
    Status s = recovery->OnStepCommitted(done_step, vote->any_oom);
    if (!s.ok()) Logger()->warn("checkpoint after step {} failed: {}", done_step, s.ToString());
  }
  return finish(Status::Ok(), IncidentOutcome::kRecovered);
}

}  // namespace

StatusOr<std::unique_ptr<Guard>> Guard::Create(const GuardOptions& options) {
  OOMGUARD_RETURN_IF_ERROR(ValidateGuardOptions(options));
  Status faults = LoadFaultRulesFromEnv();
  if (!faults.ok()) return Status::InvalidArgument(faults.message());  // names the variable and the rule
  return std::unique_ptr<Guard>(new GuardImpl(options));
}

}  // namespace oomguard
