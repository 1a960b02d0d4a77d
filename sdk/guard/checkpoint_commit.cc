#include "sdk/guard/checkpoint_commit.h"

#include <algorithm>
#include <set>

#include "sdk/guard/guard_impl.h"

namespace oomguard::guard_internal {
namespace {

bool Holds(const internal::RankPoints& p, int64_t step, bool snapshots) {
  return p.has_store && ((snapshots && p.snapshot && *p.snapshot == step) ||
                         std::binary_search(p.durable.begin(), p.durable.end(), step));
}

}  // namespace

std::vector<int64_t> StepsEveryRankHolds(const std::vector<internal::RankPoints>& ranks, bool snapshots) {
  std::vector<int64_t> out;
  if (ranks.empty()) return out;
  std::set<int64_t> candidates(ranks[0].durable.begin(), ranks[0].durable.end());
  if (snapshots && ranks[0].snapshot) candidates.insert(*ranks[0].snapshot);
  for (int64_t step : candidates)
    if (std::all_of(ranks.begin(), ranks.end(),
                    [&](const internal::RankPoints& p) { return Holds(p, step, snapshots); }))
      out.push_back(step);
  return out;
}

std::vector<int64_t> StepsEveryRankHolds(const std::vector<internal::RankVote>& votes) {
  std::vector<internal::RankPoints> ranks(votes.size());
  for (size_t r = 0; r < votes.size(); ++r) {
    ranks[r].has_store = true;
    ranks[r].durable = votes[r].durable;
  }
  return StepsEveryRankHolds(ranks, /*snapshots=*/false);
}

std::vector<int64_t> RestorableSteps(const std::vector<internal::RankPoints>& ranks, int64_t before) {
  std::vector<int64_t> held = StepsEveryRankHolds(ranks, /*snapshots=*/true);
  held.erase(std::lower_bound(held.begin(), held.end(), before), held.end());
  std::reverse(held.begin(), held.end());
  return held;
}

Status CheckpointCommit::CommitOne(int64_t step) {
  return Contained([&] { return store_->Commit(step, world_size_); });
}

Status CheckpointCommit::CommitDurable(const std::vector<int64_t>& steps, int64_t* failed_step) {
  if (rank_ != 0 || store_ == nullptr) return Status::Ok();
  for (int64_t step : steps) {
    if (step <= committed_) continue;
    Status c = CommitOne(step);
    if (!c.ok()) {
      if (failed_step != nullptr) *failed_step = step;
      return c;
    }
    committed_ = step;
  }
  return Status::Ok();
}

Status CheckpointCommit::CommitBeforeLoad(int64_t target) {
  if (rank_ != 0) return Status::Ok();
  if (store_ == nullptr)
    return Status::FailedPrecondition("no recovery store to commit step " + std::to_string(target));
  return CommitOne(target);
}

void CheckpointCommit::Learn(int64_t step) { committed_ = std::max(committed_, step); }

}  // namespace oomguard::guard_internal
