// What the knowledge base learns from guarded runs of the demo model: priors
// only from what an OOM says, patterns that name where the memory went, and
// one run for every rank of a job.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>
#include <thread>

#include "mlp.h"
#include "mlp_ranks.h"
#include "oomguard/knowledge_base.h"
#include "oomguard/oomguard.h"
#include "sim_device.h"

namespace {

namespace fs = std::filesystem;
constexpr auto Device = oomguard::testing::SmallSimDevice;

mlp::Config SmallRun(int64_t steps, int64_t global_batch, int hidden) {
  mlp::Config cfg;
  cfg.steps = steps;
  cfg.global_batch = global_batch;
  cfg.hidden = hidden;
  return cfg;
}

class KnowledgeLessons : public ::testing::Test {
 protected:
  void SetUp() override {
    oomguard::ClearFaultRules();
    dir_ = fs::temp_directory_path() / ("oomguard-lessons-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    oomguard::ClearFaultRules();
    fs::remove_all(dir_);
  }
  std::unique_ptr<oomguard::KnowledgeBase> OpenKb() {
    return oomguard::KnowledgeBase::Open((dir_ / "kb.sqlite").string()).value();
  }
  // Trains on ranks as threads, every rank writing to (and learning from) `kb`.
  std::vector<mlp::TrainResult> RunRanks(const mlp::Config& cfg, const std::vector<double>& budgets,
                                         oomguard::KnowledgeBase* kb) {
    mlp::TrainHooks hooks;
    hooks.incidents = kb->sink();
    hooks.priors = kb;
    return oomguard::testing::RunRanks(cfg, budgets, hooks);
  }

  fs::path dir_;
};

// An injected OOM halves the micro-batch but says nothing about memory: a
// run whose only OOM was injected must leave no prior behind, so the next
// run starts where the user said, not at the half.
TEST_F(KnowledgeLessons, AnInjectedOomTeachesTheNextRunNothing) {
  mlp::Config cfg = SmallRun(6, 64, 32);
  cfg.micro_batch = 64;
  cfg.grow_after = 100;  // the run ends before it would grow back
  auto kb = OpenKb();
  mlp::TrainHooks hooks;
  hooks.incidents = kb->sink();
  hooks.priors = kb.get();
  ASSERT_TRUE(oomguard::SetFaultRules("oom@step=0,site=forward").ok());
  auto dev = Device(0);
  auto first = mlp::Train(cfg, dev.get(), hooks);
  oomguard::ClearFaultRules();
  ASSERT_TRUE(first.status.ok()) << first.status;
  ASSERT_EQ(first.ooms, 1);
  EXPECT_EQ(first.final_micro_batch, 32) << "the injected OOM halved the micro-batch";
  ASSERT_TRUE(kb->Flush().ok());
  EXPECT_FALSE(kb->PriorMicroBatch(mlp::WorkloadSignature(cfg)).has_value());

  auto dev2 = Device(0);
  auto second = mlp::Train(cfg, dev2.get(), hooks);
  ASSERT_TRUE(second.status.ok()) << second.status;
  EXPECT_EQ(second.initial_micro_batch, 64);
  EXPECT_EQ(second.final_micro_batch, 64);
}

// The guard records an OOM in the sync buffers or at the vote as phase
// "commit": its memory is the gradients' and the collective's, not the
// optimizer's state.
TEST_F(KnowledgeLessons, SyncAndVoteSiteOomsAreNotLabelledOptimizerState) {
  const mlp::Config cfg = SmallRun(4, 64, 32);
  auto kb = OpenKb();
  mlp::TrainHooks hooks;
  hooks.incidents = kb->sink();
  ASSERT_TRUE(
      oomguard::SetFaultRules("oom@step=0,site=sync;oom@step=1,site=vote;oom@step=2,site=optimizer").ok());
  auto dev = Device(0);
  auto r = mlp::Train(cfg, dev.get(), hooks);
  oomguard::ClearFaultRules();
  ASSERT_FALSE(r.status.ok()) << "the optimizer-site OOM cannot be undone without a checkpoint";
  ASSERT_TRUE(kb->Flush().ok());
  auto found = kb->Query({});
  ASSERT_TRUE(found.ok()) << found.status();
  std::set<int64_t> steps;
  for (const auto& inc : *found) {
    steps.insert(inc.step);
    if (inc.step <= 1) {
      EXPECT_EQ(inc.phase, oomguard::Phase::kCommit) << "step " << inc.step;
      EXPECT_NE(inc.pattern, "optimizer_state") << "step " << inc.step << ": " << inc.evidence;
    } else {
      EXPECT_EQ(inc.pattern, "optimizer_state") << "the optimizer's own OOM still is: " << inc.evidence;
    }
  }
  EXPECT_EQ(steps, (std::set<int64_t>{0, 1, 2}));
}

// Every rank of one job records under one run id; two jobs are two runs.
TEST_F(KnowledgeLessons, EveryRankOfAJobRecordsOneRun) {
  const mlp::Config cfg = SmallRun(3, 64, 32);
  auto kb = OpenKb();
  for (int job = 0; job < 2; ++job) {
    // Once on each rank (a rule without rank= fires once in all).
    ASSERT_TRUE(
        oomguard::SetFaultRules("oom@step=1,rank=0,site=forward;oom@step=1,rank=1,site=forward").ok());
    auto rs = RunRanks(cfg, {0, 0}, kb.get());
    for (const auto& r : rs) ASSERT_TRUE(r.status.ok()) << r.status;
  }
  oomguard::ClearFaultRules();
  ASSERT_TRUE(kb->Flush().ok());
  auto found = kb->Query({});
  ASSERT_TRUE(found.ok());
  ASSERT_EQ(found->size(), 4u) << "one OOM per rank per job";
  std::set<std::string> runs;
  std::set<std::pair<std::string, int>> rank_in_run;
  for (const auto& inc : *found) {
    runs.insert(inc.run_id);
    rank_in_run.insert({inc.run_id, inc.rank});
  }
  EXPECT_EQ(runs.size(), 2u) << "two jobs of two ranks each";
  EXPECT_EQ(rank_in_run.size(), 4u) << "each run holds both ranks";
}

// Rank 1 runs out of memory (a smaller device), rank 0 never does. Rank 0
// keeps its size in this run and in the next one, which reads the same
// knowledge base: rank 1's lesson is rank 1's.
TEST_F(KnowledgeLessons, AnOomOnOneRankDoesNotPinAnother) {
  mlp::Config cfg = SmallRun(6, 256, 64);
  cfg.grow_after = 2;
  auto kb = OpenKb();
  auto first = RunRanks(cfg, {0, 0.35}, kb.get());
  for (const auto& r : first) ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_GE(first[1].ooms, 1) << "rank 1's budget must cause OOMs";
  ASSERT_EQ(first[0].ooms, 0);
  for (int64_t limit : first[0].micro_limits) EXPECT_EQ(limit, 128) << "rank 0 was cut down by rank 1's OOM";
  ASSERT_TRUE(kb->Flush().ok());

  auto second = RunRanks(cfg, {0, 0.35}, kb.get());
  for (const auto& r : second) ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(second[0].initial_micro_batch, 128) << "rank 0 started from rank 1's prior";
  EXPECT_LT(second[1].initial_micro_batch, 128) << "rank 1 starts from what it learned";
  EXPECT_LT(second[1].ooms, first[1].ooms) << "and meets fewer OOMs";
  EXPECT_EQ(second[1].params, second[0].params);
}

}  // namespace
