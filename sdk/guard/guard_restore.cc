// Restoring a step every rank holds: the rollback of a step, Guard::Resume at
// the start of a run and Guard::Finish at its end. Each rank reports what it
// can restore; the candidates are the steps every rank holds; rank 0 commits a
// candidate's manifest before anyone loads it (CheckpointCommit); every rank
// confirms.
#include "sdk/guard/guard_impl.h"

namespace oomguard::guard_internal {

internal::RankPoints GuardImpl::MyPoints() {
  internal::RankPoints mine;
  RecoveryStore* store = options_.recovery;
  if (store == nullptr) return mine;
  // Saves in flight may land a newer common step; their failures show as
  // steps missing from the list.
  Status w = Contained([&] {
    Status waited = store->Wait();
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
      int64_t code = static_cast<int64_t>(commits_.CommitBeforeLoad(target).code());
      auto heard = channel_.Agree({&code, 1});
      if (!heard.ok()) return heard.status();
      if ((*heard)[0][0] != 0) {
        *tried += "; step " + std::to_string(target) + ": rank 0 could not commit its manifest";
        continue;
      }
      commits_.Learn(target);
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
  const std::string& why = run.rollback_why();
  // The abandoned step's gradients must not leak into the redo. A reset that
  // raises leaves this rank with nothing to offer: every rank then stops.
  const bool reset_ok = !run.reset || Reset(run);
  auto points = channel_.ExchangePoints(reset_ok ? MyPoints() : internal::RankPoints{});
  if (!points.ok()) return EndCoordination(run, points.status());
  const std::vector<int64_t> candidates = RestorableSteps(*points, step_);
  const std::string size = "micro-batch " + std::to_string(run.rollback_size());
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
  run.rep.checkpoint_step = commits_.committed();
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
  const std::vector<int64_t> candidates = RestorableSteps(*points, INT64_MAX);
  if (candidates.empty()) return Status::NotFound("no checkpoint that every rank holds");
  std::string tried;
  auto restored = RestoreAgreed(*points, candidates, &tried);
  if (!restored.ok()) {
    if (restored.status().code() != StatusCode::kNotFound) return restored.status();
    return Status::DataLoss(restored.status().message());
  }
  step_ = *restored + 1;
  commits_.Learn(*restored);
  snapshot_checked_ = true;  // the resumed step is durable: no initial snapshot needed
  Logger()->info("resumed from the checkpoint of step {} (every rank holds it)", *restored);
  return *restored;
}


StatusOr<int64_t> GuardImpl::Finish() {
  RecoveryStore* store = options_.recovery;
  internal::RankPoints mine;
  Status saved;
  if (store != nullptr) {
    mine.has_store = true;
    try {
      saved = store->Wait();
      mine.durable = store->DurableSteps();
    } catch (const std::exception& e) {
      saved = Status::Internal(std::string("waiting for the last checkpoint: ") + e.what());
    }
  }
  auto points = channel_.ExchangePoints(mine);
  if (!points.ok()) return points.status();
  // Rank 0 commits the steps durable on every rank not committed yet, oldest
  // first (no snapshots: only disk outlives the run).
  const Status commit = commits_.CommitDurable(StepsEveryRankHolds(*points, /*snapshots=*/false));
  const int64_t words[3] = {static_cast<int64_t>(saved.code()), static_cast<int64_t>(commit.code()),
                            commits_.committed()};
  auto agreed = channel_.Agree(words);
  if (!agreed.ok()) return agreed.status();
  bool any_failed = false;
  for (const auto& w : *agreed) any_failed = any_failed || w[0] != 0 || w[1] != 0;
  commits_.Learn((*agreed)[0][2]);
  if (!any_failed) return commits_.committed();
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
    return Status(why.code, "rank " + std::to_string(r) + ": " + why.text +
                                "; the newest checkpoint complete on every rank is step " +
                                std::to_string(commits_.committed()));
  }
  return commits_.committed();
}


}  // namespace oomguard::guard_internal
