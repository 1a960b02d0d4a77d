// CheckpointCommit and the steps every rank holds, without a guard: which
// steps count as held, what rank 0 commits and in which order, what the other
// ranks do, and that the committed step never moves back.
#include "sdk/guard/checkpoint_commit.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "sdk/guard/guard_testing.h"

namespace oomguard::guard_internal {
namespace {

using internal::RankPoints;
using internal::RankVote;
using oomguard::testing::RecordingRecovery;
using Steps = std::vector<int64_t>;

RankPoints Points(Steps durable, std::optional<int64_t> snapshot = std::nullopt) {
  RankPoints p;
  p.has_store = true;
  p.durable = std::move(durable);
  p.snapshot = snapshot;
  return p;
}

TEST(StepsEveryRankHolds, OnlyStepsOnEveryRankCount) {
  const std::vector<RankPoints> ranks = {Points({4, 9, 14}), Points({4, 9, 14, 19}), Points({4, 9, 19})};
  EXPECT_EQ(StepsEveryRankHolds(ranks, /*snapshots=*/false), (Steps{4, 9}));
}

TEST(StepsEveryRankHolds, SnapshotsCountOnlyWhenAsked) {
  // Step 14: durable on ranks 0 and 2, rank 1's snapshot. Step 20, the
  // snapshot of ranks 0 and 2, is not on rank 1.
  const std::vector<RankPoints> ranks = {Points({9, 14}, 20), Points({9}, 14), Points({9, 14}, 20)};
  EXPECT_EQ(StepsEveryRankHolds(ranks, /*snapshots=*/false), (Steps{9}));
  EXPECT_EQ(StepsEveryRankHolds(ranks, /*snapshots=*/true), (Steps{9, 14}));
  const std::vector<RankPoints> snap = {Points({9}, 20), Points({9}, 20)};
  EXPECT_EQ(StepsEveryRankHolds(snap, /*snapshots=*/true), (Steps{9, 20}));
}

TEST(StepsEveryRankHolds, ARankWithoutAStoreHoldsNothing) {
  RankPoints none = Points({4, 9});
  none.has_store = false;
  EXPECT_TRUE(StepsEveryRankHolds({Points({4, 9}), none}, /*snapshots=*/true).empty());
  EXPECT_TRUE(StepsEveryRankHolds(std::vector<RankPoints>{}, /*snapshots=*/true).empty());
}

TEST(StepsEveryRankHolds, FromTheVoteDurableStepsOnly) {
  std::vector<RankVote> votes(3);
  votes[0].durable = {4, 9, 14};
  votes[0].snapshot = 15;
  votes[1].durable = {4, 9, 14};
  votes[1].snapshot = 15;
  votes[2].durable = {4, 9};
  votes[2].snapshot = 15;
  EXPECT_EQ(StepsEveryRankHolds(votes), (Steps{4, 9}));
  votes[1].durable.clear();  // a rank without a store votes no steps
  EXPECT_TRUE(StepsEveryRankHolds(votes).empty());
}

TEST(RestorableSteps, NewestFirstBelowTheBound) {
  const std::vector<RankPoints> ranks = {Points({4, 9, 14}, 15), Points({4, 9, 14}, 15)};
  EXPECT_EQ(RestorableSteps(ranks, INT64_MAX), (Steps{15, 14, 9, 4}));
  EXPECT_EQ(RestorableSteps(ranks, 14), (Steps{9, 4}))
      << "a rollback never restores the step it is in, or later";
  EXPECT_TRUE(RestorableSteps(ranks, 4).empty());
}

TEST(CheckpointCommit, RankZeroCommitsOldestFirstOnceEach) {
  RecordingRecovery store;
  CheckpointCommit commit(&store, /*rank=*/0, /*world_size=*/2);
  EXPECT_EQ(commit.committed(), -1);
  ASSERT_TRUE(commit.CommitDurable({4, 9}).ok());
  EXPECT_EQ(store.commits, (Steps{4, 9}));
  EXPECT_EQ(commit.committed(), 9);
  ASSERT_TRUE(commit.CommitDurable({4, 9, 14}).ok());
  EXPECT_EQ(store.commits, (Steps{4, 9, 14})) << "steps already committed are not written again";
  EXPECT_EQ(commit.committed(), 14);
}

TEST(CheckpointCommit, AFailedCommitStopsTheRunAndIsRetriedLater) {
  RecordingRecovery store;
  store.fail_commit = {9};
  CheckpointCommit commit(&store, /*rank=*/0, /*world_size=*/2);
  int64_t failed = -1;
  Status s = commit.CommitDurable({4, 9, 14}, &failed);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  EXPECT_EQ(failed, 9);
  EXPECT_EQ(store.commits, (Steps{4})) << "nothing newer than a failed step is committed";
  EXPECT_EQ(commit.committed(), 4);
  store.fail_commit.clear();
  ASSERT_TRUE(commit.CommitDurable({4, 9, 14}).ok());
  EXPECT_EQ(store.commits, (Steps{4, 9, 14}));
  EXPECT_EQ(commit.committed(), 14);
}

class ThrowingCommit : public RecordingRecovery {
 public:
  Status Commit(int64_t, int) override { throw std::runtime_error("disk gone"); }
};

TEST(CheckpointCommit, WhatTheStoreThrowsBecomesAStatus) {
  ThrowingCommit store;
  CheckpointCommit commit(&store, /*rank=*/0, /*world_size=*/2);
  Status s = commit.CommitDurable({3});
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("disk gone"), std::string::npos) << s;
  EXPECT_EQ(commit.CommitBeforeLoad(3).code(), StatusCode::kInternal);
  EXPECT_EQ(commit.committed(), -1);
}

TEST(CheckpointCommit, OtherRanksNeverWriteAManifestAndLearnFromRankZero) {
  RecordingRecovery store;
  CheckpointCommit commit(&store, /*rank=*/1, /*world_size=*/2);
  ASSERT_TRUE(commit.CommitDurable({4, 9}).ok());
  ASSERT_TRUE(commit.CommitBeforeLoad(9).ok());
  EXPECT_TRUE(store.commits.empty()) << "only rank 0 commits";
  EXPECT_EQ(commit.committed(), -1) << "until rank 0 says so";
  commit.Learn(9);
  EXPECT_EQ(commit.committed(), 9);
  commit.Learn(4);
  EXPECT_EQ(commit.committed(), 9) << "the committed step never moves back";
}

TEST(CheckpointCommit, RankZeroCommitsBeforeALoadFromDisk) {
  RecordingRecovery store;
  CheckpointCommit commit(&store, /*rank=*/0, /*world_size=*/3);
  ASSERT_TRUE(commit.CommitBeforeLoad(7).ok());
  EXPECT_EQ(store.commits, (Steps{7}));
  EXPECT_EQ(commit.committed(), -1) << "committed only once every rank heard it worked (Learn)";
  store.fail_commit = {8};
  EXPECT_FALSE(commit.CommitBeforeLoad(8).ok());
}

TEST(CheckpointCommit, WithoutAStoreNothingIsCommitted) {
  CheckpointCommit commit(nullptr, /*rank=*/0, /*world_size=*/1);
  EXPECT_TRUE(commit.CommitDurable({1, 2}).ok());
  EXPECT_EQ(commit.committed(), -1);
}

}  // namespace
}  // namespace oomguard::guard_internal
