#include "oomguard/plan.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

namespace oomguard {
namespace {

// Checks the invariants every plan must hold over [begin, n).
void ExpectCovers(const std::vector<MicroBatch>& plan, int64_t n, int64_t begin, int first_index) {
  ASSERT_FALSE(plan.empty());
  int64_t next = begin;
  double weights = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const MicroBatch& mb = plan[i];
    EXPECT_EQ(mb.index, first_index + static_cast<int>(i));
    EXPECT_EQ(mb.count, first_index + static_cast<int>(plan.size()));
    EXPECT_EQ(mb.offset, next) << "micro-batches must be contiguous";
    EXPECT_GE(mb.size, 1);
    EXPECT_DOUBLE_EQ(mb.weight, static_cast<double>(mb.size) / static_cast<double>(n));
    next += mb.size;
    weights += mb.weight;
  }
  EXPECT_EQ(next, n) << "the plan must end at n";
  EXPECT_NEAR(weights, static_cast<double>(n - begin) / static_cast<double>(n), 1e-12);
}

TEST(PlanBySamples, PropertyOverManyInputs) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 5000; ++trial) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 3000);
    const int64_t limit = 1 + static_cast<int64_t>(rng() % (n + 50));
    const int64_t begin = static_cast<int64_t>(rng() % n);
    auto plan = PlanBySamples(n, limit, begin, 3);
    ExpectCovers(plan, n, begin, 3);
    const int64_t rest = n - begin;
    EXPECT_EQ(static_cast<int64_t>(plan.size()), (rest + limit - 1) / limit) << "fewest micro-batches";
    int64_t lo = INT64_MAX, hi = 0;
    for (const auto& mb : plan) {
      EXPECT_LE(mb.size, limit);
      lo = std::min(lo, mb.size);
      hi = std::max(hi, mb.size);
    }
    EXPECT_LE(hi - lo, 1) << "balanced sizes";
  }
}

TEST(PlanBySamples, WholeBatchWhenLimitIsLarge) {
  auto plan = PlanBySamples(10, 1000);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].size, 10);
  EXPECT_DOUBLE_EQ(plan[0].weight, 1.0);
}

TEST(PlanBySamples, BalancedSplit) {
  auto plan = PlanBySamples(10, 4);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].size, 4);
  EXPECT_EQ(plan[1].size, 3);
  EXPECT_EQ(plan[2].size, 3);
}

TEST(PlanByCost, PropertyOverManyInputs) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 400);
    std::vector<int64_t> costs(static_cast<size_t>(n));
    for (auto& c : costs) c = static_cast<int64_t>(rng() % 100);  // zero costs allowed
    if (trial % 10 == 0) costs[rng() % n] = 10000;                  // an outlier
    const int64_t limit = 1 + static_cast<int64_t>(rng() % 500);
    const int64_t begin = static_cast<int64_t>(rng() % n);
    auto plan = PlanByCost(costs, limit, begin, 0);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectCovers(*plan, n, begin, 0);
    for (size_t i = 0; i < plan->size(); ++i) {
      const MicroBatch& mb = (*plan)[i];
      int64_t sum = std::accumulate(costs.begin() + mb.offset, costs.begin() + mb.offset + mb.size, int64_t{0});
      EXPECT_EQ(mb.cost, sum);
      if (mb.size > 1) EXPECT_LE(mb.cost, limit) << "only a lone sample may exceed the limit";
      // Greedy: the next sample would not have fitted.
      if (i + 1 < plan->size()) EXPECT_GT(mb.cost + costs[static_cast<size_t>(mb.offset + mb.size)], limit);
    }
  }
}

TEST(PlanByCost, OversizedSampleGetsItsOwnMicroBatch) {
  std::vector<int64_t> costs = {3, 3, 50, 3, 3};
  auto plan = PlanByCost(costs, 10);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->size(), 3u);
  EXPECT_EQ((*plan)[1].offset, 2);
  EXPECT_EQ((*plan)[1].size, 1);
  EXPECT_EQ((*plan)[1].cost, 50);
}

TEST(PlanByCost, RejectsBadInput) {
  std::vector<int64_t> costs = {1, -2, 3};
  auto plan = PlanByCost(costs, 10);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("sample 1"), std::string::npos);
  std::vector<int64_t> ok = {1, 2};
  EXPECT_EQ(PlanByCost(ok, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanByCost(ok, 5, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanByCost(std::span<const int64_t>(), 5).status().code(), StatusCode::kInvalidArgument);
  // Issue 28: costs whose sum wraps packed into one micro-batch of negative cost.
  std::vector<int64_t> huge(3, int64_t{1} << 62);
  auto wrapped = PlanByCost(huge, INT64_MAX);
  ASSERT_FALSE(wrapped.ok());
  EXPECT_EQ(wrapped.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrapped.status().message().find("costs overflow"), std::string::npos) << wrapped.status();
  EXPECT_NE(wrapped.status().message().find("sample 1"), std::string::npos) << wrapped.status();
}

// The central identity on a scalar least-squares model: the weighted sum of
// micro-batch mean gradients equals the full-batch mean gradient for any plan.
TEST(PlanBySamples, WeightedGradientsEqualFullBatchGradient) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd;
  const int64_t n = 777;
  std::vector<double> x(n), y(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = nd(rng);
    y[i] = 3 * x[i] + nd(rng);
  }
  const double w = 0.5;
  double full = 0;
  for (int64_t i = 0; i < n; ++i) full += (w * x[i] - y[i]) * x[i];
  full /= n;
  for (int64_t limit : {1, 2, 7, 64, 100, 776, 777, 10000}) {
    double acc = 0;
    for (const auto& mb : PlanBySamples(n, limit)) {
      double g = 0;
      for (int64_t i = mb.offset; i < mb.offset + mb.size; ++i) g += (w * x[i] - y[i]) * x[i];
      acc += mb.weight * (g / mb.size);
    }
    EXPECT_NEAR(acc, full, 1e-12 * std::fabs(full)) << "limit " << limit;
  }
}

}  // namespace
}  // namespace oomguard
