// What an OOM teaches the guard's micro-batch size, by where it happened
// (inside a micro-batch, outside the micro-batches, injected), and
// Guard::Evaluate: a batch of evaluation split until it fits, on this rank
// alone, with its incidents recorded.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "oomguard/device.h"
#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/incident.h"
#include "oomguard/oom_error.h"
#include "sdk/guard/guard_testing.h"

namespace oomguard {
namespace {

class GuardSizes : public testing::FaultsCleared {
 protected:
  static std::unique_ptr<Guard> Make(const GuardOptions& o) { return testing::MakeGuard(o); }

  // A training step of n samples whose micro-batches do nothing but count.
  StepRequest Train(int64_t n) {
    StepRequest r;
    r.samples = n;
    r.micro = [this](const MicroBatch& mb) { sizes.push_back(mb.size); };
    r.apply = [] {};
    r.reset = [] {};
    return r;
  }
  std::vector<int64_t> sizes;
};

using Sink = testing::RecordingSink;

// Issue 23/30: an OOM at the sync site when the limit was 1 left every later
// step at micro-batches of 1; what the sync allocates does not depend on the split.
TEST_F(GuardSizes, OomOutsideTheMicroBatchesKeepsTheSize) {
  for (const char* site : {"vote", "commit", "sync"}) {
    SCOPED_TRACE(site);
    ASSERT_TRUE(SetFaultRules(std::string("oom@step=1,site=") + site).ok());
    GuardOptions o;
    o.initial_micro_batch = 4;
    auto g = Make(o);
    for (int s = 0; s < 3; ++s) {
      StepReport rep;
      ASSERT_TRUE(g->Step(Train(16), &rep).ok());
      if (s == 1) {
        EXPECT_EQ(rep.ooms, 1);
        ASSERT_EQ(rep.incidents.size(), 1u);
        EXPECT_EQ(rep.incidents[0].action, LadderAction::kRelease) << "released and redone, not halved";
      }
      EXPECT_EQ(g->micro_limit(), 4);
    }
    ClearFaultRules();
  }
}

TEST_F(GuardSizes, ARepeatedOomOutsideTheMicroBatchesEndsWithoutARecoveryStore) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=sync,times=2").ok());
  GuardOptions o;
  o.initial_micro_batch = 4;
  auto g = Make(o);
  StepReport rep;
  Status s = g->Step(Train(16), &rep);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("outside the micro-batches"), std::string::npos) << s;
  EXPECT_EQ(g->micro_limit(), 4) << "nothing halves for memory the split does not hold";
}

TEST_F(GuardSizes, AnInjectedOomHalvesAndGrowsBackAfterCleanSteps) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=micro_batch").ok());
  GuardOptions o;
  o.initial_micro_batch = 8;
  o.max_micro_batch = 8;
  o.grow_after = 2;
  auto g = Make(o);
  ASSERT_TRUE(g->Step(Train(16)).ok());
  EXPECT_EQ(g->micro_limit(), 4);
  int steps = 0;
  while (g->micro_limit() < 8 && steps < 10) {
    ASSERT_TRUE(g->Step(Train(16)).ok());
    ++steps;
  }
  EXPECT_EQ(g->micro_limit(), 8);
  // The step that recovered ran clean at 4 too: grow_after clean steps in all.
  EXPECT_EQ(steps, o.grow_after - 1) << "an injected OOM teaches nothing: grow_after clean steps and back";
}

// ---- Evaluate ----

TEST_F(GuardSizes, EvaluateSplitsWhatDoesNotFitAndKeepsWhatRan) {
  Sink sink;
  GuardOptions o;
  o.incidents = &sink;
  auto g = Make(o);
  std::vector<std::pair<int64_t, int64_t>> done;  // (offset, size) of micro-batches that completed
  double weights = 0;
  EvalRequest r;
  r.samples = 20;
  r.micro = [&](const MicroBatch& mb) {
    if (mb.size > 6) throw DeviceOomError("CUDA out of memory. Tried to allocate 2.00 MiB", 2 << 20, MemoryStats{});
    done.emplace_back(mb.offset, mb.size);
    weights += mb.weight;
  };
  StepReport rep;
  ASSERT_TRUE(g->Evaluate(r, &rep).ok()) << rep.status;
  EXPECT_EQ(rep.ooms, 2);  // 20 -> 10 -> 5
  int64_t covered = 0;
  for (auto [offset, size] : done) {
    EXPECT_EQ(offset, covered) << "each sample evaluated once, in order";
    covered += size;
  }
  EXPECT_EQ(covered, 20);
  EXPECT_DOUBLE_EQ(weights, 1.0);
  EXPECT_EQ(g->eval_micro_limit(), 5);
  EXPECT_EQ(g->step(), 0) << "evaluation is not a step";
  ASSERT_EQ(sink.recorded.size(), 2u);
  EXPECT_EQ(sink.recorded[0].phase, Phase::kEval);
  EXPECT_EQ(sink.recorded[0].action, LadderAction::kHalve);
  ASSERT_EQ(sink.updated.size(), 2u);
  EXPECT_EQ(sink.updated[0].outcome, IncidentOutcome::kRecovered);
}

TEST_F(GuardSizes, EvaluateStartsAtTheTrainingLimitAndIsSeparateFromIt) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=micro_batch").ok());
  GuardOptions o;
  o.initial_micro_batch = 16;
  auto g = Make(o);
  ASSERT_TRUE(g->Step(Train(16)).ok());
  ASSERT_EQ(g->micro_limit(), 8);
  ASSERT_TRUE(SetFaultRules("oom@site=eval,times=1").ok());
  EvalRequest r;
  r.samples = 16;
  std::vector<int64_t> eval_sizes;
  r.micro = [&](const MicroBatch& mb) { eval_sizes.push_back(mb.size); };
  StepReport rep;
  ASSERT_TRUE(g->Evaluate(r, &rep).ok());
  EXPECT_EQ(eval_sizes, (std::vector<int64_t>{4, 4, 4, 4})) << "from the training limit 8, halved once";
  EXPECT_EQ(rep.incidents.at(0).phase, Phase::kEval);
  EXPECT_EQ(g->micro_limit(), 8) << "evaluation OOMs leave training's limit alone";
}

TEST_F(GuardSizes, EvaluateGivesUpOnOneSampleAndPassesOtherErrorsThrough) {
  GuardOptions o;
  o.initial_micro_batch = 1;
  auto g = Make(o);
  EvalRequest r;
  r.samples = 3;
  r.micro = [](const MicroBatch&) { throw HostOomError("DefaultCPUAllocator: can't allocate memory", 1 << 20); };
  StepReport rep;
  Status s = g->Evaluate(r, &rep);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("one sample"), std::string::npos) << s;
  ASSERT_EQ(rep.incidents.size(), 1u);
  EXPECT_EQ(rep.incidents[0].outcome, IncidentOutcome::kFailed);

  r.micro = [](const MicroBatch&) { throw std::logic_error("a bug in the metric"); };
  EXPECT_THROW((void)g->Evaluate(r), std::logic_error);

  r.micro = nullptr;
  EXPECT_EQ(g->Evaluate(r).code(), StatusCode::kInvalidArgument);
  r.micro = [](const MicroBatch&) {};
  r.samples = 0;
  EXPECT_EQ(g->Evaluate(r).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace oomguard
