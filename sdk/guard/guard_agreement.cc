// The agreement part of a guarded step: what this rank tells the others
// (the vote, with the commit and sync sites before it), the redo after an
// OOM there, the gradient sync (or the sum of what the vote carried), the apply, the
// agreement after it, the end of a committed step (its checkpoint commit goes
// through CheckpointCommit), and the ways every rank ends a step together when
// one failed or a peer was lost.
#include "sdk/guard/guard_impl.h"

namespace oomguard::guard_internal {

internal::RankVote GuardImpl::MyVote(const Run& run) {
  internal::RankVote v;
  v.status = run.local() == Local::kOk         ? VoteStatus::kOk
             : run.local() == Local::kRollback ? VoteStatus::kRollback
                                               : VoteStatus::kFailed;
  v.code = run.local() == Local::kFailed ? run.failure().code() : StatusCode::kOk;
  v.step = step_;
  v.units = run.local_units;
  v.micro_limit = controller_.limit();
  v.had_oom = run.rep.ooms > 0;
  if (options_.device != nullptr) {
    MemoryStats m = options_.device->Stats();
    v.allocated = m.allocated;
    v.reserved = m.reserved;
    v.peak_allocated = std::max(run.step_peak, m.peak_allocated);  // the peak restarts per micro-batch
  }
  v.committed = commits_.committed();
  if (RecoveryStore* store = options_.recovery; store != nullptr) {
    v.snapshot = store->SnapshotStep();
    v.durable = store->DurableSteps();
  }
  return v;
}

bool GuardImpl::CommitSites(Run& run) {
  fault_ctx_.micro = -1;
  SetCurrentFaultContext(fault_ctx_);
  phase_ = Phase::kCommit;
  try {
    FaultPoint(FaultSite::kCommit, fault_ctx_);
    FaultPoint(FaultSite::kSync, fault_ctx_);
  } catch (...) {
    std::exception_ptr error = std::current_exception();
    if (!ClassifyException(error).is_oom()) {
      run.FailWith(std::move(error));
      return false;
    }
    // The ladder records it and releases caches; what the rank does next is
    // every rank's redo (or its own rollback or failure, if the ladder says
    // so: that is what it votes). A cache releaser that raised on the way
    // fails this rank.
    HandleOom(run, std::move(error), Where::kCommit);
    return run.local() == Local::kOk;
  }
  return false;
}

State GuardImpl::Vote(Run& run) {
  // The commit and sync sites run before the vote, on ranks whose local work
  // succeeded: an OOM there is a flag in the vote, so that nothing can fail
  // between the vote and the sum (which then needs no status words, and may
  // ride in the vote itself).
  const bool redo = run.local() == Local::kOk && CommitSites(run);
  internal::RankVote mine = MyVote(run);
  mine.redo = redo;
  if (run.local() == Local::kOk && !redo) internal::PackSum(run.buffers, &mine);
  auto vote = channel_.Vote(mine);
  if (!vote.ok()) return EndCoordination(run, vote.status());
  run.vote = std::move(vote).value();
  const internal::VoteOutcome& v = run.vote;
  run.rep.global_units = v.total_units;
  if (coordinator_->rank() != 0) commits_.Learn(v.committed);
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
  // The same words on every rank, so every rank refuses together.
  if (v.units_overflow)
    return Done(run,
                Status::InvalidArgument("StepRequest.units overflow: the loss units of step " + std::to_string(step_) +
                                        " summed over the ranks pass 2^63 - 1"),
                IncidentOutcome::kFailed);
  if (v.status == VoteStatus::kRollback) {
    // The same words on every rank: a local rollback vote means an OOM that
    // splitting cannot fix.
    size_t asking = 0;
    while (asking + 1 < v.ranks.size() && v.ranks[asking].status != VoteStatus::kRollback) ++asking;
    run.AgreeRollback((coordinator_->size() > 1 ? "rank " + std::to_string(asking) + " ran" : "ran") +
                          std::string(" out of memory at step ") + std::to_string(step_) +
                          " at its smallest micro-batch (" + std::to_string(v.ranks[asking].micro_limit) +
                          ")",
                      v.ranks[asking].micro_limit);
    return State::kRollback;
  }
  if (v.redo) return Redo(run, redo);
  if (v.sum_in_vote) {
    // Every rank's buffers came with the vote: each rank sums them itself.
    internal::SumFromVote(v, run.buffers);
    return State::kApply;
  }
  return State::kSync;
}

State GuardImpl::Redo(Run& run, bool asked) {
  // Nobody applied anything: every rank resets and redoes the step, the
  // ranks that failed at their new size.
  int asking = 0;
  for (const internal::RankVote& rv : run.vote.ranks) asking += rv.redo ? 1 : 0;
  ++run.rep.redone;
  if (run.rep.redone > options_.max_ooms_per_step)
    return Done(run,
                Status::ResourceExhausted("step " + std::to_string(step_) + " was redone " +
                                          std::to_string(run.rep.redone - 1) +
                                          " times because ranks ran out of memory in the gradient sync "
                                          "(max_ooms_per_step); remedies: " + kGenericRemedies),
                IncidentOutcome::kFailed);
  if (!run.reset) {
    run.Fail(Status::FailedPrecondition(
        "another rank ran out of memory in the gradient sync of step " + std::to_string(step_) +
        ": the step must be redone, and no reset hook is set (StepRequest.reset)"));
    return State::kLocal;
  }
  // The asking rank planned anew already (the ladder, at its new size).
  if (Reset(run) && run.local() == Local::kOk && !asked) PlanAnew(run);
  Logger()->info("step {} is redone: {} rank(s) ran out of memory in the gradient sync", step_, asking);
  return State::kLocal;
}

State GuardImpl::Sync(Run& run) {
  // This rank's share of the global batch: sum_r share_r * mean_r is the mean
  // over every unit of the global batch.
  const double share = internal::ShareOf(run.local_units, run.vote.total_units);
  for (SumBuffer& b : run.buffers) b.scale = share;
  Status synced = channel_.Sync(run.buffers);
  if (!synced.ok()) return EndCoordination(run, synced);
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


// Its own collective, not folded into the next step's vote: Step returns OK
// only once every rank applied (step_protocol.h says why the fold is unsafe).
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
    run.AgreeRollback((coordinator_->size() > 1 ? "rank " + std::to_string(oom_rank) + " ran" : "ran") +
                          std::string(" out of memory in the optimizer apply at step ") +
                          std::to_string(step_),
                      (*all)[static_cast<size_t>(oom_rank)][1]);
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
    peaks_.push_back(std::max(run.step_peak, options_.device->Stats().peak_allocated));
    while (static_cast<int>(peaks_.size()) > options_.history_steps) peaks_.pop_front();
  }
  ++steps_ok_since_oom_;
  if (options_.priors != nullptr && !options_.workload.empty() && run.largest > 0) {
    Status p = options_.priors->RecordCleanMicroBatch(prior_key_, run.largest);
    if (!p.ok()) Logger()->debug("recording the clean micro-batch failed: {}", p.ToString());
    if (auto model = controller_.model()) {
      p = options_.priors->RecordModel(prior_key_, *model);
      if (!p.ok()) Logger()->debug("recording the memory model failed: {}", p.ToString());
    }
  }
  const int64_t done = step_++;
  if (done >= rollback_from_) rollback_repeats_ = 0;
  RecoveryStore* store = options_.recovery;
  if (store == nullptr) return;
  // Rank 0 commits the checkpoints durable on every rank, oldest first (saves
  // lag behind training, so several may have completed since the last
  // vote; retention keeps the newest of them); the others learn of it from
  // rank 0's next vote.
  int64_t failed_step = -1;
  Status c = commits_.CommitDurable(StepsEveryRankHolds(run.vote.ranks), &failed_step);
  if (!c.ok())
    Logger()->warn("committing checkpoint of step {} failed (retried at a later step): {}", failed_step,
                   c.ToString());
  rep.checkpoint_step = commits_.committed();
  // Every rank saves after the same steps: the trigger comes from the vote.
  // The step is committed on every rank: an error here (a user's save
  // callback raising) costs this rank's checkpoint of the step, which the
  // ranks' durable sets then lack, never the step itself.
  Status s;
  try {
    s = store->OnStepCommitted(done, run.vote.any_oom);
  } catch (const std::exception&) {
    s = Status::Internal(DescribeException(std::current_exception()));
  } catch (...) {
    // Not the SDK's to swallow (a save callback's KeyboardInterrupt): the
    // step stays committed, and Conclude rethrows it.
    run.RaiseAfterCommit(std::current_exception());
    s = Status::Cancelled(DescribeException(run.error()));
  }
  if (!s.ok()) Logger()->error("checkpoint after step {} failed: {}", done, s.ToString());
}

State GuardImpl::EndFailed(Run& run) {
  internal::StepChannel::Reason mine;
  if (run.local() == Local::kFailed) mine = {run.failure().code(), run.FailureText()};
  auto reasons = channel_.ShareReasons(mine);
  if (!reasons.ok()) return EndCoordination(run, reasons.status());
  int first = -1, count = 0;
  for (size_t r = 0; r < reasons->size(); ++r) {
    if ((*reasons)[r].code == StatusCode::kOk) continue;
    if (first < 0) first = static_cast<int>(r);
    ++count;
  }
  run.rep.failed_rank = first;
  if (run.local() == Local::kFailed) {
    Logger()->error("step {} stopped on this rank: {}", step_, run.FailureText());
    return Done(run, run.failure(), IncidentOutcome::kFailed);
  }
  if (first < 0)  // cannot happen: a failure was seen; stay on the safe side
    return Done(run, Status::Internal("a rank failed at step " + std::to_string(step_) + " without a reason"),
                IncidentOutcome::kFailed);
  const internal::StepChannel::Reason& why = (*reasons)[static_cast<size_t>(first)];
  std::string msg = "rank " + std::to_string(first) + " stopped at step " + std::to_string(step_) + ": " + why.text;
  if (count > 1) msg += " (and " + std::to_string(count - 1) + " other rank(s))";
  Logger()->error("{}", msg);
  // The job cannot fit when the failing rank ran out of memory; a failed
  // communicator is everyone's restart; otherwise this rank's step was
  // cancelled on the failing rank's account.
  Status s = why.code == StatusCode::kResourceExhausted ? Status::ResourceExhausted(msg)
             : why.code == StatusCode::kUnavailable     ? Status::Unavailable(msg)
                                                        : Status::Cancelled(msg);
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
    inc.kind = IncidentKind::kCoordination;
    inc.phase = Phase::kComm;
    inc.action = LadderAction::kGiveUp;
    RecordIncident(run, std::move(inc));
    Logger()->error("coordination failed at step {}: {}; exit with code {} so that the launcher restarts every rank",
                    step_, why.ToString(), kExitCoordinationTimeout);
    return Done(run, why.code() == StatusCode::kUnavailable ? why : Status::Unavailable(why.message()),
                IncidentOutcome::kFailed);
  }
  Logger()->error("step {} stopped: {}", step_, why.ToString());
  return Done(run, why, IncidentOutcome::kFailed);
}


}  // namespace oomguard::guard_internal
