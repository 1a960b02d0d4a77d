// The guarded step: a state machine that every rank runs through the same
// collectives in the same order, whatever fails on which rank.
//
//   kLocal     micro-batches with local OOM recovery, then the sync buffers
//              and the vote fault site (an OOM anywhere here: the ladder)
//   kVote      the commit and sync fault sites (an OOM there: a redo flag),
//              then every rank's outcome (Allgather), carrying the sync
//              buffers when they are small (step_protocol.h). failed ->
//              kDone for all; rollback -> kRollback for all; a redo flag ->
//              every rank resets and redoes the step (kLocal), the failing
//              rank at its new size; ok -> kApply when the vote carried every
//              rank's buffers (each rank sums them itself), else kSync
//   kSync      the sum of the sync buffers, on every rank (nothing can fail
//              between the vote and it)
//   kApply     the optimizer apply
//   kAgree     every rank's apply outcome. An OOM on some rank: kRollback
//              for all; an error: kDone for all; else the step commits
//              (and rank 0 commits the checkpoints every rank holds:
//              checkpoint_commit.h)
//   kRollback  every rank restores the same step, chosen from the steps
//              every rank holds, confirmed after restoring
// The states live in guard.cc (kLocal), guard_agreement.cc (kVote to kAgree)
// and guard_restore.cc (kRollback; Resume and Finish).
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

#include "sdk/guard/guard_impl.h"

namespace oomguard {

Guard::~Guard() = default;

namespace guard_internal {

MemoryStats StatsAtFailure(const std::exception_ptr& e, Device* device, bool* at_failure) {
  if (at_failure != nullptr) *at_failure = false;
  try {
    std::rethrow_exception(e);
  } catch (const DeviceOomError& oom) {
    const MemoryStats& s = oom.stats();
    if (s.total > 0 || s.reserved > 0) {
      if (at_failure != nullptr) *at_failure = true;
      return s;
    }
  } catch (...) {
  }
  if (device == nullptr) return MemoryStats{};
  MemoryStats s = device->Stats();
  if (at_failure != nullptr) *at_failure = s.total > 0;
  return s;
}

bool IsCommunicatorFailure(std::string_view message) {
  for (std::string_view mark : {"NCCL error", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
                                "ncclRemoteError", "ProcessGroupNCCL", "NCCL WARN", "NCCL communicator"})
    if (message.find(mark) != std::string_view::npos) return true;
  return false;
}

const char* const kGenericRemedies =
    "reduce activation memory (mixed precision saves about 30-50%; activation checkpointing "
    "saves about 60-70% of activations for 20-30% more compute); lower min_micro_batch or the "
    "sequence length; leave 20-30% headroom; shard optimizer state (ZeRO) or offload it";

Status ValidatePerSample(std::string_view what, int64_t samples, std::span<const int64_t> costs,
                         std::span<const int64_t> units) {
  const std::string name(what);
  if (samples < 1) return Status::InvalidArgument(name + ".samples must be >= 1 (got " + std::to_string(samples) + ")");
  if (!costs.empty() && static_cast<int64_t>(costs.size()) != samples)
    return Status::InvalidArgument(name + ".costs has " + std::to_string(costs.size()) + " entries for " +
                                   std::to_string(samples) + " samples");
  if (!units.empty() && static_cast<int64_t>(units.size()) != samples)
    return Status::InvalidArgument(name + ".units has " + std::to_string(units.size()) + " entries for " +
                                   std::to_string(samples) + " samples");
  int64_t total = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    if (units[i] < 0)
      return Status::InvalidArgument(name + ".units[" + std::to_string(i) + "] is negative (" +
                                     std::to_string(units[i]) + ")");
    // Every micro-batch's weight is its units over their sum: a sum that
    // wraps would weigh the step wrongly (or by zero) without a sign.
    if (__builtin_add_overflow(total, units[i], &total))
      return Status::InvalidArgument(name + ".units overflow: their sum passes 2^63 - 1 at units[" +
                                     std::to_string(i) + "] (" + std::to_string(units[i]) + ")");
  }
  return Status::Ok();
}

Status GuardImpl::ValidateRequest(const StepRequest& req) const {
  if (step_ < 0 || step_ > kMaxStep)
    return Status::InvalidArgument("the step counter is at " + std::to_string(step_) + ", past the last step (" +
                                   std::to_string(kMaxStep) + ") a checkpoint can name");
  if (!req.micro) return Status::InvalidArgument("StepRequest.micro must be set");
  OOMGUARD_RETURN_IF_ERROR(ValidatePerSample("StepRequest", req.samples, req.costs, req.units));
  // A redo needs the reset hook. Found here, on the first step, rather than at
  // the first OOM in backward or the first peer failure (in production, at
  // the worst moment). A training step (apply or sync) accumulates gradients
  // across micro-batches; with several ranks any step may be redone because
  // another rank failed.
  if (!req.reset && (req.apply || req.sync || coordinator_->size() > 1))
    return Status::FailedPrecondition(
        std::string("StepRequest.reset must be set: ") +
        (coordinator_->size() > 1 ? "with " + std::to_string(coordinator_->size()) +
                                        " ranks a step is redone when another rank fails"
                                  : std::string("a step with apply or sync is redone after an OOM in backward")) +
        ", and the redo must start from zeroed gradients");
  return Status::Ok();
}

// An OOM in the very first apply (optimizer state allocation, the most common
// real OOM) can roll back only if the state before it is kept somewhere.
void GuardImpl::EnsureInitialSnapshot(Run& run) {
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
    // Not the SDK's to swallow (a save callback's KeyboardInterrupt): this
    // rank fails the step with it, rethrown once the others know.
    run.FailWith(std::current_exception(), "saving the initial state raised: ");
  }
}

Status GuardImpl::Step(const StepRequest& req, StepReport* report_out) {
  // From inside a step's callbacks (micro calling step): a nested step would
  // run on this step's state and number. Refused at once, without a vote: the
  // outer step is still running on every rank.
  if (in_step_)
    return Status::FailedPrecondition("Guard::Step called inside a step (from its callbacks): steps do not nest");
  in_step_ = true;
  struct Leave {
    bool* in_step;
    ~Leave() { *in_step = false; }
  } leave{&in_step_};
  StepReport local_report;
  StepReport& rep = report_out != nullptr ? *report_out : local_report;
  rep = StepReport{};
  rep.step = step_;
  rep.checkpoint_step = commits_.committed();
  Run run(req, rep);
  run.reset = req.reset;
  if (Device* device = options_.device; device != nullptr) {
    device->ResetPeak();
    // The room this step starts with, before it is planned: another
    // process may have taken memory since the last step.
    const MemoryStats st = device->Stats();
    run.mem_base = st.allocated;
    run.mem_retries = st.num_alloc_retries;
    if (st.total > 0) controller_.OnStepStart(st.allocated, st.reserved + st.free);
  }
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
  if (!bad.ok()) run.Fail(bad);
  rep.limit_before = EffectiveLimit(req);
  if (bad.ok()) EnsureInitialSnapshot(run);

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
  Device* device = options_.device;
  while (run.local() == Local::kOk) {
    std::exception_ptr error;
    try {
      while (run.pos < run.plan.size()) {
        const MicroBatch mb = run.plan[run.pos];  // a copy: a re-plan replaces the plan
        phase_ = Phase::kUnknown;
        fault_ctx_.micro = mb.index;
        fault_ctx_.size = mb.cost;
        SetCurrentFaultContext(fault_ctx_);
        FaultPoint(FaultSite::kMicroBatch, fault_ctx_);
        if (device != nullptr) BeforeMicroBatch(run);
        run.req.micro(mb);
        run.largest = std::max(run.largest, mb.cost);
        ++run.pos;
        if (device != nullptr) AfterMicroBatch(run, mb);
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

void GuardImpl::AfterMicroBatch(Run& run, const MicroBatch& mb) {
  const MemoryStats st = options_.device->Stats();
  run.step_peak = std::max(run.step_peak, st.peak_allocated);
  if (st.total > 0) {
    MicroBatchMemory m;
    m.base = run.mem_base;
    m.used = st.peak_allocated;
    m.capacity = st.reserved + st.free;
    m.reserved = st.reserved;
    m.flushed = st.num_alloc_retries > run.mem_retries;
    // A completed micro-batch keeps its weight whatever the rest's split, so
    // the rest of the step can take the new limit at once (not with uniform
    // sizes: the ranks agree on a limit only at the vote).
    if (controller_.OnMicroBatch(mb.cost, m) && run.pos < run.plan.size() && !options_.uniform_micro_batch) {
      auto rest = MakePlan(run, mb.offset + mb.size, mb.index + 1);
      if (rest.ok()) {
        run.plan = std::move(rest).value();
        run.pos = 0;
      }
    }
  }
  run.mem_base = st.allocated;
  run.mem_retries = st.num_alloc_retries;
}

namespace {

// What HandleOom knows when it picks the rung of the ladder. The two
// questions that ask someone else (the size controller, which learns from
// being asked, and the recovery store) are asked only on the branches that
// need them, in the order the ladder reaches them.
struct RungFacts {
  bool release_made_room = false;   // releasing freed the request and the once-per-step retry is unused
  bool over_budget = false;         // more OOMs this step than max_ooms_per_step
  bool in_micro = false;            // the OOM is inside a micro-batch
  bool outside_retry_used = false;  // a step that failed outside its micro-batches was redone once
  bool splittable = false;          // the failed micro-batch holds more than one sample
  std::function<bool()> controller_shrinks;  // the size controller takes the OOM and shrinks
  std::function<bool()> can_roll_back;       // the recovery store holds a snapshot or a durable step
};

// The ladder after the release: retry at the same size, give up over
// budget, redo a step that failed outside the micro-batches once, halve,
// roll back, give up.
LadderAction ChooseRung(const RungFacts& f) {
  if (f.release_made_room) return LadderAction::kRelease;  // retry at the same size once
  if (f.over_budget) return LadderAction::kGiveUp;
  if (!f.in_micro) {
    // Released caches are all this rung has: the step is redone as it was,
    // once; then a rollback, or the end.
    if (!f.outside_retry_used) return LadderAction::kRelease;
    return f.can_roll_back() ? LadderAction::kRollback : LadderAction::kGiveUp;
  }
  // (A lone sample cannot be split, whatever its cost: it escalates.)
  if (f.controller_shrinks() && f.splittable) return LadderAction::kHalve;
  // Whether every rank holds a common step is decided together, in Rollback.
  return f.can_roll_back() ? LadderAction::kRollback : LadderAction::kGiveUp;
}

// The give-up message of an OOM that no rung recovers from.
std::string GiveUpText(int64_t step, const Incident& inc, const OomInfo& info, bool bounded, int64_t ooms,
                       bool in_micro, const MicroBatch& failed, int64_t min_micro_batch) {
  return "out of memory at step " + std::to_string(step) + " in phase '" + std::string(PhaseName(inc.phase)) +
         "' (" + std::string(IncidentKindName(inc.kind)) + ", requested " +
         FormatBytes(info.requested_bytes) + ") " +
         (bounded     ? "after " + std::to_string(ooms - 1) + " OOMs in one step (max_ooms_per_step)"
          : !in_micro ? "outside the micro-batches, where a smaller micro-batch does not help, again after "
                        "releasing caches, with no checkpoint to roll back to"
          : failed.size == 1 && failed.cost > min_micro_batch
              ? "in a micro-batch of one sample (cost " + std::to_string(failed.cost) +
                    ") that cannot be split, with no checkpoint to roll back to"
              : "at the minimum micro-batch (" + std::to_string(min_micro_batch) +
                    ") with no checkpoint to roll back to") +
         "; incident " + inc.id + "; remedies: " + kGenericRemedies;
}

}  // namespace

bool GuardImpl::HandleOom(Run& run, std::exception_ptr error, Where where) {
  const auto t_oom = Clock::now();
  OomInfo info = ClassifyException(error);
  if (!info.is_oom()) {
    // Not ours: it passes through unchanged, once the other ranks know.
    run.FailWith(std::move(error));
    return false;
  }
  if (IsCommunicatorFailure(info.message)) {
    // NCCL reports its own allocation failures ("Cuda failure 'out of
    // memory'"), but the communicator is unusable afterwards: no smaller
    // micro-batch helps. Every rank stops and the launcher restarts them.
    run.Fail(Status::Unavailable("the collective communicator failed at step " + std::to_string(step_) +
                                 " and cannot be used again (" + info.exception_type + ": " + info.message +
                                 "); exit with code " + std::to_string(kExitCoordinationTimeout) +
                                 " so that every rank restarts"));
    return false;
  }
  Device* device = options_.device;
  // Only an OOM inside a micro-batch depends on its size. The sync buffers,
  // the vote and the commit sites hold what the whole step holds, whatever
  // the split: a smaller micro-batch would not help there.
  const bool in_micro = where == Where::kLocal && run.pos < run.plan.size();
  MicroBatch failed;
  if (in_micro) {
    failed = run.plan[run.pos];
  } else {
    failed.index = -1;
    failed.cost = std::max<int64_t>(run.largest, options_.min_micro_batch);
    failed.size = failed.cost;
  }
  const Phase phase = phase_;
  bool at_failure = false;
  MemoryStats before = StatsAtFailure(error, device, &at_failure);
  // What the size controller learns from an OOM inside a micro-batch: what
  // it had allocated on top of its base when the request failed (not from
  // injected faults, which say nothing about memory, nor from a host OOM,
  // which says nothing about the device's).
  std::optional<MicroBatchMemory> figures;
  if (device != nullptr && at_failure && !info.injected && info.kind == OomKind::kDevice &&
      info.requested_bytes > 0 && before.total > 0 && in_micro && run.mem_base >= 0) {
    figures = MicroBatchMemory{run.mem_base, before.allocated + info.requested_bytes,
                               before.reserved + before.free};
    figures->reserved = before.reserved;
    figures->requested = info.requested_bytes;
  }
  if (at_failure) run.step_peak = std::max(run.step_peak, before.peak_allocated);
  run.mem_base = -1;  // memory is released below: read the base again
  // Drop the exception before releasing memory: it (or, in Python, its
  // traceback's frames) may be what still holds the memory.
  error = nullptr;
  Incident inc = NewIncident(info, before, failed, run.req);
  StepReport& rep = run.rep;
  const int64_t free_before = device != nullptr ? device->Stats().free : 0;
  const double user_ms = CountOomAndRelease(run, inc);
  if (run.local() == Local::kFailed) {  // a releaser's own exception stops this rank
    inc.action = LadderAction::kGiveUp;
    inc.micro_after = EffectiveLimit(run.req);
    RecordIncident(run, std::move(inc));
    return false;
  }

  // Completed micro-batches survive an OOM before backward; otherwise the
  // gradients may hold part of the failed micro-batch.
  const bool keep = where == Where::kLocal && (phase == Phase::kData || phase == Phase::kForward) &&
                    run.pos < run.plan.size();
  if (!keep && !run.reset) {
    inc.action = LadderAction::kGiveUp;
    run.Fail(Status::FailedPrecondition(
        "OOM in phase '" + std::string(PhaseName(phase)) + "' at step " + std::to_string(step_) +
        " after gradients may have been accumulated, and no reset hook is set (StepRequest.reset); "
        "incident " +
        inc.id));
    inc.micro_after = EffectiveLimit(run.req);
    RecordIncident(run, std::move(inc));
    return false;
  }

  const int64_t free_after = device != nullptr ? device->Stats().free : 0;
  const int64_t need = std::max<int64_t>(1, info.requested_bytes);
  RecoveryStore* store = options_.recovery;
  // With figures the predictive controller chooses the retry's size itself:
  // a same-size retry after a release fits from the emptied cache and runs
  // out again a step later, where fragmentation is what does not fit.
  const bool model_sizes = figures && controller_.options().policy == SizePolicy::kPredictive;
  RungFacts facts;
  // Releasing made room for the request: retry at the same size once.
  facts.release_made_room = options_.retry_after_release && !run.release_retry_used && device != nullptr &&
                            free_after - free_before >= need && !model_sizes;
  facts.over_budget = rep.ooms > options_.max_ooms_per_step;
  facts.in_micro = in_micro;
  facts.outside_retry_used = run.outside_retry_used;
  facts.splittable = failed.size > 1;
  facts.controller_shrinks = [&] {
    return info.injected ? controller_.OnInjectedOom(failed.cost)
           : figures     ? controller_.OnOom(failed.cost, *figures)
                         : controller_.OnOom(failed.cost);
  };
  facts.can_roll_back = [store] {
    return store != nullptr && (store->SnapshotStep() || !store->DurableSteps().empty());
  };
  const LadderAction action = ChooseRung(facts);
  if (action == LadderAction::kRelease) {
    // Each same-size retry is spent once.
    if (facts.release_made_room) {
      run.release_retry_used = true;
    } else {
      run.outside_retry_used = true;
    }
  }
  if (action == LadderAction::kHalve || action == LadderAction::kRollback) inc.actions.push_back(action);
  inc.action = action;
  inc.micro_after = EffectiveLimit(run.req);

  Logger()->warn("OOM ({}) in {} at step {} micro-batch {}/{} (size {}): requested {}, allocated {}, "
                 "reserved {}; released caches; {} -> micro-batch {}",
                 IncidentKindName(inc.kind), PhaseName(inc.phase), step_, failed.index + 1, failed.count, failed.cost,
                 FormatBytes(info.requested_bytes), FormatBytes(before.allocated), FormatBytes(before.reserved),
                 LadderActionName(inc.action), inc.micro_after);
  rep.recovery_ms += std::max(0.0, MsSince(t_oom) - user_ms);

  if (action == LadderAction::kGiveUp || action == LadderAction::kRollback) {
    if (action == LadderAction::kGiveUp) {
      const bool bounded = rep.ooms > options_.max_ooms_per_step;
      run.Fail(Status::ResourceExhausted(
          GiveUpText(step_, inc, info, bounded, rep.ooms, in_micro, failed, options_.min_micro_batch)));
    } else {
      run.AskRollback();
    }
    RecordIncident(run, std::move(inc));
    return false;
  }

  if (!Replan(run, keep, failed, where)) return false;
  ++rep.replans;
  RecordIncident(run, std::move(inc));
  return true;
}

double GuardImpl::CountOomAndRelease(Run& run, Incident& inc) {
  ++run.rep.ooms;
  ++total_ooms_;
  steps_ok_since_oom_ = 0;
  const double user_ms = ReleaseCaches(run);
  ++run.rep.cache_releases;
  inc.actions.push_back(LadderAction::kRelease);
  return user_ms;
}

bool GuardImpl::Replan(Run& run, bool keep, const MicroBatch& failed, Where where) {
  // From the failed micro-batch when earlier work is kept, else from
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
  return true;
}

void GuardImpl::HandleApplyFailure(Run& run, std::exception_ptr error) {
  const auto t_oom = Clock::now();
  OomInfo info = ClassifyException(error);
  if (!info.is_oom()) {
    run.applied = kApplyError;
    run.FailWith(std::move(error));
    return;
  }
  run.applied = kApplyOom;
  MemoryStats mem = StatsAtFailure(error, options_.device);
  error = nullptr;
  MicroBatch whole;
  whole.cost = run.largest;
  whole.index = -1;
  Incident inc = NewIncident(info, mem, whole, run.req);
  const double user_ms = CountOomAndRelease(run, inc);
  if (run.local() == Local::kFailed) {  // a releaser's own exception: every rank ends the step
    run.applied = kApplyError;
    inc.action = LadderAction::kGiveUp;
    RecordIncident(run, std::move(inc));
    return;
  }
  // Parameters may be half-updated: only a restore can put them back. The
  // micro-batch stays: the activations are gone by the apply, and what the
  // optimizer allocates does not depend on the split.
  inc.micro_after = EffectiveLimit(run.req);
  inc.action = LadderAction::kRollback;
  inc.actions.push_back(inc.action);
  run.rep.recovery_ms += std::max(0.0, MsSince(t_oom) - user_ms);
  Logger()->warn("OOM ({}) in the optimizer apply at step {}: parameters may be half-updated",
                 IncidentKindName(inc.kind), step_);
  RecordIncident(run, std::move(inc));
}

Status GuardImpl::Conclude(Run& run) {
  StepReport& rep = run.rep;
  FinishIncidents(rep.incidents, run.outcome);
  for (auto& inc : rep.incidents) inc.recovery_ms = rep.recovery_ms;
  rep.status = run.status;
  rep.limit_after = EffectiveLimit(run.req);
  rep.wall_ms = MsSince(run.started);
  if (options_.device != nullptr)
    rep.peak_allocated = std::max(run.step_peak, options_.device->Stats().peak_allocated);
  fault_ctx_.micro = -1;
  SetCurrentFaultContext(fault_ctx_);
  phase_ = Phase::kUnknown;
  // A user's own exception passes through unchanged, now that every rank knows.
  if (run.error()) std::rethrow_exception(run.error());
  return run.status;
}


}  // namespace guard_internal

StatusOr<std::unique_ptr<Guard>> Guard::Create(const GuardOptions& options) {
  OOMGUARD_RETURN_IF_ERROR(ValidateGuardOptions(options));
  Status faults = LoadFaultRulesFromEnv();
  if (!faults.ok()) return Status::InvalidArgument(faults.message());  // names the variable and the rule
  return std::unique_ptr<Guard>(new guard_internal::GuardImpl(options));
}


}  // namespace oomguard
