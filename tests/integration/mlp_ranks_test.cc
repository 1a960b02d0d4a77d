// Data parallelism in the demo model: ranks as threads (ThreadGroup), each
// with its own simulated device. Whatever OOMs each rank meets, every rank
// ends with the same parameters as the single-process run (1e-10 relative).
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "mlp.h"
#include "mlp_ranks.h"
#include "oomguard/oomguard.h"
#include "sim_device.h"

namespace {

mlp::Config Config() {
  mlp::Config c;
  c.steps = 10;
  c.global_batch = 128;
  c.hidden = 64;
  c.seed = 9;
  c.grow_after = 3;
  return c;
}

constexpr auto Device = oomguard::testing::SmallSimDevice;
using oomguard::testing::RunRanks;

class MlpRanks : public ::testing::Test {
 protected:
  void SetUp() override {
    oomguard::ClearFaultRules();
    auto dev = Device(0);
    auto r = mlp::Train(Config(), dev.get());
    ASSERT_TRUE(r.status.ok()) << r.status;
    reference_ = r.params;
  }
  void TearDown() override { oomguard::ClearFaultRules(); }

  void ExpectAllEqualReference(const std::vector<mlp::TrainResult>& rs) {
    for (size_t r = 0; r < rs.size(); ++r) {
      ASSERT_TRUE(rs[r].status.ok()) << "rank " << r << ": " << rs[r].status;
      EXPECT_EQ(rs[r].params, rs[0].params) << "rank " << r << " disagrees";
      EXPECT_LE(mlp::MaxRelativeDifference(rs[r].params, reference_), 1e-10) << "rank " << r;
    }
  }

  std::vector<double> reference_;
};

TEST_F(MlpRanks, FourRanksWithoutOomsMatchTheSingleProcessRun) {
  ExpectAllEqualReference(RunRanks(Config(), {0, 0, 0, 0}));
}

TEST_F(MlpRanks, UnevenBudgetsEachRankLearnsItsOwnSize) {
  auto rs = RunRanks(Config(), {0, 0.35, 0, 0});
  ExpectAllEqualReference(rs);
  EXPECT_GT(rs[1].ooms, 0);
  EXPECT_EQ(rs[0].ooms, 0);
  EXPECT_LT(rs[1].final_micro_batch, rs[0].final_micro_batch);
}

TEST_F(MlpRanks, UniformMicroBatchGivesEveryRankTheSmallest) {
  mlp::Config c = Config();
  c.uniform_micro_batch = true;
  auto rs = RunRanks(c, {0, 0.35, 0, 0});
  ExpectAllEqualReference(rs);
  for (const auto& r : rs) EXPECT_EQ(r.final_micro_batch, rs[1].final_micro_batch);
}

TEST_F(MlpRanks, InjectedOomsOnOneRankAndOnEveryRank) {
  for (const char* rules : {"oom@step=2,rank=1,site=forward", "oom@step=3,rank=2,site=backward",
                            // Every rank once (rules name the rank: a shared times=4 could be
                            // used up by one rank's retries), then twice more on rank 3.
                            "oom@step=1,rank=0,site=backward;oom@step=1,rank=1,site=backward;"
                            "oom@step=1,rank=2,site=backward;oom@step=1,rank=3,site=backward;"
                            "oom@step=5,rank=3,site=micro_batch,times=2"}) {
    ASSERT_TRUE(oomguard::SetFaultRules(rules).ok());
    auto rs = RunRanks(Config(), {0, 0, 0, 0});
    ExpectAllEqualReference(rs);
    int64_t ooms = 0;
    for (const auto& r : rs) ooms += r.ooms;
    EXPECT_GE(ooms, 1) << rules;
  }
}

TEST_F(MlpRanks, OomInOneRanksOptimizerStepRollsEveryRankBack) {
  mlp::Config c = Config();
  char dir[] = "/tmp/oomguard-ranks-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  c.ckpt_dir = dir;
  c.ckpt_every = 2;
  ASSERT_TRUE(oomguard::SetFaultRules("oom@step=5,rank=2,site=optimizer").ok());
  auto rs = RunRanks(c, {0, 0, 0, 0});
  ExpectAllEqualReference(rs);
  for (const auto& r : rs) EXPECT_GE(r.rollbacks, 1) << "every rank rolled back";
  std::filesystem::remove_all(dir);
}

}  // namespace
