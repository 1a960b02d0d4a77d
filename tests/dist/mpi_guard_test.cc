// The MPI coordinator and the guard's protocol across real processes.
// Run under: mpirun --allow-run-as-root --oversubscribe -np 4 mpi_guard_test
// Every rank runs the same tests in the same order (collectives must match).
#include <gtest/gtest.h>

#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/mpi_coordinator.h"
#include "oomguard/recovery.h"

namespace oomguard {
namespace {

using std::chrono::milliseconds;
Coordinator* g_coord = nullptr;

TEST(MpiCoordinator, VoteGatherBroadcastAllreduce) {
  Coordinator& c = *g_coord;
  ASSERT_GE(c.size(), 2) << "run under mpirun -np 4";
  for (int round = 0; round < 50; ++round) {
    VoteInput in;
    in.status = c.rank() == round % c.size() && round % 3 == 0 ? VoteStatus::kRollback : VoteStatus::kOk;
    in.durable_step = round - c.rank();
    in.snapshot_step = round;
    in.micro_limit = 64 + c.rank();
    in.had_oom = c.rank() == 1 && round % 2 == 0;
    auto r = c.Vote(in, milliseconds(10000));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status, round % 3 == 0 ? VoteStatus::kRollback : VoteStatus::kOk);
    EXPECT_EQ(r->min_durable_step, round - (c.size() - 1));
    EXPECT_EQ(r->min_micro_limit, 64);
    EXPECT_EQ(r->any_oom, round % 2 == 0);
  }
  auto mem = c.GatherMemory(RankMemory{c.rank(), 10 * c.rank(), 20 * c.rank(), 30 * c.rank()}, milliseconds(10000));
  ASSERT_TRUE(mem.ok());
  ASSERT_EQ(static_cast<int>(mem->size()), c.size());
  for (int r = 0; r < c.size(); ++r) EXPECT_EQ((*mem)[r].reserved, 20 * r);
  std::vector<uint8_t> data;
  if (c.rank() == 2) data = {9, 8, 7, 6};
  ASSERT_TRUE(c.Broadcast(&data, 2, milliseconds(10000)).ok());
  EXPECT_EQ(data, (std::vector<uint8_t>{9, 8, 7, 6}));
  std::vector<double> v = {1.0, static_cast<double>(c.rank())};
  ASSERT_TRUE(c.AllreduceSum(v, milliseconds(10000)).ok());
  EXPECT_DOUBLE_EQ(v[0], c.size());
  EXPECT_DOUBLE_EQ(v[1], c.size() * (c.size() - 1) / 2.0);
  EXPECT_TRUE(c.Barrier(milliseconds(10000)).ok());
}

class Recovery : public RecoveryStore {
 public:
  int64_t durable = -1;
  int64_t DurableStep() override { return durable; }
  int64_t SnapshotStep() override { return durable; }
  StatusOr<int64_t> Restore(int64_t step) override { return step; }
  Status OnStepCommitted(int64_t step, bool) override {
    durable = step;
    return Status::Ok();
  }
};

struct Outcome {
  std::vector<Status> statuses;
  std::vector<StepReport> reports;
  int commits = 0;
};

Outcome RunSteps(const std::string& rules, int steps, GuardOptions o = {}) {
  EXPECT_TRUE(SetFaultRules(rules).ok()) << rules;
  Recovery rec;
  o.coordinator = g_coord;
  o.recovery = &rec;
  o.initial_micro_batch = 16;
  o.vote_deadline_ms = 20000;
  auto guard = Guard::Create(o).value();
  Outcome out;
  for (int s = 0; s < steps; ++s) {
    StepRequest req;
    req.samples = 32;
    req.micro = [&](const MicroBatch&) {
      guard->MarkPhase(Phase::kForward);
      guard->MarkPhase(Phase::kBackward);
    };
    req.reset = [] {};
    req.commit = [&] {
      guard->MarkPhase(Phase::kOptimizer);
      ++out.commits;
    };
    StepReport rep;
    out.statuses.push_back(guard->Step(req, &rep));
    out.reports.push_back(rep);
  }
  ClearFaultRules();
  return out;
}

TEST(MpiGuard, OomOnOneRankInForwardAndBackward) {
  for (const char* site : {"forward", "backward"}) {
    Outcome o = RunSteps(std::string("oom@step=1,rank=1,site=") + site, 3);
    for (const Status& s : o.statuses) EXPECT_TRUE(s.ok()) << site << ": " << s;
    EXPECT_EQ(o.commits, 3);
    if (g_coord->rank() == 1) {
      ASSERT_EQ(o.reports[1].incidents.size(), 1u);
      EXPECT_EQ(static_cast<int>(o.reports[1].incidents[0].ranks.size()), g_coord->size());
    }
  }
}

TEST(MpiGuard, OomOnEveryRank) {
  Outcome o = RunSteps("oom@step=0,site=backward", 2);  // each process has its own rule counter
  for (const Status& s : o.statuses) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(o.reports[0].ooms, 1);
  EXPECT_EQ(o.commits, 2);
}

TEST(MpiGuard, OomInCommitOnOneRankRollsEveryRankBack) {
  Outcome o = RunSteps("oom@step=2,rank=3,site=optimizer", 4);
  ASSERT_EQ(o.statuses.size(), 4u);
  EXPECT_TRUE(o.statuses[1].ok());
  EXPECT_EQ(o.statuses[3].code(), StatusCode::kAborted) << o.statuses[3];
  ASSERT_TRUE(o.reports[3].rolled_back_to.has_value());
  EXPECT_EQ(*o.reports[3].rolled_back_to, 1);
}

TEST(MpiGuard, UnrecoverableRankStopsEveryone) {
  GuardOptions opt;
  opt.min_micro_batch = 16;
  Outcome o = RunSteps("oom@step=0,rank=0,site=forward,times=0", 1, opt);
  // Rank 0 cannot split further and has nothing to roll back to; the others
  // stop with it instead of committing alone.
  EXPECT_EQ(o.statuses[0].code(), StatusCode::kResourceExhausted) << o.statuses[0];
  if (g_coord->rank() != 0) {
    EXPECT_NE(o.statuses[0].message().find("another rank"), std::string::npos) << o.statuses[0];
  }
  EXPECT_EQ(o.commits, 0);
}

}  // namespace
}  // namespace oomguard

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto c = oomguard::MakeMpiCoordinator();
  if (!c.ok()) {
    std::fprintf(stderr, "MPI: %s\n", c.status().ToString().c_str());
    return 1;
  }
  oomguard::g_coord = c->get();
  // Only rank 0 prints gtest's report; every rank's failures still fail the run.
  if ((*c)->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  return rc;
}
