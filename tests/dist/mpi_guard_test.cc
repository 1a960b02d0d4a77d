// The MPI coordinator and the guard's protocol across real processes.
// Run under: mpirun --allow-run-as-root --oversubscribe -np 4 mpi_guard_test
// Every rank runs the same tests in the same order (collectives must match).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/mpi_coordinator.h"
#include "oomguard/recovery.h"
#include "sdk/guard/guard_testing.h"
#include "sdk/guard/step_protocol.h"

namespace oomguard {
namespace {

using std::chrono::milliseconds;
Coordinator* g_coord = nullptr;

TEST(MpiCoordinator, AllgatherAndScaledSums) {
  Coordinator& c = *g_coord;
  ASSERT_GE(c.size(), 2) << "run under mpirun -np 4";
  const size_t n = static_cast<size_t>(c.size());
  for (int round = 0; round < 50; ++round) {
    std::vector<int64_t> mine = {c.rank(), round, -c.rank() * round};
    std::vector<int64_t> all(3 * n);
    Status s = c.Allgather(mine, all, milliseconds(10000));
    ASSERT_TRUE(s.ok()) << s;
    for (size_t r = 0; r < n; ++r) {
      EXPECT_EQ(all[3 * r], static_cast<int64_t>(r));
      EXPECT_EQ(all[3 * r + 1], round);
    }
  }
  std::vector<double> d = {1.0, static_cast<double>(c.rank())};
  std::vector<float> f = {2.0f};
  SumBuffer bd = SumBuffer::Host(d.data(), 2);
  bd.scale = 0.5;
  std::vector<SumBuffer> bufs = {bd, SumBuffer::Host(f.data(), 1)};
  ASSERT_TRUE(c.AllreduceSum(bufs, milliseconds(10000)).ok());
  EXPECT_DOUBLE_EQ(d[0], 0.5 * c.size());
  EXPECT_DOUBLE_EQ(d[1], 0.5 * c.size() * (c.size() - 1) / 2.0);
  EXPECT_FLOAT_EQ(f[0], 2.0f * c.size());
  std::vector<int64_t> wrong(1);
  EXPECT_EQ(c.Allgather(std::vector<int64_t>{1}, wrong, milliseconds(100)).code(), StatusCode::kInvalidArgument);
}

using testing::RecordingRecovery;

struct Outcome {
  std::vector<Status> statuses;
  std::vector<StepReport> reports;
  int applies = 0;
  double synced = 0;
  std::string thrown;
  std::vector<int64_t> restored;  // the steps this rank's store restored
};

// Each rank's gradient is 1 + rank per sample; the synced mean is (n+1)/2.
Outcome RunSteps(const std::string& rules, int steps, GuardOptions o = {}, bool with_recovery = true) {
  EXPECT_TRUE(SetFaultRules(rules).ok()) << rules;
  RecordingRecovery rec;
  o.coordinator = g_coord;
  if (with_recovery) o.recovery = &rec;
  o.initial_micro_batch = 16;
  o.vote_deadline_ms = 20000;
  auto guard = Guard::Create(o).value();
  Outcome out;
  double grad = 0;
  for (int s = 0; s < steps; ++s) {
    StepRequest req;
    req.samples = 32;
    req.micro = [&](const MicroBatch& mb) {
      guard->MarkPhase(Phase::kForward);
      guard->MarkPhase(Phase::kBackward);
      grad += mb.weight * (1.0 + g_coord->rank());
    };
    req.reset = [&] { grad = 0; };
    req.sync = [&] { return std::vector<SumBuffer>{SumBuffer::Host(&grad, 1)}; };
    req.apply = [&] {
      guard->MarkPhase(Phase::kOptimizer);
      ++out.applies;
      out.synced = grad;
      grad = 0;
    };
    StepReport rep;
    try {
      out.statuses.push_back(guard->Step(req, &rep));
    } catch (const std::exception& e) {
      out.thrown = e.what();
      out.statuses.push_back(Status(StatusCode::kUnknown, e.what()));
    }
    out.reports.push_back(rep);
    if (!out.statuses.back().ok() && out.statuses.back().code() != StatusCode::kAborted) break;
  }
  ClearFaultRules();
  out.restored = rec.restored;
  return out;
}

TEST(MpiGuard, OomOnOneRankInForwardAndBackward) {
  for (const char* site : {"forward", "backward"}) {
    Outcome o = RunSteps(std::string("oom@step=1,rank=1,site=") + site, 3);
    for (const Status& s : o.statuses) EXPECT_TRUE(s.ok()) << site << ": " << s;
    EXPECT_EQ(o.applies, 3);
    EXPECT_DOUBLE_EQ(o.synced, (g_coord->size() + 1) / 2.0);
    if (g_coord->rank() == 1) {
      ASSERT_EQ(o.reports[1].incidents.size(), 1u);
      EXPECT_EQ(static_cast<int>(o.reports[1].incidents[0].ranks.size()), g_coord->size());
    }
  }
}

TEST(MpiGuard, OomAtCommitOrSyncOnOneRankRedoesTheStepEverywhere) {
  for (const char* site : {"commit", "sync"}) {
    Outcome o = RunSteps(std::string("oom@step=1,rank=3,site=") + site, 3);
    for (const Status& s : o.statuses) EXPECT_TRUE(s.ok()) << site << ": " << s;
    EXPECT_EQ(o.applies, 3);
    EXPECT_EQ(o.reports[1].redone, 1);
    EXPECT_DOUBLE_EQ(o.synced, (g_coord->size() + 1) / 2.0);
  }
}

TEST(MpiGuard, OomOnEveryRank) {
  Outcome o = RunSteps("oom@step=0,site=backward", 2);  // each process has its own rule counter
  for (const Status& s : o.statuses) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(o.reports[0].ooms, 1);
  EXPECT_EQ(o.applies, 2);
}

// Issue 30: an OOM on rank 1 leaves every other rank's micro-batch where it
// was (each rank learns its own size unless uniform_micro_batch), and an
// injected OOM teaches rank 1 nothing: it grows back.
TEST(MpiGuard, AnOomOnOneRankLeavesTheOtherRanksSize) {
  GuardOptions opt;
  opt.grow_after = 2;
  Outcome o = RunSteps("oom@step=1,rank=1,site=forward", 8, opt);
  ASSERT_EQ(o.statuses.size(), 8u);
  for (const Status& s : o.statuses) EXPECT_TRUE(s.ok()) << s;
  for (size_t s = 0; s < o.reports.size(); ++s)
    if (g_coord->rank() != 1) EXPECT_GE(o.reports[s].limit_after, 16) << "rank " << g_coord->rank() << " step " << s;
  if (g_coord->rank() == 1) EXPECT_EQ(o.reports[1].limit_after, 8);
  EXPECT_GE(o.reports.back().limit_after, 16) << "rank " << g_coord->rank() << " grows back to (or past) its size";
}

// Issue 30: the ranks of one job record one run: each guard takes the job id
// the MPI coordinator agreed on when it was made.
TEST(MpiGuard, EveryRankNamesItsRunAfterTheJob) {
  GuardOptions o;
  o.coordinator = g_coord;
  auto guard = Guard::Create(o).value();
  const std::string id = guard->run_id();
  EXPECT_EQ(id.size(), 16u) << id;
  EXPECT_EQ(id, g_coord->job_id());
  int64_t mine = static_cast<int64_t>(std::strtoull(id.c_str(), nullptr, 16));
  std::vector<int64_t> all(static_cast<size_t>(g_coord->size()));
  ASSERT_TRUE(g_coord->Allgather({&mine, 1}, all, milliseconds(10000)).ok());
  for (size_t r = 0; r < all.size(); ++r) EXPECT_EQ(all[r], mine) << "rank " << r << "'s run id";
}

TEST(MpiGuard, OomInApplyOnOneRankRollsEveryRankBackInThatStep) {
  for (int step : {2, 3}) {  // 3 is the last step: nothing after it would carry the rollback
    Outcome o = RunSteps("oom@step=" + std::to_string(step) + ",rank=3,site=optimizer", 4);
    ASSERT_EQ(o.statuses.size(), 4u);
    EXPECT_EQ(o.statuses[static_cast<size_t>(step)].code(), StatusCode::kAborted) << o.statuses[step];
    ASSERT_TRUE(o.reports[static_cast<size_t>(step)].rolled_back_to.has_value());
    EXPECT_EQ(*o.reports[static_cast<size_t>(step)].rolled_back_to, step - 1);
    EXPECT_EQ(o.restored, std::vector<int64_t>{step - 1}) << "this rank's store restored step " << step - 1;
  }
}

TEST(MpiGuard, UnrecoverableRankStopsEveryoneNamingIt) {
  GuardOptions opt;
  opt.min_micro_batch = 16;
  const auto t0 = std::chrono::steady_clock::now();
  Outcome o = RunSteps("oom@step=0,rank=0,site=forward,times=0", 1, opt, /*with_recovery=*/false);
  EXPECT_EQ(o.statuses[0].code(), StatusCode::kResourceExhausted) << o.statuses[0];
  if (g_coord->rank() != 0) {
    EXPECT_NE(o.statuses[0].message().find("rank 0 stopped at step 0"), std::string::npos) << o.statuses[0];
  }
  EXPECT_EQ(o.applies, 0);
  // A non-OOM error: rethrown on its rank after the vote, named on the others.
  Outcome e = RunSteps("error@step=1,rank=2,site=backward", 3);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 10.0) << "nobody waits for the 20 s deadline";
  if (g_coord->rank() == 2) {
    EXPECT_NE(e.thrown.find("injected error"), std::string::npos) << e.thrown;
  } else {
    ASSERT_EQ(e.statuses.size(), 2u);
    EXPECT_EQ(e.statuses[1].code(), StatusCode::kCancelled) << e.statuses[1];
    EXPECT_NE(e.statuses[1].message().find("rank 2 stopped at step 1"), std::string::npos) << e.statuses[1];
  }
}

TEST(MpiGuard, RepeatedRollbacksStopEveryRankWithTheSameError) {
  GuardOptions opt;
  opt.min_micro_batch = 16;
  Outcome o = RunSteps("oom@step=2,rank=1,site=forward,times=0", 30, opt);
  const Status& last = o.statuses.back();
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted) << last;
  EXPECT_NE(last.message().find("times in a row"), std::string::npos) << last;
  EXPECT_LT(o.statuses.size(), 30u);
}

// Issue 10: the guard's collectives carry their kind and sequence number. A
// rank that ran one collective more than the others is found out at the next
// one, on every rank, instead of its vote being read as another collective.
TEST(MpiGuard, DivergedCollectiveSequenceIsDetected) {
  auto fresh = MakeMpiCoordinator();  // its own communicator: this test breaks it
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  Coordinator& c = **fresh;
  GuardOptions o;
  o.coordinator = &c;
  o.vote_deadline_ms = 3000;
  auto guard = Guard::Create(o).value();
  if (c.rank() == 1) {
    // An allgather of the vote's size where the others vote.
    std::vector<int64_t> mine(internal::kVoteWords + 1, 7), all(mine.size() * static_cast<size_t>(c.size()));
    (void)c.Allgather(mine, all, milliseconds(3000));
  }
  StepRequest req;
  req.samples = 4;
  req.micro = [](const MicroBatch&) {};
  Status s = guard->Step(req);
  EXPECT_FALSE(s.ok());
  if (c.rank() != 1) EXPECT_NE(s.message().find("collective sequence diverged"), std::string::npos) << s;
}

// Issue 10: MPI errors come back as statuses. Mismatched collectives make
// Open MPI report MPI_ERR_TRUNCATE from MPI_Test, which it raises on
// MPI_COMM_WORLD's handler (fatal by default); every rank must instead get an
// error (or the deadline) and carry on.
TEST(MpiCoordinator, MpiErrorsReturnInsteadOfAbortingTheJob) {
  auto fresh = MakeMpiCoordinator();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  Coordinator& c = **fresh;
  const size_t n = c.rank() == 0 ? 2 : 3;
  std::vector<int64_t> mine(n, c.rank()), all(n * static_cast<size_t>(c.size()));
  Status s = c.Allgather(mine, all, milliseconds(2000));
  // Rank 0's receive buffer is too small for the others' records: it gets
  // MPI_ERR_TRUNCATE as a status (the others' larger buffers may just fill).
  if (c.rank() == 0) EXPECT_FALSE(s.ok());
  // Still alive: the world communicator works for the test harness itself.
  EXPECT_EQ(g_coord->size(), c.size());
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
  // Only rank 0 prints gtest's report (OOMGUARD_TEST_ALL_RANKS_PRINT=1: every
  // rank); every rank's failures still fail the run.
  if ((*c)->rank() != 0 && std::getenv("OOMGUARD_TEST_ALL_RANKS_PRINT") == nullptr) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  return rc;
}
