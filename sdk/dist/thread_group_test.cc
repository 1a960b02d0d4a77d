// The ThreadGroup and local engines: Allgather and AllreduceSum over ranks as
// threads, deadlines, aborts, and the check that every rank is at the same
// collective.
#include <gtest/gtest.h>

#include <cmath>
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

TEST(ThreadGroup, AllgatherConcatenatesInRankOrderManyRounds) {
  auto group = MakeThreadGroup(4).value();
  OnRanks(group, [&](int rank, Coordinator& c) {
    for (int round = 0; round < 200; ++round) {
      std::vector<int64_t> mine = {rank, round, rank * 1000 + round};
      std::vector<int64_t> all(12);
      Status s = c.Allgather(mine, all, milliseconds(5000));
      ASSERT_TRUE(s.ok()) << s;
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(all[r * 3], r);
        EXPECT_EQ(all[r * 3 + 1], round);
        EXPECT_EQ(all[r * 3 + 2], r * 1000 + round);
      }
    }
  });
}

TEST(ThreadGroup, AllreduceSumScalesEachRanksContributionInRankOrder) {
  auto group = MakeThreadGroup(3).value();
  std::vector<std::vector<double>> d(3);
  std::vector<std::vector<float>> f(3);
  std::vector<std::vector<int64_t>> n(3);
  OnRanks(group, [&](int rank, Coordinator& c) {
    d[rank] = {1.0 + rank, 0.5, -2.0 * rank};
    f[rank] = {static_cast<float>(rank), 4.0f};
    n[rank] = {int64_t{1} << 40, rank};
    SumBuffer bd = SumBuffer::Host(d[rank].data(), 3);
    bd.scale = 0.5 * (rank + 1);  // 0.5, 1.0, 1.5
    SumBuffer bf = SumBuffer::Host(f[rank].data(), 2);
    SumBuffer bn;
    bn.data = n[rank].data();
    bn.count = 2;
    bn.dtype = DType::kInt64;
    std::vector<SumBuffer> bufs = {bd, bf, bn};
    Status s = c.AllreduceSum(bufs, milliseconds(5000));
    ASSERT_TRUE(s.ok()) << s;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_DOUBLE_EQ(d[r][0], 0.5 * 1 + 1.0 * 2 + 1.5 * 3);
    EXPECT_DOUBLE_EQ(d[r][1], 0.5 * 0.5 + 1.0 * 0.5 + 1.5 * 0.5);
    EXPECT_DOUBLE_EQ(d[r][2], 1.0 * -2.0 + 1.5 * -4.0);
    EXPECT_FLOAT_EQ(f[r][0], 3.0f);
    EXPECT_FLOAT_EQ(f[r][1], 12.0f);
    EXPECT_EQ(n[r][0], 3 * (int64_t{1} << 40));
    EXPECT_EQ(n[r][1], 3);
  }
}

TEST(ThreadGroup, DifferentCollectivesAtOnePointAreRefusedAndBreakTheGroup) {
  auto group = MakeThreadGroup(3).value();
  std::vector<Status> got(3);
  OnRanks(group, [&](int rank, Coordinator& c) {
    std::vector<int64_t> words = {1, 2};
    std::vector<int64_t> all(6);
    double x = 1;
    if (rank == 2) {
      got[rank] = c.AllreduceSum(std::vector<SumBuffer>{SumBuffer::Host(&x, 1)}, milliseconds(5000));
    } else {
      got[rank] = c.Allgather(words, all, milliseconds(5000));
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[r].code(), StatusCode::kInternal) << got[r];
    EXPECT_NE(got[r].message().find("collective sequence diverged"), std::string::npos) << got[r];
  }
  std::vector<int64_t> one = {1}, all(3);
  EXPECT_FALSE(group[0]->Allgather(one, all, milliseconds(1000)).ok()) << "broken from then on";
}

TEST(ThreadGroup, MismatchedShapesAreRefused) {
  auto group = MakeThreadGroup(2).value();
  std::vector<Status> got(2);
  OnRanks(group, [&](int rank, Coordinator& c) {
    std::vector<double> v(rank == 0 ? 4 : 5, 1.0);
    got[rank] = c.AllreduceSum(std::vector<SumBuffer>{SumBuffer::Host(v.data(), static_cast<int64_t>(v.size()))},
                               milliseconds(5000));
  });
  for (const Status& s : got) EXPECT_NE(s.message().find("collective sequence diverged"), std::string::npos) << s;
}

TEST(ThreadGroup, UnsupportedBuffersAreRefusedBeforeAnyExchange) {
  auto group = MakeThreadGroup(1).value();
  SumBuffer dev;
  int64_t x = 0;
  dev.data = &x;
  dev.count = 1;
  dev.device = 0;
  EXPECT_EQ(group[0]->AllreduceSum(std::vector<SumBuffer>{dev}, milliseconds(100)).code(),
            StatusCode::kInvalidArgument);
  SumBuffer half = dev;
  half.device = -1;
  half.dtype = DType::kFloat16;
  EXPECT_EQ(group[0]->AllreduceSum(std::vector<SumBuffer>{half}, milliseconds(100)).code(),
            StatusCode::kInvalidArgument);
  std::vector<int64_t> mine = {1}, wrong(3);
  EXPECT_EQ(group[0]->Allgather(mine, wrong, milliseconds(100)).code(), StatusCode::kInvalidArgument);
}

TEST(ThreadGroup, SilentRankMakesOthersFailWithinTheDeadline) {
  auto group = MakeThreadGroup(4).value();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Status> got(4);
  OnRanks(group, [&](int rank, Coordinator& c) {
    if (rank == 3) return;  // stops answering
    std::vector<int64_t> mine = {rank}, all(4);
    got[rank] = c.Allgather(mine, all, milliseconds(300));
  });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[r].code(), StatusCode::kUnavailable) << got[r];
  }
  EXPECT_LT(waited, 2.0) << "nobody waits much longer than its deadline";
  // Broken from then on: fails at once.
  std::vector<int64_t> mine = {0}, all(4);
  EXPECT_EQ(group[0]->Allgather(mine, all, milliseconds(10000)).code(), StatusCode::kUnavailable);
}

TEST(ThreadGroup, AbortWakesBlockedRanks) {
  auto group = MakeThreadGroup(2).value();
  Status blocked;
  std::thread t([&] {
    std::vector<int64_t> mine = {0}, all(2);
    blocked = group[0]->Allgather(mine, all, milliseconds(60000));
  });
  std::this_thread::sleep_for(milliseconds(50));
  group[1]->Abort();
  t.join();
  EXPECT_FALSE(blocked.ok());
}

TEST(ThreadGroup, RejectsBadSize) {
  EXPECT_EQ(MakeThreadGroup(0).status().code(), StatusCode::kInvalidArgument);
}

TEST(LocalCoordinator, CollectivesAreTheIdentityExceptTheScale) {
  auto c = MakeLocalCoordinator();
  std::vector<int64_t> mine = {4, 5}, all(2);
  ASSERT_TRUE(c->Allgather(mine, all, milliseconds(1)).ok());
  EXPECT_EQ(all, mine);
  double v[2] = {2.0, -4.0};
  SumBuffer b = SumBuffer::Host(v, 2);
  b.scale = 0.25;
  ASSERT_TRUE(c->AllreduceSum(std::vector<SumBuffer>{b}, milliseconds(1)).ok());
  EXPECT_DOUBLE_EQ(v[0], 0.5);
  EXPECT_DOUBLE_EQ(v[1], -1.0);
  // A device buffer needs no arithmetic when its scale is 1.
  SumBuffer dev;
  dev.data = v;
  dev.count = 2;
  dev.device = 0;
  EXPECT_TRUE(c->AllreduceSum(std::vector<SumBuffer>{dev}, milliseconds(1)).ok());
  c->Abort();
  EXPECT_FALSE(c->Allgather(mine, all, milliseconds(1)).ok());
}

}  // namespace
}  // namespace oomguard
