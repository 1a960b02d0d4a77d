#include <gtest/gtest.h>

#include <thread>

#include "oomguard/coordinator.h"

namespace oomguard {
namespace {

using std::chrono::milliseconds;

// Runs fn(rank, coordinator) on one thread per rank.
template <typename Fn>
void OnRanks(std::vector<std::unique_ptr<Coordinator>>& group, Fn fn) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < group.size(); ++r) threads.emplace_back([&, r] { fn(static_cast<int>(r), *group[r]); });
  for (auto& t : threads) t.join();
}

TEST(VotePacking, RoundTripsMaxAndMins) {
  VoteInput a{VoteStatus::kOk, 10, 12, 64, false};
  VoteInput b{VoteStatus::kRollback, 8, 15, 32, true};
  int64_t wa[kVoteWords], wb[kVoteWords], m[kVoteWords];
  PackVote(a, wa);
  PackVote(b, wb);
  for (int i = 0; i < kVoteWords; ++i) m[i] = std::max(wa[i], wb[i]);
  VoteResult r = UnpackVote(m);
  EXPECT_EQ(r.status, VoteStatus::kRollback);
  EXPECT_EQ(r.min_durable_step, 8);
  EXPECT_EQ(r.min_snapshot_step, 12);
  EXPECT_EQ(r.max_snapshot_step, 15);
  EXPECT_EQ(r.min_micro_limit, 32);
  EXPECT_TRUE(r.any_oom);
}

TEST(ThreadGroup, VoteReducesOverAllRanksManyRounds) {
  auto group = MakeThreadGroup(4).value();
  std::vector<std::vector<VoteResult>> results(4);
  OnRanks(group, [&](int rank, Coordinator& c) {
    for (int round = 0; round < 200; ++round) {
      VoteInput in;
      in.status = (round % 7 == 0 && rank == round % 4) ? VoteStatus::kRollback : VoteStatus::kOk;
      in.durable_step = round - rank;
      in.snapshot_step = round;
      in.micro_limit = 100 + rank * 10 + round;
      in.had_oom = rank == 2 && round % 5 == 0;
      auto r = c.Vote(in, milliseconds(5000));
      ASSERT_TRUE(r.ok()) << r.status();
      results[rank].push_back(*r);
    }
  });
  for (int round = 0; round < 200; ++round) {
    for (int rank = 0; rank < 4; ++rank) {
      const VoteResult& r = results[rank][round];
      EXPECT_EQ(r.status, round % 7 == 0 ? VoteStatus::kRollback : VoteStatus::kOk);
      EXPECT_EQ(r.min_durable_step, round - 3);
      EXPECT_EQ(r.min_micro_limit, 100 + round);
      EXPECT_EQ(r.any_oom, round % 5 == 0);
    }
  }
}

TEST(ThreadGroup, GatherBroadcastAllreduceBarrier) {
  auto group = MakeThreadGroup(3).value();
  OnRanks(group, [&](int rank, Coordinator& c) {
    auto mem = c.GatherMemory(RankMemory{rank, 100 * rank, 200 * rank, 300 * rank}, milliseconds(5000));
    ASSERT_TRUE(mem.ok());
    ASSERT_EQ(mem->size(), 3u);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ((*mem)[r].rank, r);
      EXPECT_EQ((*mem)[r].reserved, 200 * r);
    }
    std::vector<uint8_t> data;
    if (rank == 1) data = {1, 2, 3};
    ASSERT_TRUE(c.Broadcast(&data, 1, milliseconds(5000)).ok());
    EXPECT_EQ(data, (std::vector<uint8_t>{1, 2, 3}));
    std::vector<double> v = {1.0 * rank, 0.5};
    ASSERT_TRUE(c.AllreduceSum(v, milliseconds(5000)).ok());
    EXPECT_DOUBLE_EQ(v[0], 3.0);
    EXPECT_DOUBLE_EQ(v[1], 1.5);
    EXPECT_TRUE(c.Barrier(milliseconds(5000)).ok());
    std::vector<uint8_t> x;
    EXPECT_EQ(c.Broadcast(&x, 7, milliseconds(10)).code(), StatusCode::kInvalidArgument);
  });
}

TEST(ThreadGroup, SilentRankMakesOthersFailWithinTheDeadline) {
  auto group = MakeThreadGroup(4).value();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Status> got(4);
  OnRanks(group, [&](int rank, Coordinator& c) {
    if (rank == 3) return;  // stops answering
    auto r = c.Vote(VoteInput{}, milliseconds(300));
    got[rank] = r.status();
  });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[r].code(), StatusCode::kUnavailable) << got[r];
  }
  EXPECT_LT(waited, 2.0) << "nobody waits much longer than its deadline";
  // Broken from then on: fails at once.
  auto again = group[0]->Vote(VoteInput{}, milliseconds(10000));
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
}

TEST(ThreadGroup, AbortWakesBlockedRanks) {
  auto group = MakeThreadGroup(2).value();
  Status blocked;
  std::thread t([&] { blocked = group[0]->Barrier(milliseconds(60000)); });
  std::this_thread::sleep_for(milliseconds(50));
  group[1]->Abort();
  t.join();
  EXPECT_FALSE(blocked.ok());
}

TEST(ThreadGroup, RejectsBadSize) {
  EXPECT_EQ(MakeThreadGroup(0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace oomguard
