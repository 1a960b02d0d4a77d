// Guard::Step against careless and hostile callers (issue 28): a step called
// from inside a step, step numbers no checkpoint could name, loss units and
// costs whose sums overflow, and exceptions that are not std::exceptions (a
// Python KeyboardInterrupt carried through C++) in the callbacks whose own
// std::exceptions the guard survives: cache releasers and checkpoint saves.
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/recovery.h"

namespace oomguard {
namespace {

// Not a std::exception, as the Python bindings' carrier of an interrupt is not.
struct Interrupt {};

std::unique_ptr<Guard> NewGuard(GuardOptions o = {}) {
  auto g = Guard::Create(o);
  EXPECT_TRUE(g.ok()) << g.status();
  return std::move(g).value();
}

StepRequest Plain(int64_t samples) {
  StepRequest r;
  r.samples = samples;
  r.micro = [](const MicroBatch&) {};
  r.reset = [] {};
  r.apply = [] {};
  return r;
}

TEST(GuardMisuseTest, StepCalledFromInsideAStepIsRefusedAndTheOuterStepCompletes) {
  auto g = NewGuard();
  StepRequest r = Plain(4);
  Status inner;
  Status set_inside;
  int inner_calls = 0;
  r.micro = [&](const MicroBatch&) {
    if (inner_calls++ == 0) {
      inner = g->Step(Plain(2));
      set_inside = g->SetStep(7);
    }
  };
  StepReport rep;
  ASSERT_TRUE(g->Step(r, &rep).ok());
  EXPECT_EQ(inner.code(), StatusCode::kFailedPrecondition) << inner;
  EXPECT_NE(inner.message().find("inside a step"), std::string::npos) << inner;
  EXPECT_EQ(set_inside.code(), StatusCode::kFailedPrecondition) << set_inside;
  EXPECT_EQ(rep.step, 0);
  EXPECT_EQ(g->step(), 1) << "the nested call advanced the step counter";
  EXPECT_TRUE(g->Step(Plain(2)).ok()) << "a step after the refused one runs";
  EXPECT_EQ(g->step(), 2);
}

TEST(GuardMisuseTest, StepNumbersNoCheckpointCouldNameAreRefused) {
  auto g = NewGuard();
  for (int64_t bad : {int64_t{-3}, int64_t{-1}, kMaxStep + 1, std::numeric_limits<int64_t>::max()}) {
    Status s = g->SetStep(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find(std::to_string(bad)), std::string::npos) << s;
  }
  EXPECT_EQ(g->step(), 0);
  ASSERT_TRUE(g->SetStep(kMaxStep).ok());
  ASSERT_TRUE(g->Step(Plain(2)).ok());
  EXPECT_EQ(g->step(), kMaxStep + 1);
  Status past = g->Step(Plain(2));
  EXPECT_EQ(past.code(), StatusCode::kInvalidArgument) << past;
  EXPECT_EQ(g->step(), kMaxStep + 1) << "the counter moved past the last step";
}

TEST(GuardMisuseTest, UnitsAndCostsWhoseSumsOverflowAreRefusedNamingTheOverflow) {
  auto g = NewGuard();
  int ran = 0;
  StepRequest r = Plain(4);
  r.micro = [&](const MicroBatch&) { ++ran; };
  const std::vector<int64_t> units(4, int64_t{1} << 62);  // sums to 2^64: every weight 0 before
  r.units = units;
  Status s = g->Step(r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("units overflow"), std::string::npos) << s;
  EXPECT_EQ(ran, 0);
  r = Plain(3);
  r.micro = [&](const MicroBatch&) { ++ran; };
  const std::vector<int64_t> costs(3, int64_t{1} << 62);  // one micro-batch of negative cost before
  r.costs = costs;
  s = g->Step(r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("costs overflow"), std::string::npos) << s;
  EXPECT_EQ(ran, 0);
  EXPECT_EQ(g->step(), 0);
  // Large units that do sum are fine.
  const std::vector<int64_t> big(4, int64_t{1} << 60);
  r = Plain(4);
  r.units = big;
  double weights = 0;
  r.micro = [&](const MicroBatch& mb) { weights += mb.weight; };
  ASSERT_TRUE(g->Step(r).ok());
  EXPECT_NEAR(weights, 1.0, 1e-12);
}

class InterruptingStore : public RecoveryStore {
 public:
  bool foreign = true;
  int saves = 0;
  std::vector<int64_t> DurableSteps() override { return {}; }
  std::optional<int64_t> SnapshotStep() override { return 0; }  // no initial snapshot is asked for
  Status Restore(int64_t) override { return Status::Ok(); }
  Status OnStepCommitted(int64_t, bool) override {
    ++saves;
    if (foreign) throw Interrupt{};
    throw std::runtime_error("the save callback failed");
  }
};

// Row 9: the save after a committed step raises. A std::exception costs the
// checkpoint and training goes on; anything else passes through Step once
// the step is committed.
TEST(GuardMisuseTest, ForeignExceptionOfACheckpointSavePassesThroughAfterTheCommit) {
  InterruptingStore store;
  GuardOptions o;
  o.recovery = &store;
  auto g = NewGuard(o);
  EXPECT_THROW((void)g->Step(Plain(4)), Interrupt);
  EXPECT_EQ(store.saves, 1);
  EXPECT_EQ(g->step(), 1) << "the step itself was committed";
  store.foreign = false;
  EXPECT_TRUE(g->Step(Plain(4)).ok());
  EXPECT_EQ(g->step(), 2);
}

// Row 15: a releaser's std::exception is logged and the next releaser runs;
// any other exception stops the step and passes through Step.
TEST(GuardMisuseTest, ForeignExceptionOfACacheReleaserPassesThrough) {
  ClearFaultRules();
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=micro_batch;oom@step=1,site=micro_batch").ok());
  GuardOptions o;
  o.initial_micro_batch = 8;
  auto g = NewGuard(o);
  int after = 0;
  bool interrupt = false;
  g->AddCacheReleaser("std", [] { throw std::runtime_error("logged, not fatal"); });
  g->AddCacheReleaser("host", [&] {
    if (interrupt) throw Interrupt{};
  });
  g->AddCacheReleaser("after", [&] { ++after; });
  EXPECT_TRUE(g->Step(Plain(8)).ok());
  EXPECT_EQ(after, 1);
  interrupt = true;
  EXPECT_THROW((void)g->Step(Plain(8)), Interrupt);
  EXPECT_EQ(after, 1) << "releasers after the interrupted one still ran";
  EXPECT_EQ(g->step(), 1);
  ClearFaultRules();
}

}  // namespace
}  // namespace oomguard
