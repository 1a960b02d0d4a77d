// The multi-rank step protocol of the guard, with ranks as threads
// (ThreadGroup) and a recovery store that records what it is asked. Over 500
// lines: the MultiRank fixture (threads, per-rank stores and reports) is
// shared by every case.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "oomguard/coordinator.h"
#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/recovery.h"
#include "sdk/guard/guard_testing.h"
#include "sdk/guard/step_protocol.h"

namespace oomguard {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

using testing::RecordingRecovery;

// Forwards to a coordinator and counts the collectives this rank runs.
class CountingCoordinator : public Coordinator {
 public:
  explicit CountingCoordinator(std::unique_ptr<Coordinator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string engine() const override { return inner_->engine(); }
  std::string job_id() const override { return inner_->job_id(); }
  Status Allgather(std::span<const int64_t> mine, std::span<int64_t> all,
                   std::chrono::milliseconds deadline) override {
    ++allgathers;
    return inner_->Allgather(mine, all, deadline);
  }
  Status AllreduceSum(std::span<const SumBuffer> buffers, std::chrono::milliseconds deadline) override {
    ++sums;
    return inner_->AllreduceSum(buffers, deadline);
  }
  void Abort() override { inner_->Abort(); }
  int allgathers = 0;  // read after the rank's thread is joined
  int sums = 0;

 private:
  std::unique_ptr<Coordinator> inner_;
};

struct Rank {
  std::unique_ptr<Coordinator> coord;
  std::unique_ptr<Guard> guard;
  RecordingRecovery recovery;
  int applies = 0;
  int resets = 0;
  int64_t samples_kept = 0;
  double grad = 0;   // this rank's accumulated "gradient"
  double synced = 0; // what the sync left in `grad` at the apply
  std::vector<double> pad;  // more sync words (Run's `pad`), each 1 + rank
  std::vector<Status> statuses;
  std::vector<StepReport> reports;
  std::string thrown;  // what Step threw, if it did
};

class MultiRank : public ::testing::Test {
 protected:
  void TearDown() override { ClearFaultRules(); }

  void Make(int n, GuardOptions base = {}, bool with_recovery = true, bool count = false) {
    auto group = MakeThreadGroup(n).value();
    ranks_.clear();
    for (int r = 0; r < n; ++r) {
      auto rk = std::make_unique<Rank>();
      rk->coord = std::move(group[r]);
      if (count) rk->coord = std::make_unique<CountingCoordinator>(std::move(rk->coord));
      GuardOptions o = base;
      o.coordinator = rk->coord.get();
      if (with_recovery) o.recovery = &rk->recovery;
      if (o.initial_micro_batch == 0) o.initial_micro_batch = 16;
      if (o.vote_deadline_ms == 60000) o.vote_deadline_ms = 20000;
      rk->guard = Guard::Create(o).value();
      ranks_.push_back(std::move(rk));
    }
  }

  // Runs fn(r) for every rank r < n, each on a thread of its own, and joins them.
  template <typename F>
  static void OnEachRank(int n, F fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
    for (auto& t : threads) t.join();
  }

  // Each rank runs `steps` Step calls of 32 samples on its own thread; each
  // sample adds 1 + rank to the gradient (weighted), so the synced gradient of
  // a step is the mean over ranks of (1 + rank). `pad` more words of 1 + rank
  // go into the sync: past internal::kVoteSumWords in all, the sum no longer
  // rides in the vote.
  void Run(int steps, const std::vector<int64_t>& units = {}, int pad = 0) {
    OnEachRank(static_cast<int>(ranks_.size()), [&](int rank) {
      Rank* rk = ranks_[rank].get();
      for (int s = 0; s < steps; ++s) {
        StepRequest req;
        req.samples = 32;
        if (!units.empty()) req.units = units;
        req.micro = [rk, rank](const MicroBatch& mb) {
          rk->guard->MarkPhase(Phase::kForward);
          rk->guard->MarkPhase(Phase::kBackward);
          rk->samples_kept += mb.size;
          rk->grad += mb.weight * (1.0 + rank);
        };
        req.reset = [rk] {
          rk->samples_kept = 0;
          rk->grad = 0;
          rk->resets++;
        };
        req.sync = [rk, rank, pad] {
          std::vector<SumBuffer> bufs{SumBuffer::Host(&rk->grad, 1)};
          rk->pad.assign(static_cast<size_t>(pad), 1.0 + rank);
          if (pad > 0) bufs.push_back(SumBuffer::Host(rk->pad.data(), pad));
          return bufs;
        };
        req.apply = [rk] {
          rk->guard->MarkPhase(Phase::kOptimizer);
          rk->applies++;
          rk->synced = rk->grad;
          rk->samples_kept = 0;
          rk->grad = 0;
        };
        StepReport rep;
        try {
          rk->statuses.push_back(rk->guard->Step(req, &rep));
        } catch (const std::exception& e) {
          rk->thrown = e.what();
          rk->statuses.push_back(Status(StatusCode::kUnknown, e.what()));
        }
        rk->reports.push_back(rep);
        if (!rk->statuses.back().ok() && rk->statuses.back().code() != StatusCode::kAborted) return;
      }
    });
  }

  std::vector<std::unique_ptr<Rank>> ranks_;
};

TEST_F(MultiRank, OomOnOneRankOnlyEveryRankCommitsOnceWithTheMeanGradient) {
  for (const char* site : {"forward", "backward"}) {
    ASSERT_TRUE(SetFaultRules(std::string("oom@step=0,rank=1,site=") + site).ok());
    Make(4);
    Run(1);
    for (int r = 0; r < 4; ++r) {
      EXPECT_TRUE(ranks_[r]->statuses[0].ok()) << site << " rank " << r << ": " << ranks_[r]->statuses[0];
      EXPECT_EQ(ranks_[r]->applies, 1) << site;
      EXPECT_EQ(ranks_[r]->guard->step(), 1);
      EXPECT_DOUBLE_EQ(ranks_[r]->synced, (1 + 2 + 3 + 4) / 4.0) << "the sync holds the mean over ranks";
    }
    EXPECT_EQ(ranks_[1]->reports[0].ooms, 1);
    EXPECT_EQ(ranks_[1]->guard->micro_limit(), 8) << "each rank learns its own size";
    EXPECT_EQ(ranks_[0]->guard->micro_limit(), 16);
    // Incidents carry every rank's memory, because some rank had an OOM.
    ASSERT_EQ(ranks_[1]->reports[0].incidents.size(), 1u);
    EXPECT_EQ(ranks_[1]->reports[0].incidents[0].ranks.size(), 4u);
    EXPECT_EQ(ranks_[1]->reports[0].incidents[0].rank, 1);
    // Every rank saves after a step with an OOM anywhere (agreed by the vote).
    for (int r = 0; r < 4; ++r) EXPECT_EQ(ranks_[r]->recovery.commits_after_recovery(), 1);
  }
}

// The collectives a step costs (issue 29). Without an OOM, and with an OOM
// one rank recovers from locally: the vote (allgather), the gradient sum and
// the agreement after the apply (allgather) — three; two when the sync
// buffers are small enough to ride in the vote, which every rank then sums
// itself. An OOM at the sync site costs one more vote (the redo), not a sum;
// a rank that fails costs the vote and the reasons.
TEST_F(MultiRank, AStepRunsTwoCollectivesWhenTheSumRidesInTheVoteElseThree) {
  const int steps = 5;
  struct Case {
    const char* rules;
    int pad;
    int allgathers, sums;
  } cases[] = {
      {"", 0, 2 * steps, 0},
      {"oom@step=2,rank=1,site=backward", 0, 2 * steps, 0},
      {"", internal::kVoteSumWords - 1, 2 * steps, 0},  // kVoteSumWords in all: still in the vote
      {"", internal::kVoteSumWords, 2 * steps, steps},
      {"oom@step=2,rank=1,site=backward", internal::kVoteSumWords, 2 * steps, steps},
      {"oom@step=2,rank=1,site=sync", 0, 2 * steps + 1, 0},
      {"oom@step=2,rank=1,site=sync", internal::kVoteSumWords, 2 * steps + 1, steps},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string("rules '") + c.rules + "', pad " + std::to_string(c.pad));
    ASSERT_TRUE(SetFaultRules(c.rules).ok());
    Make(3, {}, /*with_recovery=*/true, /*count=*/true);
    Run(steps, {}, c.pad);
    for (int r = 0; r < 3; ++r) {
      for (const Status& st : ranks_[r]->statuses) ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st;
      EXPECT_DOUBLE_EQ(ranks_[r]->synced, 2.0) << "the mean over ranks of 1 + rank";
      for (double p : ranks_[r]->pad) EXPECT_DOUBLE_EQ(p, 2.0);
      const auto* counted = static_cast<const CountingCoordinator*>(ranks_[r]->coord.get());
      EXPECT_EQ(counted->allgathers, c.allgathers) << "rank " << r << ": votes and agreements";
      EXPECT_EQ(counted->sums, c.sums) << "rank " << r << ": gradient sums";
    }
  }
  // A rank that fails stops every rank after the vote and the reasons.
  for (int pad : {0, internal::kVoteSumWords}) {
    ASSERT_TRUE(SetFaultRules("error@step=1,rank=2,site=forward").ok());
    Make(3, {}, /*with_recovery=*/true, /*count=*/true);
    Run(3, {}, pad);
    for (int r = 0; r < 3; ++r) {
      ASSERT_EQ(ranks_[r]->statuses.size(), 2u) << "pad " << pad << " rank " << r;
      EXPECT_FALSE(ranks_[r]->statuses[1].ok());
      const auto* counted = static_cast<const CountingCoordinator*>(ranks_[r]->coord.get());
      EXPECT_EQ(counted->allgathers, 2 + 2) << "pad " << pad << " rank " << r;
      EXPECT_EQ(counted->sums, pad > 0 ? 1 : 0) << "pad " << pad << " rank " << r;
    }
  }
  ClearFaultRules();
}

// Randomised fault plans over 4 ranks, the sum in the vote (pad 0) and apart
// (pad 8): at every step every rank returns alike (all OK, all rolled back,
// or all stopped), every rank ends at the same step, every applied sum is the
// mean over ranks, and no plan hangs.
TEST_F(MultiRank, RandomisedFaultPlansEndAlikeOnEveryRankWithTheSumInTheVoteOrApart) {
  const char* kinds[] = {"oom", "oom", "oom", "error"};
  const char* sites[] = {"micro_batch", "forward", "backward", "vote", "commit", "sync", "apply", "optimizer"};
  std::mt19937 rng(29);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  int all_ok = 0, redone = 0;
  for (int plan_no = 0; plan_no < 48; ++plan_no) {
    std::string plan;
    const int rules = 1 + pick(3);
    for (int i = 0; i < rules; ++i) {
      const std::string kind = kinds[pick(4)];
      std::string rule = kind + "@site=" + sites[pick(8)] + ",step=" + std::to_string(pick(6));
      if (pick(4) != 0) rule += ",rank=" + std::to_string(pick(4));
      if (kind == "oom" && pick(5) == 0) rule += ",times=0";
      plan += (plan.empty() ? "" : ";") + rule;
    }
    const int pad = plan_no % 2 == 0 ? 0 : internal::kVoteSumWords;
    SCOPED_TRACE("plan " + std::to_string(plan_no) + " (pad " + std::to_string(pad) + "): " + plan);
    ASSERT_TRUE(SetFaultRules(plan).ok());
    Make(4);
    const auto t0 = Clock::now();
    Run(6, {}, pad);
    ClearFaultRules();
    EXPECT_LT(SecondsSince(t0), 20.0) << "no plan may hang";
    const Rank& first = *ranks_[0];
    bool ok = true;
    for (int r = 0; r < 4; ++r) {
      const Rank& rk = *ranks_[r];
      ASSERT_EQ(rk.statuses.size(), first.statuses.size()) << "rank " << r;
      for (size_t i = 0; i < rk.statuses.size(); ++i) {
        EXPECT_EQ(rk.statuses[i].ok(), first.statuses[i].ok()) << "rank " << r << " step call " << i << ": "
                                                               << rk.statuses[i] << " vs " << first.statuses[i];
        EXPECT_EQ(rk.statuses[i].code() == StatusCode::kAborted, first.statuses[i].code() == StatusCode::kAborted)
            << "rank " << r << " step call " << i;
        ok = ok && rk.statuses[i].ok();
        redone += rk.reports[i].redone;
      }
      EXPECT_EQ(rk.guard->step(), first.guard->step()) << "rank " << r;
      if (rk.applies > 0) {
        EXPECT_DOUBLE_EQ(rk.synced, 2.5) << "rank " << r;
        for (double p : rk.pad) EXPECT_TRUE(p == 2.5 || p == 1.0 + r) << "rank " << r << ": " << p;
      }
    }
    all_ok += ok ? 1 : 0;
  }
  EXPECT_GE(all_ok, 10) << "plans that every rank recovers from";
  EXPECT_GE(redone, 1) << "plans with a redo after an OOM at the commit or sync site";
  std::printf("randomised plans: %d of 48 recovered on every rank\n", all_ok);
}

// Sync buffers that would fit in the vote but differ between ranks (a
// contract violation) are not summed from the vote: the engine's sum runs
// and refuses them, as it does for any mismatch.
TEST_F(MultiRank, SmallSyncBuffersOfDifferentLayoutsGoToTheEngine) {
  Make(2);
  std::vector<Status> got(2);
  OnEachRank(2, [&](int r) {
    double words[2] = {1.0, 2.0};
    StepRequest req;
    req.samples = 4;
    req.micro = [](const MicroBatch&) {};
    req.reset = [] {};
    req.sync = [&, r] { return std::vector<SumBuffer>{SumBuffer::Host(words, 1 + r)}; };
    got[r] = ranks_[r]->guard->Step(req);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(got[r].ToString().find("diverged"), std::string::npos) << got[r];
}

// float32 and float64 buffers in the vote: each rank's values scaled by its
// share, summed in float64 and stored in the buffer's type, the same on every
// rank.
TEST_F(MultiRank, SumInTheVoteKeepsEachBuffersTypeAndIsTheSameOnEveryRank) {
  Make(3);
  std::vector<std::vector<float>> f(3);
  std::vector<std::vector<double>> d(3);
  OnEachRank(3, [&](int r) {
    f[r] = {0.1f * static_cast<float>(r + 1), -3.0f, 1e-3f};
    d[r] = {1.0 / 3.0 * (r + 1), 7.0, 1e300, -1e-300};
    StepRequest req;
    req.samples = 2 + r;  // shares 2/9, 3/9, 4/9
    req.micro = [](const MicroBatch&) {};
    req.reset = [] {};
    req.sync = [&, r] {
      SumBuffer fb = SumBuffer::Host(f[r].data(), 3);
      return std::vector<SumBuffer>{fb, SumBuffer::Host(d[r].data(), 4)};
    };
    EXPECT_TRUE(ranks_[r]->guard->Step(req).ok());
  });
  const double share[3] = {2.0 / 9, 3.0 / 9, 4.0 / 9};
  double f0 = 0, d0 = 0;
  for (int r = 0; r < 3; ++r) {
    f0 += share[r] * static_cast<double>(0.1f * static_cast<float>(r + 1));
    d0 += share[r] * (1.0 / 3.0 * (r + 1));
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(f[r], f[0]) << "rank " << r;
    EXPECT_EQ(d[r], d[0]) << "rank " << r;
    EXPECT_FLOAT_EQ(f[r][0], static_cast<float>(f0));
    EXPECT_FLOAT_EQ(f[r][1], -3.0f);
    EXPECT_NEAR(d[r][0], d0, 1e-15);
    EXPECT_DOUBLE_EQ(d[r][1], 7.0);
    EXPECT_DOUBLE_EQ(d[r][2], 1e300);
  }
}

// Issue 1: an OOM at the start of the commit phase, or in the guard's sync, on
// one rank: that rank contributes zeros, nobody applies, every rank redoes the
// step and then commits it once — no rank skips a collective the others run.
TEST_F(MultiRank, OomAtCommitOrSyncOnOneRankRedoesTheStepOnEveryRank) {
  for (const char* site : {"commit", "sync"}) {
    ASSERT_TRUE(SetFaultRules(std::string("oom@step=1,rank=3,site=") + site).ok());
    Make(4);
    Run(3);
    for (int r = 0; r < 4; ++r) {
      for (const Status& s : ranks_[r]->statuses) EXPECT_TRUE(s.ok()) << site << " rank " << r << ": " << s;
      EXPECT_EQ(ranks_[r]->applies, 3) << site;
      EXPECT_EQ(ranks_[r]->reports[1].redone, 1) << site << " rank " << r;
      EXPECT_DOUBLE_EQ(ranks_[r]->synced, 2.5) << "the redo's sum has no trace of the failed one";
    }
    EXPECT_EQ(ranks_[3]->reports[1].ooms, 1);
    EXPECT_EQ(ranks_[3]->reports[1].incidents.at(0).phase, Phase::kCommit);
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
  ASSERT_TRUE(SetFaultRules("oom@step=1,site=backward,times=4").ok());
  Make(4);
  Run(3);
  for (int r = 0; r < 4; ++r) {
    for (const Status& s : ranks_[r]->statuses) EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(ranks_[r]->applies, 3);
  }
  int ooms = 0;
  for (auto& rk : ranks_) ooms += rk->reports[1].ooms;
  EXPECT_EQ(ooms, 4);
}

// Issue 5: a rank that gives up tells the others at once; they stop with a
// status naming it.
TEST_F(MultiRank, RankThatCannotRecoverStopsEveryRankAtOnceNamingIt) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,rank=0,site=forward,times=0").ok());
  GuardOptions o;
  o.min_micro_batch = 8;
  Make(3, o, /*with_recovery=*/false);
  const auto t0 = Clock::now();
  Run(1);
  EXPECT_LT(SecondsSince(t0), 5.0);
  EXPECT_EQ(ranks_[0]->statuses[0].code(), StatusCode::kResourceExhausted) << ranks_[0]->statuses[0];
  for (int r = 1; r < 3; ++r) {
    EXPECT_EQ(ranks_[r]->statuses[0].code(), StatusCode::kResourceExhausted) << ranks_[r]->statuses[0];
    EXPECT_NE(ranks_[r]->statuses[0].message().find("rank 0 stopped at step 0"), std::string::npos)
        << ranks_[r]->statuses[0];
    EXPECT_EQ(ranks_[r]->reports[0].failed_rank, 0);
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(ranks_[r]->applies, 0);
}

// Issue 5: a non-OOM exception passes through on its rank (after voting); the
// others stop within the deadline's fraction with kCancelled naming it.
TEST_F(MultiRank, ErrorOnOneRankIsRethrownThereAndStopsTheOthersAtOnce) {
  for (const char* site : {"backward", "sync", "apply"}) {
    ASSERT_TRUE(SetFaultRules(std::string("error@step=1,rank=2,site=") + site).ok());
    GuardOptions o;
    o.vote_deadline_ms = 30000;
    Make(3, o);
    const auto t0 = Clock::now();
    Run(3);
    EXPECT_LT(SecondsSince(t0), 5.0) << site << ": nobody waits for the 30 s deadline";
    EXPECT_NE(ranks_[2]->thrown.find("injected error"), std::string::npos) << site << ": " << ranks_[2]->thrown;
    for (int r : {0, 1}) {
      ASSERT_EQ(ranks_[r]->statuses.size(), 2u) << site;
      const Status& s = ranks_[r]->statuses[1];
      EXPECT_EQ(s.code(), StatusCode::kCancelled) << site << ": " << s;
      EXPECT_NE(s.message().find("rank 2 stopped at step 1"), std::string::npos) << s;
      EXPECT_NE(s.message().find("injected error"), std::string::npos) << s;
    }
  }
}

// An NCCL failure reads "out of memory" but leaves the communicator unusable:
// it is no OOM to split away; every rank stops for a restart (exit 75).
TEST_F(MultiRank, CommunicatorOutOfMemoryIsACoordinationFailureNotAnOom) {
  Make(3);
  std::vector<Status> got(3);
  std::vector<StepReport> reps(3);
  OnEachRank(3, [&](int r) {
    StepRequest req;
    req.samples = 32;
    req.micro = [r](const MicroBatch&) {
      if (r == 1)
        throw std::runtime_error(
            "NCCL error in: ProcessGroupNCCL.cpp:1191, unhandled cuda error, NCCL version 2.28.3 "
            "ncclUnhandledCudaError: Call to CUDA function failed. Last error: Cuda failure 'out of memory'");
    };
    req.reset = [] {};
    got[r] = ranks_[r]->guard->Step(req, &reps[r]);
  });
  EXPECT_EQ(reps[1].ooms, 0) << "not retried as an OOM";
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[r].code(), StatusCode::kUnavailable) << got[r];
    EXPECT_NE(got[r].message().find("communicator"), std::string::npos) << got[r];
  }
}

TEST_F(MultiRank, BadRequestOnOneRankStopsEveryRankWithoutWaiting) {
  GuardOptions o;
  o.vote_deadline_ms = 30000;
  Make(3, o);
  std::vector<Status> got(3);
  const auto t0 = Clock::now();
  OnEachRank(3, [&](int r) {
    StepRequest req;
    req.samples = r == 1 ? 0 : 8;  // rank 1's request is invalid
    req.micro = [](const MicroBatch&) {};
    req.reset = [] {};
    got[r] = ranks_[r]->guard->Step(req);
  });
  EXPECT_LT(SecondsSince(t0), 5.0) << "nobody waits for the 30 s deadline";
  EXPECT_EQ(got[1].code(), StatusCode::kInvalidArgument) << got[1];
  for (int r : {0, 2}) {
    EXPECT_EQ(got[r].code(), StatusCode::kCancelled) << got[r];
    EXPECT_NE(got[r].message().find("rank 1 stopped"), std::string::npos) << got[r];
    EXPECT_NE(got[r].message().find("samples must be >= 1"), std::string::npos) << got[r];
  }
}

// With several ranks any step may be redone (another rank failed), so a
// missing reset hook is refused on entry even without apply or sync, and the
// other ranks hear of it at once.
TEST_F(MultiRank, MissingResetHookOnOneRankIsRefusedOnEntry) {
  GuardOptions o;
  o.vote_deadline_ms = 30000;
  Make(2, o);
  std::vector<Status> got(2);
  OnEachRank(2, [&](int r) {
    StepRequest req;
    req.samples = 4;
    req.micro = [](const MicroBatch&) {};
    if (r == 0) req.reset = [] {};
    got[r] = ranks_[r]->guard->Step(req);
  });
  EXPECT_EQ(got[1].code(), StatusCode::kFailedPrecondition) << got[1];
  EXPECT_NE(got[1].message().find("StepRequest.reset must be set"), std::string::npos) << got[1];
  EXPECT_EQ(got[0].code(), StatusCode::kCancelled) << got[0];
}

TEST_F(MultiRank, OomAtMinimumRollsEveryRankBackToTheSameStep) {
  ASSERT_TRUE(SetFaultRules("oom@step=3,rank=2,site=forward,times=0").ok());
  GuardOptions o;
  o.min_micro_batch = 8;
  Make(4, o);
  Run(4);  // steps 0..2 commit, step 3 rolls back
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(ranks_[r]->statuses[3].code(), StatusCode::kAborted) << "rank " << r << " " << ranks_[r]->statuses[3];
    ASSERT_TRUE(ranks_[r]->reports[3].rolled_back_to.has_value());
    EXPECT_EQ(*ranks_[r]->reports[3].rolled_back_to, 2);
    EXPECT_EQ(ranks_[r]->guard->step(), 3);
    EXPECT_EQ(ranks_[r]->applies, 3);
    EXPECT_EQ(ranks_[r]->recovery.last_restored(), 2);
  }
  EXPECT_FALSE(ranks_[0]->recovery.commits.empty()) << "rank 0 committed the durable steps";
}

// Issue 4: an OOM in one rank's apply rolls every rank back in the same Step
// (also on the last step, where no later vote would carry it).
TEST_F(MultiRank, OomInOneRanksApplyRollsEveryRankBackInThatStep) {
  ASSERT_TRUE(SetFaultRules("oom@step=2,rank=1,site=optimizer").ok());
  Make(3);
  Run(3);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(ranks_[r]->statuses.size(), 3u);
    EXPECT_EQ(ranks_[r]->statuses[2].code(), StatusCode::kAborted) << "rank " << r << " " << ranks_[r]->statuses[2];
    EXPECT_EQ(ranks_[r]->reports[2].rolled_back_to, 1) << "rank " << r;
    EXPECT_EQ(ranks_[r]->recovery.restored, std::vector<int64_t>{1})
        << "rank " << r << "'s store restored step 1";
    EXPECT_EQ(ranks_[r]->guard->step(), 2) << "every rank continues from the same step";
  }
  EXPECT_EQ(ranks_[1]->guard->micro_limit(), 16)
      << "the redo keeps the size: what the optimizer allocates does not depend on the split";
}

// The most common real OOM: optimizer state allocated in the first apply.
TEST_F(MultiRank, OomInTheFirstApplyRollsBackToTheInitialSnapshot) {
  ASSERT_TRUE(SetFaultRules("oom@step=0,rank=2,site=apply").ok());
  Make(3);
  Run(2);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ranks_[r]->statuses[0].code(), StatusCode::kAborted) << ranks_[r]->statuses[0];
    EXPECT_EQ(ranks_[r]->reports[0].rolled_back_to, -1);
    EXPECT_EQ(ranks_[r]->recovery.snapshots.front(), -1) << "the guard took the initial snapshot";
    EXPECT_EQ(ranks_[r]->recovery.restored, std::vector<int64_t>{-1})
        << "rank " << r << "'s store restored it";
    EXPECT_TRUE(ranks_[r]->statuses[1].ok()) << ranks_[r]->statuses[1];
    EXPECT_EQ(ranks_[r]->guard->step(), 1);
  }
}

// Issue 2: the rollback target is a step every rank holds, not the minimum
// of the ranks' newest.
TEST_F(MultiRank, RollbackTargetIsInEveryRanksDurableSet) {
  ASSERT_TRUE(SetFaultRules("oom@step=20,rank=0,site=forward,times=0").ok());
  GuardOptions o;
  o.min_micro_batch = 16;
  Make(3, o);
  for (auto& rk : ranks_) {
    ASSERT_TRUE(rk->guard->SetStep(20).ok());
    rk->recovery.save_on_commit = false;
    rk->recovery.can_snapshot = false;
  }
  ranks_[0]->recovery.durable = {9, 14, 19};
  ranks_[1]->recovery.durable = {9, 19};  // its save of 14 failed
  ranks_[2]->recovery.durable = {9, 14};  // its save of 19 is missing
  Run(1);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ranks_[r]->statuses[0].code(), StatusCode::kAborted) << ranks_[r]->statuses[0];
    EXPECT_EQ(ranks_[r]->reports[0].rolled_back_to, 9) << "rank " << r;
    EXPECT_EQ(ranks_[r]->recovery.last_restored(), 9);
    EXPECT_EQ(ranks_[r]->recovery.restored, std::vector<int64_t>{9})
        << "rank " << r << " tried no other step";
  }
  EXPECT_EQ(ranks_[0]->recovery.commits.back(), 9) << "rank 0 committed it before anyone loaded it";
}

// A rank whose restore fails does not leave the others on another step: all
// move on to the next step every rank holds, and confirm it.
TEST_F(MultiRank, FailedRestoreOnOneRankMovesEveryRankToTheNextCommonStep) {
  ASSERT_TRUE(SetFaultRules("oom@step=20,rank=0,site=forward,times=0").ok());
  GuardOptions o;
  o.min_micro_batch = 16;
  Make(3, o);
  for (auto& rk : ranks_) {
    ASSERT_TRUE(rk->guard->SetStep(20).ok());
    rk->recovery.save_on_commit = false;
    rk->recovery.can_snapshot = false;
    rk->recovery.durable = {9, 14};
  }
  ranks_[2]->recovery.fail_restore = {14};
  Run(1);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ranks_[r]->statuses[0].code(), StatusCode::kAborted) << ranks_[r]->statuses[0];
    EXPECT_EQ(ranks_[r]->reports[0].rolled_back_to, 9) << "rank " << r;
    EXPECT_EQ(ranks_[r]->recovery.last_restored(), 9);
  }
  // 14 first (the newest every rank holds): ranks 0 and 1 loaded it, rank 2 could not.
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(ranks_[r]->recovery.restored, (std::vector<int64_t>{14, 9})) << "rank " << r;
  EXPECT_EQ(ranks_[2]->recovery.restored, std::vector<int64_t>{9});
  EXPECT_EQ(ranks_[2]->recovery.failed_restores, std::vector<int64_t>{14});
}

TEST_F(MultiRank, NoStepEveryRankHoldsStopsEveryRank) {
  ASSERT_TRUE(SetFaultRules("oom@step=20,rank=0,site=forward,times=0").ok());
  GuardOptions o;
  o.min_micro_batch = 16;
  Make(2, o);
  for (auto& rk : ranks_) {
    ASSERT_TRUE(rk->guard->SetStep(20).ok());
    rk->recovery.save_on_commit = false;
    rk->recovery.can_snapshot = false;
  }
  ranks_[0]->recovery.durable = {14};
  ranks_[1]->recovery.durable = {19};
  Run(1);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ranks_[r]->statuses[0].code(), StatusCode::kResourceExhausted) << ranks_[r]->statuses[0];
    EXPECT_NE(ranks_[r]->statuses[0].message().find("no checkpoint to roll back to on every rank"),
              std::string::npos);
    EXPECT_EQ(ranks_[r]->recovery.restores(), 0);
  }
}

// Issue 6: an OOM that no size fixes stops after a bounded number of
// rollbacks, naming the step and the size.
TEST_F(MultiRank, RepeatedRollbacksToOneStepStopWithAClearError) {
  ASSERT_TRUE(SetFaultRules("oom@step=3,rank=1,site=forward,times=0").ok());
  GuardOptions o;
  o.min_micro_batch = 16;
  o.max_rollbacks_per_step = 2;
  Make(2, o);
  Run(40);
  for (int r = 0; r < 2; ++r) {
    const Status& last = ranks_[r]->statuses.back();
    EXPECT_EQ(last.code(), StatusCode::kResourceExhausted) << last;
    EXPECT_NE(last.message().find("rolled back to step 2 2 times in a row"), std::string::npos) << last;
    EXPECT_NE(last.message().find("micro-batch 16"), std::string::npos) << last;
    int rollbacks = 0;
    for (const Status& s : ranks_[r]->statuses) rollbacks += s.code() == StatusCode::kAborted;
    EXPECT_EQ(rollbacks, 2);
  }
}

TEST_F(MultiRank, UnitsWeighTheGradientByEveryRanksShareOfTheGlobalBatch) {
  // Rank r's samples carry r+1 units each: rank shares 1/10, 2/10, 3/10, 4/10.
  Make(4);
  std::vector<double> synced(4);
  std::vector<int64_t> global(4);
  OnEachRank(4, [&](int r) {
    std::vector<int64_t> units(32, r + 1);
    units[5] = 0;  // a sample that is all padding
    double grad = 0;
    StepRequest req;
    req.samples = 32;
    req.units = units;
    req.micro = [&](const MicroBatch& mb) { grad += mb.weight * (1.0 + r); };
    req.reset = [&] { grad = 0; };
    req.sync = [&] { return std::vector<SumBuffer>{SumBuffer::Host(&grad, 1)}; };
    req.apply = [&] { synced[r] = grad; };
    StepReport rep;
    EXPECT_TRUE(ranks_[r]->guard->Step(req, &rep).ok());
    global[r] = rep.global_units;
  });
  const double u[4] = {31, 62, 93, 124};
  const double total = u[0] + u[1] + u[2] + u[3];
  const double expected = (u[0] * 1 + u[1] * 2 + u[2] * 3 + u[3] * 4) / total;
  for (int r = 0; r < 4; ++r) {
    EXPECT_NEAR(synced[r], expected, 1e-15);
    EXPECT_EQ(global[r], 310);
  }
}

// Issue 10: a rank that runs a collective of its own between steps is at a
// different point of the sequence: detected, never misread.
TEST_F(MultiRank, DivergedCollectiveSequenceIsDetected) {
  Make(2);
  std::vector<Status> got(2);
  OnEachRank(2, [&](int r) {
    if (r == 1) {
      // An extra allgather of the guard's vote size, where rank 0 votes.
      std::vector<int64_t> mine(internal::kVoteWords + 1, 0), all(2 * mine.size());
      (void)ranks_[r]->coord->Allgather(mine, all, std::chrono::milliseconds(5000));
    }
    StepRequest req;
    req.samples = 8;
    req.micro = [](const MicroBatch&) {};
    got[r] = ranks_[r]->guard->Step(req);
  });
  EXPECT_NE(got[0].message().find("collective sequence diverged"), std::string::npos) << got[0];
  EXPECT_FALSE(got[1].ok());
}

TEST_F(MultiRank, SilentRankTurnsIntoUnavailableWithAnIncident) {
  GuardOptions o;
  o.vote_deadline_ms = 200;
  Make(3, o);
  std::vector<Status> got(3);
  std::vector<StepReport> reps(3);
  const auto t0 = Clock::now();
  OnEachRank(2, [&](int r) {
    StepRequest req;
    req.samples = 8;
    req.micro = [](const MicroBatch&) {};
    got[r] = ranks_[r]->guard->Step(req, &reps[r]);
  });
  EXPECT_LT(SecondsSince(t0), 2.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), StatusCode::kUnavailable) << got[r];
    ASSERT_EQ(reps[r].incidents.size(), 1u);
    EXPECT_EQ(reps[r].incidents[0].kind, IncidentKind::kCoordination);
    EXPECT_EQ(reps[r].incidents[0].outcome, IncidentOutcome::kFailed);
  }
}

TEST_F(MultiRank, FinishCommitsWhatEveryRankHoldsAndAgreesOnTheNewest) {
  Make(3);
  ranks_[0]->recovery.durable = {4, 9, 14};
  ranks_[1]->recovery.durable = {4, 9, 14};
  ranks_[2]->recovery.durable = {4, 9};  // its 14 failed
  std::vector<StatusOr<int64_t>> got(3, Status::Internal("not run"));
  OnEachRank(3, [&](int r) { got[r] = ranks_[r]->guard->Finish(); });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(got[r].ok()) << got[r].status();
    EXPECT_EQ(*got[r], 9);
  }
  EXPECT_EQ(ranks_[0]->recovery.commits, (std::vector<int64_t>{4, 9})) << "oldest first";
  EXPECT_TRUE(ranks_[1]->recovery.commits.empty()) << "only rank 0 commits";
}

}  // namespace
}  // namespace oomguard
