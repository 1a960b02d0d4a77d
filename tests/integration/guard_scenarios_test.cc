// Scenarios of the guard on a simulated device that unit tests of single
// components cannot show: fragmentation, leaks and optimizer state.
#include <gtest/gtest.h>

#include "mlp.h"
#include "oomguard/oomguard.h"
#include "sim_device.h"

namespace {

constexpr auto Device = oomguard::testing::SmallSimDevice;

class RecordingSink : public oomguard::IncidentSink {
 public:
  void Record(const oomguard::Incident& i) override { recorded.push_back(i); }
  void UpdateOutcome(const oomguard::Incident& i) override { updated.push_back(i); }
  std::vector<oomguard::Incident> recorded, updated;
};

TEST(GuardScenarios, IncidentsCarryMemoryHistoryAndOutcome) {
  mlp::Config cfg;
  cfg.steps = 10;
  cfg.global_batch = 128;
  cfg.hidden = 64;
  auto dev = Device(0.35);
  RecordingSink sink;
  mlp::TrainHooks hooks;
  hooks.incidents = &sink;
  auto r = mlp::Train(cfg, dev.get(), hooks);
  ASSERT_TRUE(r.status.ok()) << r.status;
  ASSERT_FALSE(sink.recorded.empty());
  ASSERT_EQ(sink.recorded.size(), sink.updated.size());
  for (const auto& inc : sink.updated) {
    EXPECT_EQ(inc.outcome, oomguard::IncidentOutcome::kRecovered);
    EXPECT_EQ(inc.kind, oomguard::IncidentKind::kDevice);
    EXPECT_GT(inc.memory.total, 0);
    EXPECT_GT(inc.requested_bytes, 0);
    EXPECT_FALSE(inc.workload.empty());
    EXPECT_GE(inc.micro_before, inc.micro_after);
    EXPECT_FALSE(inc.actions.empty());
    EXPECT_EQ(inc.actions.front(), oomguard::LadderAction::kRelease);
  }
}

TEST(GuardScenarios, LeakShowsAsGrowingStepPeaksAndEventuallyFails) {
  mlp::Config cfg;
  cfg.steps = 60;
  cfg.global_batch = 64;
  cfg.hidden = 32;
  cfg.leak_bytes_per_step = 16 << 10;
  auto dev = Device(0.6);
  RecordingSink sink;
  mlp::TrainHooks hooks;
  hooks.incidents = &sink;
  auto r = mlp::Train(cfg, dev.get(), hooks);
  EXPECT_FALSE(r.status.ok()) << "a leak cannot be fixed by splitting";
  ASSERT_FALSE(sink.recorded.empty());
  const auto& last = sink.recorded.back();
  ASSERT_GE(last.step_peaks.size(), 3u);
  EXPECT_GT(last.step_peaks.back(), last.step_peaks.front()) << "the per-step peak grows";
}

TEST(GuardScenarios, LazyOptimizerStateOomsInTheFirstOptimizerStep) {
  mlp::Config cfg;
  cfg.steps = 3;
  cfg.global_batch = 64;
  cfg.hidden = 64;
  cfg.lazy_optimizer_state = true;
  // Parameters + gradients fit with room for activations; the Adam moments
  // (twice the parameters) do not fit on top.
  auto dev = Device(0.2);
  RecordingSink sink;
  mlp::TrainHooks hooks;
  hooks.incidents = &sink;
  auto r = mlp::Train(cfg, dev.get(), hooks);
  ASSERT_FALSE(sink.recorded.empty());
  bool in_optimizer = false;
  for (const auto& inc : sink.recorded) in_optimizer |= inc.phase == oomguard::Phase::kOptimizer || inc.phase == oomguard::Phase::kCommit;
  EXPECT_TRUE(in_optimizer);
  EXPECT_FALSE(r.status.ok()) << "without a checkpoint an OOM in the optimizer step cannot be undone";
}

// Without a directory, a checkpointer in memory only is enough to undo an
// OOM in the optimizer step: the run rolls back to the in-memory snapshot
// (the state before the first step, then the saves every 3 steps) and ends
// with the parameters of a run without OOMs.
TEST(GuardScenarios, OptimizerOomsRollBackFromMemoryWithoutACheckpointDirectory) {
  for (const char* optimizer : {"adam", "sgd"}) {
    mlp::Config cfg;
    cfg.steps = 10;
    cfg.global_batch = 64;
    cfg.hidden = 32;
    cfg.optimizer = optimizer;
    auto ref_dev = Device(0);
    auto ref = mlp::Train(cfg, ref_dev.get());
    ASSERT_TRUE(ref.status.ok()) << ref.status;

    cfg.ckpt_in_memory = true;
    cfg.ckpt_every = 3;
    ASSERT_TRUE(oomguard::SetFaultRules("oom@step=0,site=apply;oom@step=7,site=apply").ok());
    auto dev = Device(0);
    auto r = mlp::Train(cfg, dev.get());
    oomguard::ClearFaultRules();
    ASSERT_TRUE(r.status.ok()) << optimizer << ": " << r.status;
    EXPECT_EQ(r.rollbacks, 2) << optimizer;
    EXPECT_EQ(r.checkpoints_written, 0) << "nothing goes to disk";
    EXPECT_LE(mlp::MaxRelativeDifference(r.params, ref.params), 1e-10) << optimizer;
  }
}

}  // namespace
