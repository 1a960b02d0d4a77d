// CheckpointCommit: the one owner of the guard's committed checkpoint.
//
// A checkpoint step is committed when rank 0's RecoveryStore::Commit wrote its
// manifest, which it may only do once the step is durable on every rank. In
// sdk/guard only this class calls RecoveryStore::Commit and only it changes
// the committed step; the guard's states ask it. It also computes the fact
// every commit and every restore rests on: which steps every rank holds
// (StepsEveryRankHolds).
//
// Who calls what (docs/distributed.md has the protocol):
//   - after a step every rank committed, CommitDurable (rank 0 commits; the
//     others Learn the result from rank 0's next vote);
//   - in a rollback that loads from disk, CommitBeforeLoad on every rank
//     (rank 0 commits), then Learn once every rank heard that it worked;
//   - Resume: Learn the restored step; Finish: CommitDurable, then Learn what
//     rank 0 reports.
// The committed step only grows.
//
// Thread-safety: one thread (the guard's training thread) uses it.
#ifndef OOMGUARD_SDK_GUARD_CHECKPOINT_COMMIT_H_
#define OOMGUARD_SDK_GUARD_CHECKPOINT_COMMIT_H_

#include <cstdint>
#include <vector>

#include "oomguard/recovery.h"
#include "oomguard/status.h"
#include "sdk/guard/step_protocol.h"

namespace oomguard::guard_internal {

// The steps every rank holds, ascending: each step of rank 0's durable list
// (and, with `snapshots`, its snapshot) that every rank has durably (or, with
// `snapshots`, as its snapshot). A rank without a store holds nothing.
std::vector<int64_t> StepsEveryRankHolds(const std::vector<internal::RankPoints>& ranks, bool snapshots);

// The same from the vote: durable steps only (votes carry no store flag; a
// rank without a store votes an empty list).
std::vector<int64_t> StepsEveryRankHolds(const std::vector<internal::RankVote>& votes);

// The steps a rollback or a resume may restore: held by every rank, durably
// or as a snapshot, below `before`, newest first.
std::vector<int64_t> RestorableSteps(const std::vector<internal::RankPoints>& ranks, int64_t before);

class CheckpointCommit {
 public:
  // `store` may be null (no checkpoints: nothing is ever committed); it must
  // outlive this object.
  CheckpointCommit(RecoveryStore* store, int rank, int world_size)
      : store_(store), rank_(rank), world_size_(world_size) {}

  // The newest step committed on every rank's behalf; -1 when none.
  int64_t committed() const { return committed_; }

  // On rank 0: commits each of `steps` (every rank holds them durably;
  // ascending) newer than the committed step, oldest first, and stops at the
  // first failure, which it returns with its step in *failed_step (a later
  // call retries it). Elsewhere, and without a store: does nothing and
  // returns OK.
  Status CommitDurable(const std::vector<int64_t>& steps, int64_t* failed_step = nullptr);

  // A rollback is about to load `target` from disk on some rank: on rank 0,
  // commits its manifest first (whatever the store throws becomes a status);
  // elsewhere OK. The caller shares the outcome and, when every rank heard it
  // worked, calls Learn(target).
  Status CommitBeforeLoad(int64_t target);

  // `step` is committed on every rank's behalf: rank 0 said so (its vote,
  // Finish's agreement), or every rank restored it from a committed manifest.
  // Never moves the committed step back.
  void Learn(int64_t step);

 private:
  Status CommitOne(int64_t step);

  RecoveryStore* store_;
  int rank_;
  int world_size_;
  int64_t committed_ = -1;
};

}  // namespace oomguard::guard_internal

#endif  // OOMGUARD_SDK_GUARD_CHECKPOINT_COMMIT_H_
