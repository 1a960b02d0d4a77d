// Guard::Step on one rank: the ladder (release, halve, rollback, give up),
// phases, the reset hook, user exceptions, the plan and the limit, against
// a recording RecoveryStore and IncidentSink. Over 500 lines: one fixture
// and its helpers serve every case, and splitting them would copy both.
#include "oomguard/guard.h"

#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "oomguard/device.h"
#include "oomguard/faults.h"
#include "oomguard/priors.h"
#include "oomguard/recovery.h"
#include "sdk/guard/guard_testing.h"

namespace oomguard {
namespace {

using testing::FaultsCleared;
using testing::MakeGuard;
using testing::RecordingRecovery;
using testing::RecordingSink;

// Counts how often each sample's contribution was kept (applied and not reset).
struct Accumulator {
  std::map<int64_t, int> kept;
  std::map<int64_t, int> pending;  // applied in the current attempt
  double weight_sum = 0;
  int resets = 0;
  int commits = 0;
};

// A store that holds only what a test gives it: no snapshot of its own, no
// save after a step.
RecordingRecovery StaticRecovery() {
  RecordingRecovery rec;
  rec.can_snapshot = false;
  rec.save_on_commit = false;
  return rec;
}

// A request whose micro-batches mark phases and accumulate per-sample counts.
StepRequest Request(Guard* g, Accumulator* acc, int64_t n) {
  StepRequest r;
  r.samples = n;
  r.micro = [g, acc](const MicroBatch& mb) {
    g->MarkPhase(Phase::kForward);
    g->MarkPhase(Phase::kBackward);
    for (int64_t i = mb.offset; i < mb.offset + mb.size; ++i) acc->kept[i]++;
    acc->weight_sum += mb.weight;
  };
  r.reset = [acc] {
    acc->kept.clear();
    acc->weight_sum = 0;
    acc->resets++;
  };
  r.apply = [acc] { acc->commits++; };
  return r;
}

void ExpectEachSampleOnce(const Accumulator& acc, int64_t n) {
  ASSERT_EQ(static_cast<int64_t>(acc.kept.size()), n);
  for (auto& [i, c] : acc.kept) EXPECT_EQ(c, 1) << "sample " << i;
  EXPECT_NEAR(acc.weight_sum, 1.0, 1e-12);
}

TEST_F(FaultsCleared, CleanStepRunsOnceAndCommits) {
  GuardOptions o;
  o.initial_micro_batch = 16;
  auto g = MakeGuard(o);
  Accumulator acc;
  StepReport rep;
  ASSERT_TRUE(g->Step(Request(g.get(), &acc, 64), &rep).ok());
  ExpectEachSampleOnce(acc, 64);
  EXPECT_EQ(acc.commits, 1);
  EXPECT_EQ(rep.micro_batches, 4);
  EXPECT_EQ(rep.ooms, 0);
  EXPECT_EQ(rep.step, 0);
  EXPECT_EQ(g->step(), 1);
}

TEST_F(FaultsCleared, OomInBackwardResetsAndRedoesTheStep) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=backward,micro=1").ok());
  GuardOptions o;
  o.initial_micro_batch = 32;
  RecordingSink sink;
  o.incidents = &sink;
  auto g = MakeGuard(o);
  Accumulator acc;
  StepReport rep;
  ASSERT_TRUE(g->Step(Request(g.get(), &acc, 64), &rep).ok());
  ExpectEachSampleOnce(acc, 64);
  EXPECT_EQ(acc.resets, 1);
  EXPECT_EQ(acc.commits, 1);
  EXPECT_EQ(rep.ooms, 1);
  EXPECT_EQ(rep.limit_after, 16);
  EXPECT_EQ(rep.micro_batches, 4);
  ASSERT_EQ(rep.incidents.size(), 1u);
  const Incident& inc = rep.incidents[0];
  EXPECT_EQ(inc.phase, Phase::kBackward);
  EXPECT_EQ(inc.kind, IncidentKind::kDevice);
  EXPECT_EQ(inc.action, LadderAction::kHalve);
  EXPECT_EQ(inc.outcome, IncidentOutcome::kRecovered);
  EXPECT_EQ(inc.micro_before, 32);
  EXPECT_EQ(inc.micro_after, 16);
  EXPECT_TRUE(inc.injected);
  EXPECT_EQ(inc.id.size(), 16u);
  ASSERT_EQ(sink.recorded.size(), 1u);
  EXPECT_EQ(sink.recorded[0].outcome, IncidentOutcome::kPending);
  ASSERT_EQ(sink.updated.size(), 1u);
  EXPECT_EQ(sink.updated[0].outcome, IncidentOutcome::kRecovered);
  EXPECT_EQ(sink.updated[0].id, inc.id);
}

TEST_F(FaultsCleared, OomInForwardKeepsCompletedMicroBatches) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=forward,micro=2").ok());
  GuardOptions o;
  o.initial_micro_batch = 16;
  auto g = MakeGuard(o);
  Accumulator acc;
  int calls = 0;
  StepRequest r = Request(g.get(), &acc, 64);
  auto inner = r.micro;
  r.micro = [&](const MicroBatch& mb) {
    ++calls;
    inner(mb);
  };
  StepReport rep;
  ASSERT_TRUE(g->Step(r, &rep).ok());
  ExpectEachSampleOnce(acc, 64);
  EXPECT_EQ(acc.resets, 0) << "an OOM in forward must not discard finished work";
  // 2 done at 16, 1 failed, then [32, 64) re-planned at 8: 4 more.
  EXPECT_EQ(calls, 2 + 1 + 4);
  EXPECT_EQ(rep.micro_batches, 6);
}

TEST_F(FaultsCleared, BackwardOomWithoutResetHookIsAPreconditionError) {
  // A step without apply or sync on one rank may leave out the hook; an OOM
  // in backward then cannot be redone.
  ASSERT_TRUE(SetFaultRules("oom@site=backward").ok());
  auto g = MakeGuard(GuardOptions{});
  Accumulator acc;
  StepRequest r = Request(g.get(), &acc, 8);
  r.reset = nullptr;
  r.apply = nullptr;
  Status s = g->Step(r);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("reset hook"), std::string::npos);
  EXPECT_EQ(acc.commits, 0);
}

TEST_F(FaultsCleared, TrainingStepWithoutResetHookIsRefusedOnEntry) {
  // No OOM happens: the missing hook is found before any micro-batch runs,
  // not at the first OOM in backward.
  auto g = MakeGuard(GuardOptions{});
  Accumulator acc;
  StepRequest r = Request(g.get(), &acc, 8);
  r.reset = nullptr;
  Status s = g->Step(r);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("StepRequest.reset must be set"), std::string::npos) << s;
  EXPECT_EQ(acc.commits, 0);
  EXPECT_TRUE(acc.kept.empty()) << "no micro-batch ran";
  EXPECT_EQ(g->step(), 0);
  r.reset = [&acc] { acc.kept.clear(); };
  EXPECT_TRUE(g->Step(r).ok()) << "the same request with a hook runs";
  StepRequest sync_only = Request(g.get(), &acc, 8);
  sync_only.reset = nullptr;
  sync_only.apply = nullptr;
  double grad = 0;
  sync_only.sync = [&grad] { return std::vector<SumBuffer>{SumBuffer::Host(&grad, 1)}; };
  EXPECT_EQ(g->Step(sync_only).code(), StatusCode::kFailedPrecondition) << "sync alone also accumulates";
}

TEST_F(FaultsCleared, OomAtMinimumGivesUpNamingTheIncident) {
  ASSERT_TRUE(SetFaultRules("oom@site=forward,times=0").ok());
  GuardOptions o;
  o.initial_micro_batch = 8;
  o.min_micro_batch = 2;
  auto g = MakeGuard(o);
  Accumulator acc;
  StepReport rep;
  Status s = g->Step(Request(g.get(), &acc, 8), &rep);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  ASSERT_FALSE(rep.incidents.empty());
  EXPECT_NE(s.message().find(rep.incidents.back().id), std::string::npos);
  EXPECT_NE(s.message().find("remedies"), std::string::npos);
  EXPECT_EQ(rep.incidents.back().action, LadderAction::kGiveUp);
  EXPECT_EQ(rep.incidents.back().outcome, IncidentOutcome::kFailed);
  EXPECT_EQ(rep.ooms, 3);  // 8 -> 4 -> 2 -> give up
  EXPECT_EQ(acc.commits, 0);
  EXPECT_EQ(g->step(), 0) << "a failed step does not advance";
}

TEST_F(FaultsCleared, OomAtMinimumRollsBackWithARecoveryStore) {
  ASSERT_TRUE(SetFaultRules("oom@step=5,site=forward,times=0").ok());
  GuardOptions o;
  o.initial_micro_batch = 4;
  RecordingRecovery rec = StaticRecovery();
  rec.durable = {3};
  o.recovery = &rec;
  auto g = MakeGuard(o);
  ASSERT_TRUE(g->SetStep(5).ok());
  Accumulator acc;
  StepReport rep;
  Status s = g->Step(Request(g.get(), &acc, 4), &rep);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  ASSERT_TRUE(rep.rolled_back_to.has_value());
  EXPECT_EQ(*rep.rolled_back_to, 3);
  EXPECT_EQ(g->step(), 4);
  EXPECT_EQ(rec.restores(), 1);
  EXPECT_EQ(rec.restored, std::vector<int64_t>{3}) << "the store itself restored step 3";
  EXPECT_TRUE(rec.failed_restores.empty());
  EXPECT_EQ(rep.incidents.back().outcome, IncidentOutcome::kRolledBack);
  EXPECT_EQ(g->micro_limit(), 1) << "resume at the reduced size";
}

TEST_F(FaultsCleared, OomInCommitRollsBackFromSnapshotOrGivesUp) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=optimizer").ok());
  {
    auto g = MakeGuard(GuardOptions{});
    Accumulator acc;
    StepRequest r = Request(g.get(), &acc, 8);
    r.apply = [&] { g->MarkPhase(Phase::kOptimizer); };
    Status s = g->Step(r);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("optimizer apply"), std::string::npos) << s;
  }
  ASSERT_TRUE(SetFaultRules("oom@step=2,site=optimizer").ok());
  GuardOptions o;
  o.initial_micro_batch = 8;
  RecordingRecovery rec = StaticRecovery();
  rec.snapshot = 1;
  o.recovery = &rec;
  auto g = MakeGuard(o);
  ASSERT_TRUE(g->SetStep(2).ok());
  Accumulator acc;
  StepRequest r = Request(g.get(), &acc, 8);
  r.apply = [&] { g->MarkPhase(Phase::kOptimizer); };
  StepReport rep;
  Status s = g->Step(r, &rep);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
  EXPECT_EQ(rep.rolled_back_to, 1);
  EXPECT_EQ(rec.restored, std::vector<int64_t>{1}) << "the store itself restored the snapshot of step 1";
  EXPECT_TRUE(rec.steps_committed.empty()) << "the rolled-back step was not committed";
  EXPECT_EQ(g->step(), 2);
  EXPECT_EQ(g->micro_limit(), 8) << "the redo keeps the size: the apply's memory does not depend on the split";
  EXPECT_EQ(rep.incidents.at(0).phase, Phase::kOptimizer);
}

struct MyError : std::runtime_error {
  MyError() : std::runtime_error("user error, not memory") {}
};

TEST_F(FaultsCleared, NonOomExceptionPassesThroughUnchanged) {
  auto g = MakeGuard(GuardOptions{});
  StepRequest r;
  r.samples = 4;
  r.micro = [](const MicroBatch&) { throw MyError(); };
  EXPECT_THROW((void)g->Step(r), MyError);
  r.micro = [](const MicroBatch&) {};
  r.apply = [] { throw 42; };
  r.reset = [] {};
  EXPECT_THROW((void)g->Step(r), int);
}

TEST_F(FaultsCleared, CacheReleasersRunOnEveryOom) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=micro_batch,times=2").ok());
  GuardOptions o;
  o.initial_micro_batch = 64;
  auto g = MakeGuard(o);
  int released = 0;
  g->AddCacheReleaser("test", [&] { ++released; });
  g->AddCacheReleaser("throws", [] { throw std::runtime_error("ignored"); });
  Accumulator acc;
  StepReport rep;
  ASSERT_TRUE(g->Step(Request(g.get(), &acc, 64), &rep).ok());
  EXPECT_EQ(released, 2);
  EXPECT_EQ(rep.cache_releases, 2);
  EXPECT_EQ(rep.limit_after, 16);
  ExpectEachSampleOnce(acc, 64);
}

TEST_F(FaultsCleared, RetryBoundedPerStep) {
  ASSERT_TRUE(SetFaultRules("oom@site=micro_batch,times=0").ok());
  GuardOptions o;
  o.initial_micro_batch = 1 << 20;
  o.max_ooms_per_step = 5;
  auto g = MakeGuard(o);
  Accumulator acc;
  StepReport rep;
  Status s = g->Step(Request(g.get(), &acc, 1 << 20), &rep);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(rep.ooms, 6);
  EXPECT_NE(s.message().find("max_ooms_per_step"), std::string::npos);
}

TEST_F(FaultsCleared, RealOomsOnASimulatedDeviceConverge) {
  SimulatedDeviceOptions d;
  d.capacity_bytes = 8 << 20;
  auto dev = MakeSimulatedDevice(d).value();
  GuardOptions o;
  o.device = dev.get();
  o.grow_after = 2;
  auto g = MakeGuard(o);
  const int64_t per_sample = 64 << 10;  // 64 KiB of activations per sample: 128 samples fill 8 MiB
  int64_t last_largest = 0;
  for (int step = 0; step < 40; ++step) {
    Accumulator acc;
    StepRequest r = Request(g.get(), &acc, 1000);
    auto inner = r.micro;
    r.micro = [&](const MicroBatch& mb) {
      DeviceBuffer act(dev.get(), static_cast<size_t>(mb.size * per_sample));
      inner(mb);
    };
    StepReport rep;
    ASSERT_TRUE(g->Step(r, &rep).ok()) << "step " << step;
    ExpectEachSampleOnce(acc, 1000);
    last_largest = rep.largest_micro;
    if (rep.ooms > 0) {
      EXPECT_GT(rep.incidents[0].memory.total, 0);
      EXPECT_GT(rep.incidents[0].requested_bytes, 0);
      EXPECT_FALSE(rep.incidents[0].injected);
    }
  }
  EXPECT_GT(g->total_ooms(), 0);
  // The limit may exceed what fits when balanced plans never reach it; the
  // micro-batches actually run must fit, and be close to the largest that does.
  EXPECT_LE(last_largest, 128);
  EXPECT_GE(last_largest, 100) << "steady state near the largest size that fits";
  EXPECT_EQ(dev->Stats().allocated, 0);
}

TEST_F(FaultsCleared, CostsPlanByCostUnits) {
  GuardOptions o;
  o.initial_micro_batch = 100;  // cost units
  auto g = MakeGuard(o);
  std::vector<int64_t> costs = {10, 10, 90, 10, 10, 10, 200, 5};
  std::vector<int64_t> seen;
  StepRequest r;
  r.samples = static_cast<int64_t>(costs.size());
  r.costs = costs;
  r.micro = [&](const MicroBatch& mb) { seen.push_back(mb.cost); };
  ASSERT_TRUE(g->Step(r).ok());
  EXPECT_EQ(seen, (std::vector<int64_t>{20, 100, 20, 200, 5}));
  r.costs = std::span<const int64_t>(costs.data(), 3);
  EXPECT_EQ(g->Step(r).code(), StatusCode::kInvalidArgument);
}

TEST_F(FaultsCleared, BadRequestsAreInvalidArgument) {
  auto g = MakeGuard(GuardOptions{});
  StepRequest r;
  r.samples = 0;
  r.micro = [](const MicroBatch&) {};
  Status s = g->Step(r);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("samples"), std::string::npos);
  r.samples = 3;
  r.micro = nullptr;
  EXPECT_EQ(g->Step(r).code(), StatusCode::kInvalidArgument);
}

TEST_F(FaultsCleared, GrowsBackAfterCleanSteps) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=micro_batch").ok());
  GuardOptions o;
  o.initial_micro_batch = 64;
  o.grow_after = 3;
  o.forget_bad_after = 2;
  auto g = MakeGuard(o);
  Accumulator acc;
  ASSERT_TRUE(g->Step(Request(g.get(), &acc, 256)).ok());
  EXPECT_EQ(g->micro_limit(), 32);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(g->Step(Request(g.get(), &acc, 256)).ok());
  EXPECT_GT(g->micro_limit(), 32) << "the guard probes back up after grow_after clean steps";
}

TEST_F(FaultsCleared, InvalidOptionsAndFaultRulesAreRejected) {
  GuardOptions o;
  o.min_micro_batch = 0;
  auto g = Guard::Create(o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("min_micro_batch"), std::string::npos);
  o = GuardOptions{};
  o.grow_tolerance = 0;
  EXPECT_NE(Guard::Create(o).status().message().find("grow_tolerance"), std::string::npos);
  o = GuardOptions{};
  o.initial_micro_batch = 2;
  o.min_micro_batch = 4;
  EXPECT_NE(Guard::Create(o).status().message().find("initial_micro_batch"), std::string::npos);
}

// A device whose cache release frees memory: the guard retries once at the
// same size instead of halving ("the retry must see the memory").
class ReleasingDevice : public Device {
 public:
  std::string Name() const override { return "fake:0"; }
  MemoryStats Stats() const override {
    MemoryStats s;
    s.total = 100 << 20;
    s.free = released_ ? (50 << 20) : (1 << 20);
    s.reserved = s.total - s.free;
    return s;
  }
  void ReleaseCaches() override { released_ = true; }
  void ResetPeak() override {}
  void* Allocate(size_t) override { return nullptr; }
  void Free(void*) override {}
  bool released_ = false;
};

TEST_F(FaultsCleared, ReleaseThatFreesMemoryRetriesAtTheSameSize) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=forward,bytes=4096").ok());
  ReleasingDevice dev;
  GuardOptions o;
  o.initial_micro_batch = 32;
  o.device = &dev;
  auto g = MakeGuard(o);
  Accumulator acc;
  StepReport rep;
  ASSERT_TRUE(g->Step(Request(g.get(), &acc, 64), &rep).ok());
  ASSERT_EQ(rep.incidents.size(), 1u);
  EXPECT_EQ(rep.incidents[0].action, LadderAction::kRelease);
  EXPECT_EQ(rep.limit_after, 32);
  ExpectEachSampleOnce(acc, 64);
}

}  // namespace
}  // namespace oomguard

namespace oomguard {
namespace {

TEST_F(FaultsCleared, OversizedLoneSampleEscalatesInsteadOfRetrying) {
  GuardOptions o;
  o.initial_micro_batch = 100;  // cost units
  auto g = MakeGuard(o);
  std::vector<int64_t> costs = {10, 500, 10};
  StepRequest r;
  r.samples = 3;
  r.costs = costs;
  r.micro = [&](const MicroBatch& mb) {
    g->MarkPhase(Phase::kForward);
    if (mb.cost >= 500) throw DeviceOomError("too long", 1 << 20, {});
  };
  StepReport rep;
  Status s = g->Step(r, &rep);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(rep.ooms, 1) << "one sample cannot be split: no pointless retries";
  EXPECT_NE(s.message().find("one sample (cost 500)"), std::string::npos) << s;
}

TEST_F(FaultsCleared, InjectedOomAtTheVoteIsRecoveredBeforeVoting) {
  // The vote site is the end of this rank's own work: an OOM there (as in
  // allocating what the sync needs) goes through the ladder like any other.
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=vote").ok());
  GuardOptions o;
  o.initial_micro_batch = 8;
  auto g = MakeGuard(o);
  Accumulator acc;
  StepReport rep;
  Status s = g->Step(Request(g.get(), &acc, 8), &rep);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(rep.ooms, 1);
  EXPECT_EQ(acc.commits, 1);
  EXPECT_EQ(acc.resets, 1) << "the gradients were complete, so they were zeroed before the redo";
  EXPECT_TRUE(g->Step(Request(g.get(), &acc, 8)).ok()) << "the next step runs normally";
}

TEST_F(FaultsCleared, LearnedPriorSetsTheStartingSizeAndCleanStepsAreReported) {
  testing::RecordingPriors priors;
  priors.sizes["mlp-h64"] = 24;
  GuardOptions o;
  o.initial_micro_batch = 128;
  o.workload = "mlp-h64";
  o.priors = &priors;
  auto g = MakeGuard(o);
  EXPECT_EQ(priors.asked, std::vector<std::string>{"mlp-h64"});
  EXPECT_EQ(g->micro_limit(), 24);
  Accumulator acc;
  StepReport rep;
  ASSERT_TRUE(g->Step(Request(g.get(), &acc, 96), &rep).ok());
  ASSERT_EQ(priors.recorded.size(), 1u);
  EXPECT_EQ(priors.recorded[0].second, rep.largest_micro);
  // Without a workload signature, priors are neither read nor written.
  testing::RecordingPriors unused;
  o.workload = "";
  o.priors = &unused;
  auto g2 = MakeGuard(o);
  EXPECT_EQ(g2->micro_limit(), 128);
  ASSERT_TRUE(g2->Step(Request(g2.get(), &acc, 96)).ok());
  EXPECT_TRUE(unused.recorded.empty());
  EXPECT_TRUE(unused.asked.empty());
}

}  // namespace
}  // namespace oomguard
