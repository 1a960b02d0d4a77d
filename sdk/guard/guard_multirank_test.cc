// The multi-rank protocol of the guard, with ranks as threads (ThreadGroup).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "oomguard/coordinator.h"
#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/recovery.h"

namespace oomguard {
namespace {

class FakeRecovery : public RecoveryStore {
 public:
  std::atomic<int64_t> durable{-1}, snapshot{-1};
  std::atomic<int> restores{0};
  std::atomic<int64_t> restored_step{-100};
  std::atomic<int64_t> committed_durable{-1};
  std::atomic<int> commits_after_recovery{0};
  int64_t DurableStep() override { return durable; }
  int64_t SnapshotStep() override { return snapshot; }
  StatusOr<int64_t> Restore(int64_t step) override {
    ++restores;
    restored_step = step;
    return step;
  }
  Status OnStepCommitted(int64_t step, bool after) override {
    durable = step;
    snapshot = step;
    if (after) ++commits_after_recovery;
    return Status::Ok();
  }
  Status CommitDurable(int64_t step, int) override {
    committed_durable = step;
    return Status::Ok();
  }
};

struct Rank {
  std::unique_ptr<Coordinator> coord;
  std::unique_ptr<Guard> guard;
  FakeRecovery recovery;
  int commits = 0;
  int resets = 0;
  int64_t samples_kept = 0;
  std::vector<Status> statuses;
  std::vector<StepReport> reports;
};

class MultiRank : public ::testing::Test {
 protected:
  void TearDown() override { ClearFaultRules(); }

  void Make(int n, GuardOptions base = {}) {
    auto group = MakeThreadGroup(n).value();
    ranks_.clear();
    for (int r = 0; r < n; ++r) {
      auto rk = std::make_unique<Rank>();
      rk->coord = std::move(group[r]);
      GuardOptions o = base;
      o.coordinator = rk->coord.get();
      o.recovery = &rk->recovery;
      if (o.initial_micro_batch == 0) o.initial_micro_batch = 16;
      rk->guard = Guard::Create(o).value();
      ranks_.push_back(std::move(rk));
    }
  }

  // Each rank runs `steps` Step calls of 32 samples on its own thread.
  void Run(int steps) {
    std::vector<std::thread> threads;
    for (auto& rp : ranks_) {
      Rank* rk = rp.get();
      threads.emplace_back([rk, steps] {
        for (int s = 0; s < steps; ++s) {
          StepRequest req;
          req.samples = 32;
          req.micro = [rk](const MicroBatch& mb) {
            rk->guard->MarkPhase(Phase::kForward);
            rk->guard->MarkPhase(Phase::kBackward);
            rk->samples_kept += mb.size;
          };
          req.reset = [rk] {
            rk->samples_kept = 0;
            rk->resets++;
          };
          req.commit = [rk] {
            rk->guard->MarkPhase(Phase::kOptimizer);
            rk->commits++;
            rk->samples_kept = 0;
          };
          StepReport rep;
          rk->statuses.push_back(rk->guard->Step(req, &rep));
          rk->reports.push_back(rep);
        }
      });
    }
    for (auto& t : threads) t.join();
  }

  std::vector<std::unique_ptr<Rank>> ranks_;
};

TEST_F(MultiRank, OomOnOneRankOnlyEveryRankCommitsOnce) {
  for (const char* site : {"forward", "backward"}) {
    ASSERT_TRUE(SetFaultRules(std::string("oom@step=0,rank=1,site=") + site).ok());
    Make(4);
    Run(1);
    for (int r = 0; r < 4; ++r) {
      EXPECT_TRUE(ranks_[r]->statuses[0].ok()) << site << " rank " << r << ": " << ranks_[r]->statuses[0];
      EXPECT_EQ(ranks_[r]->commits, 1) << site;
      EXPECT_EQ(ranks_[r]->guard->step(), 1);
    }
    EXPECT_EQ(ranks_[1]->reports[0].ooms, 1);
    EXPECT_EQ(ranks_[1]->guard->micro_limit(), 8) << "each rank learns its own size";
    EXPECT_EQ(ranks_[0]->guard->micro_limit(), 16);
    // Incidents carry every rank's memory, gathered because some rank had an OOM.
    ASSERT_EQ(ranks_[1]->reports[0].incidents.size(), 1u);
    EXPECT_EQ(ranks_[1]->reports[0].incidents[0].ranks.size(), 4u);
    EXPECT_EQ(ranks_[1]->reports[0].incidents[0].world_size, 4);
    EXPECT_EQ(ranks_[1]->reports[0].incidents[0].rank, 1);
    // Every rank snapshots after a step with an OOM anywhere (agreed by the vote).
    for (int r = 0; r < 4; ++r) EXPECT_EQ(ranks_[r]->recovery.commits_after_recovery, 1);
  }
}

TEST_F(MultiRank, UniformMicroBatchMakesEveryRankUseTheMinimum) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,rank=2,site=forward").ok());
  GuardOptions o;
  o.uniform_micro_batch = true;
  Make(3, o);
  Run(2);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ranks_[r]->guard->micro_limit(), 8) << "rank " << r;
    EXPECT_EQ(ranks_[r]->reports[1].largest_micro, 8) << "rank " << r;
  }
}

TEST_F(MultiRank, OomOnEveryRank) {
  ASSERT_TRUE(SetFaultRules("oom@step=1,rank=0,site=backward;oom@step=1,rank=1,site=backward;"
                            "oom@step=1,rank=2,site=backward;oom@step=1,rank=3,site=backward")
                  .ok());
  Make(4);
  Run(3);
  for (int r = 0; r < 4; ++r) {
    for (const Status& s : ranks_[r]->statuses) EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(ranks_[r]->commits, 3);
    EXPECT_EQ(ranks_[r]->reports[1].ooms, 1);
  }
}

TEST_F(MultiRank, RankThatCannotRecoverStopsEveryRankWithoutCommit) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,rank=0,site=forward,times=0").ok());
  GuardOptions o;
  o.min_micro_batch = 8;
  Make(3, o);
  for (auto& rk : ranks_) rk->recovery.durable = -1;
  Run(1);
  EXPECT_EQ(ranks_[0]->statuses[0].code(), StatusCode::kResourceExhausted) << ranks_[0]->statuses[0];
  for (int r = 1; r < 3; ++r) EXPECT_EQ(ranks_[r]->statuses[0].code(), StatusCode::kResourceExhausted);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(ranks_[r]->commits, 0);
}

TEST_F(MultiRank, OomAtMinimumRollsEveryRankBackToTheSameStep) {
  ASSERT_TRUE(SetFaultRules("oom@step=3,rank=2,site=forward,times=0").ok());
  GuardOptions o;
  o.min_micro_batch = 8;
  Make(4, o);
  Run(4);  // steps 0..2 commit (durable = 2), step 3 rolls back
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(ranks_[r]->statuses[3].code(), StatusCode::kAborted) << "rank " << r << " " << ranks_[r]->statuses[3];
    ASSERT_TRUE(ranks_[r]->reports[3].rolled_back_to.has_value());
    EXPECT_EQ(*ranks_[r]->reports[3].rolled_back_to, 2);
    EXPECT_EQ(ranks_[r]->guard->step(), 3);
    EXPECT_EQ(ranks_[r]->commits, 3);
  }
  EXPECT_EQ(ranks_[0]->recovery.committed_durable, 2) << "rank 0 committed the durable steps";
}

TEST_F(MultiRank, OomInCommitOnOneRankRollsEveryRankBack) {
  ASSERT_TRUE(SetFaultRules("oom@step=2,rank=1,site=optimizer").ok());
  Make(3);
  Run(4);
  // Rank 1 restores its snapshot at once; the others learn of it in the next vote.
  EXPECT_EQ(ranks_[1]->statuses[2].code(), StatusCode::kAborted);
  EXPECT_EQ(*ranks_[1]->reports[2].rolled_back_to, 1);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ranks_[r]->statuses[3].code(), StatusCode::kAborted) << "rank " << r;
    EXPECT_EQ(*ranks_[r]->reports[3].rolled_back_to, 1) << "rank " << r;
    EXPECT_EQ(ranks_[r]->guard->step(), 2) << "every rank continues from the same step";
  }
}

TEST_F(MultiRank, BadRequestOnOneRankStopsEveryRankWithoutWaiting) {
  GuardOptions o;
  o.vote_deadline_ms = 30000;
  Make(3, o);
  std::vector<std::thread> threads;
  std::vector<Status> got(3);
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      StepRequest req;
      req.samples = r == 1 ? 0 : 8;  // rank 1's request is invalid
      req.micro = [](const MicroBatch&) {};
      req.commit = [] {};
      got[r] = ranks_[r]->guard->Step(req);
    });
  }
  for (auto& t : threads) t.join();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, 5.0) << "nobody waits for the 30 s deadline";
  EXPECT_EQ(got[1].code(), StatusCode::kInvalidArgument) << got[1];
  EXPECT_EQ(got[0].code(), StatusCode::kResourceExhausted) << got[0];
  EXPECT_EQ(got[2].code(), StatusCode::kResourceExhausted) << got[2];
}

TEST_F(MultiRank, SilentRankTurnsIntoUnavailableWithAnIncident) {
  GuardOptions o;
  o.vote_deadline_ms = 200;
  Make(3, o);
  std::vector<std::thread> threads;
  std::vector<Status> got(3);
  std::vector<StepReport> reps(3);
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      StepRequest req;
      req.samples = 8;
      req.micro = [](const MicroBatch&) {};
      got[r] = ranks_[r]->guard->Step(req, &reps[r]);
    });
  }
  for (auto& t : threads) t.join();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, 2.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), StatusCode::kUnavailable) << got[r];
    ASSERT_EQ(reps[r].incidents.size(), 1u);
    EXPECT_EQ(reps[r].incidents[0].kind, "coordination");
    EXPECT_EQ(reps[r].incidents[0].outcome, "failed");
  }
}

}  // namespace
}  // namespace oomguard
