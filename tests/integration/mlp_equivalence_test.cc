// The central property of the SDK: training under any sequence of OOMs, and
// the splits they cause, ends with the same parameters as training without
// them (float64, within 1e-10 relative).
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "mlp.h"
#include "oomguard/oomguard.h"
#include "sim_device.h"

namespace {

mlp::Config SmallConfig() {
  mlp::Config c;
  c.steps = 12;
  c.global_batch = 96;
  c.hidden = 64;
  c.seed = 5;
  c.grow_after = 2;
  return c;
}

constexpr auto Device = oomguard::testing::SmallSimDevice;

std::vector<double> Reference(const mlp::Config& cfg) {
  oomguard::ClearFaultRules();
  auto dev = Device(0);
  auto r = mlp::Train(cfg, dev.get());
  EXPECT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.ooms, 0);
  return r.params;
}

class MlpEquivalence : public ::testing::Test {
 protected:
  void TearDown() override { oomguard::ClearFaultRules(); }
};

TEST_F(MlpEquivalence, RandomFaultPlansEndWithTheReferenceParameters) {
  for (const char* opt : {"adam", "sgd"}) {
    mlp::Config cfg = SmallConfig();
    cfg.optimizer = opt;
    const std::vector<double> ref = Reference(cfg);
    std::mt19937_64 rng(1234);
    const char* sites[] = {"micro_batch", "forward", "backward"};
    int64_t total_ooms = 0;
    for (int plan = 0; plan < 25; ++plan) {
      std::string rules;
      const int n = 1 + static_cast<int>(rng() % 4);
      for (int i = 0; i < n; ++i) {
        if (!rules.empty()) rules += ";";
        rules += "oom@step=" + std::to_string(rng() % cfg.steps) + ",site=" + sites[rng() % 3];
        if (rng() % 2) rules += ",micro=" + std::to_string(rng() % 3);
        if (rng() % 3 == 0) rules += ",times=" + std::to_string(1 + rng() % 3);
      }
      ASSERT_TRUE(oomguard::SetFaultRules(rules).ok()) << rules;
      mlp::Config c = cfg;
      c.micro_batch = static_cast<int64_t>(8 + rng() % 96);
      auto dev = Device(0);
      auto r = mlp::Train(c, dev.get());
      ASSERT_TRUE(r.status.ok()) << rules << ": " << r.status;
      EXPECT_EQ(r.steps_done, cfg.steps);
      total_ooms += r.ooms;
      EXPECT_LE(mlp::MaxRelativeDifference(r.params, ref), 1e-10) << opt << " rules " << rules;
    }
    EXPECT_GT(total_ooms, 25) << "the fault plans must actually cause OOMs";
  }
}

TEST_F(MlpEquivalence, BudgetCausedOomsEndWithTheReferenceParameters) {
  // Both controllers: the predictive one also re-plans the rest of a step
  // when its figures move the limit, which must not change the gradient.
  for (oomguard::SizePolicy policy : {oomguard::SizePolicy::kPredictive, oomguard::SizePolicy::kSearch}) {
    mlp::Config cfg = SmallConfig();
    cfg.controller = policy;
    const std::vector<double> ref = Reference(cfg);
    int64_t total_ooms = 0;
    for (double budget : {0.35, 0.4, 0.5}) {
      auto dev = Device(budget);
      auto r = mlp::Train(cfg, dev.get());
      ASSERT_TRUE(r.status.ok()) << "budget " << budget << ": " << r.status;
      total_ooms += r.ooms;
      EXPECT_LT(r.final_micro_batch, cfg.global_batch) << "budget " << budget;
      EXPECT_LE(mlp::MaxRelativeDifference(r.params, ref), 1e-10) << "budget " << budget;
    }
    // Every budget is too small for the whole step: each run had at least
    // its first OOM (the search has more: it learns only from OOMs).
    EXPECT_GE(total_ooms, policy == oomguard::SizePolicy::kSearch ? 5 : 3);
  }
}

TEST_F(MlpEquivalence, BudgetAndInjectedFaultsTogether) {
  mlp::Config cfg = SmallConfig();
  const std::vector<double> ref = Reference(cfg);
  ASSERT_TRUE(oomguard::SetFaultRules("oom@step=3,site=backward,times=2;host_oom@step=7,site=forward;"
                                      "oom@step=9-11,site=micro_batch,micro=1")
                  .ok());
  auto dev = Device(0.4);
  auto r = mlp::Train(cfg, dev.get());
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_GE(r.ooms, 5) << "four injected, and the budget's own";
  EXPECT_LE(mlp::MaxRelativeDifference(r.params, ref), 1e-10);
}

TEST_F(MlpEquivalence, ModelThatDoesNotFitIsAClearError) {
  mlp::Config cfg = SmallConfig();
  cfg.hidden = 256;
  auto dev = Device(0.1);
  auto r = mlp::Train(cfg, dev.get());
  EXPECT_EQ(r.status.code(), oomguard::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status.message().find("do not fit"), std::string::npos);
}

TEST_F(MlpEquivalence, OomAtTheMinimumWithoutCheckpointGivesUpCleanly) {
  mlp::Config cfg = SmallConfig();
  cfg.min_micro_batch = 16;
  ASSERT_TRUE(oomguard::SetFaultRules("oom@step=2,site=forward,times=0").ok());
  auto dev = Device(0);
  auto r = mlp::Train(cfg, dev.get());
  EXPECT_EQ(r.status.code(), oomguard::StatusCode::kResourceExhausted) << r.status;
  EXPECT_EQ(r.steps_done, 2);
  EXPECT_NE(r.status.message().find("incident"), std::string::npos);
}

}  // namespace
