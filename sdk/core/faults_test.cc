// Fault points firing: what matches, what each kind does, counting under
// threads, the environment variable and the per-thread context. Parsing is
// in fault_rules_test.cc; how the guard and the classifier treat injected
// errors is tested with them.
#include "oomguard/faults.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "oomguard/oom_error.h"
#include "sdk/core/faults_internal.h"

namespace oomguard {
namespace {

// Every test starts and ends with no rules armed: the rule set is process-wide
// and other suites in this binary place fault points too.
class FaultsTest : public ::testing::Test {
 protected:
  void SetUp() override { ClearFaultRules(); }
  void TearDown() override { ClearFaultRules(); }
};

FaultContext Ctx(int64_t step, int rank = 0, int micro = -1, int64_t size = 0) {
  FaultContext ctx;
  ctx.step = step;
  ctx.rank = rank;
  ctx.micro = micro;
  ctx.size = size;
  return ctx;
}

// True when the fault point throws an injected device OOM.
bool Fires(FaultSite site, const FaultContext& ctx) {
  try {
    FaultPoint(site, ctx);
  } catch (const DeviceOomError& e) {
    EXPECT_TRUE(e.injected());
    return true;
  }
  return false;
}

TEST_F(FaultsTest, SetClearAndActiveSpec) {
  EXPECT_FALSE(internal::g_faults_armed.load());
  EXPECT_EQ(ActiveFaultRules(), "");
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1)));

  ASSERT_TRUE(SetFaultRules(" oom@step=1 ; kill@site=vote ;").ok());
  EXPECT_TRUE(internal::g_faults_armed.load());
  EXPECT_EQ(ActiveFaultRules(), "oom@step=1;kill@site=vote");

  // A bad spec is rejected and the rules in force stay.
  const Status bad = SetFaultRules("oom@step=1;oom@nope=2");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(internal::g_faults_armed.load());
  EXPECT_EQ(ActiveFaultRules(), "oom@step=1;kill@site=vote");

  ClearFaultRules();
  EXPECT_FALSE(internal::g_faults_armed.load());
  EXPECT_EQ(ActiveFaultRules(), "");
  EXPECT_EQ(FaultsFired(), 0);
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1)));

  ASSERT_TRUE(SetFaultRules("oom").ok());
  EXPECT_TRUE(internal::g_faults_armed.load());
  ASSERT_TRUE(SetFaultRules(" ; ").ok());  // empty spec clears
  EXPECT_FALSE(internal::g_faults_armed.load());
  EXPECT_EQ(ActiveFaultRules(), "");
}

TEST_F(FaultsTest, MatchesSite) {
  ASSERT_TRUE(SetFaultRules("oom@site=backward,times=0").ok());
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1)));
  EXPECT_FALSE(Fires(FaultSite::kOptimizer, Ctx(1)));
  EXPECT_TRUE(Fires(FaultSite::kBackward, Ctx(1)));
  EXPECT_EQ(FaultsFired(), 1);
}

TEST_F(FaultsTest, MatchesStepRangeInclusive) {
  ASSERT_TRUE(SetFaultRules("oom@step=3-5,times=0").ok());
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(-1)));
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(2)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(3)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(4)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(5)));
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(6)));

  ASSERT_TRUE(SetFaultRules("oom@step=7,times=0").ok());
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(6)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(7)));
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(8)));
}

TEST_F(FaultsTest, MatchesRankMicroAndMinSize) {
  ASSERT_TRUE(SetFaultRules("oom@rank=1,times=0").ok());
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1, /*rank=*/0)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(1, /*rank=*/1)));
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1, /*rank=*/2)));

  ASSERT_TRUE(SetFaultRules("oom@micro=2,times=0").ok());
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1, 0, /*micro=*/-1)));
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1, 0, /*micro=*/1)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(1, 0, /*micro=*/2)));

  ASSERT_TRUE(SetFaultRules("oom@min_size=16,times=0").ok());
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1, 0, 0, /*size=*/0)));
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1, 0, 0, /*size=*/15)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(1, 0, 0, /*size=*/16)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(1, 0, 0, /*size=*/100)));

  // Every key must match, not any.
  ASSERT_TRUE(SetFaultRules("oom@step=4,rank=1,site=backward,micro=0,min_size=8,times=0").ok());
  EXPECT_TRUE(Fires(FaultSite::kBackward, Ctx(4, 1, 0, 8)));
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(4, 1, 0, 8)));
  EXPECT_FALSE(Fires(FaultSite::kBackward, Ctx(5, 1, 0, 8)));
  EXPECT_FALSE(Fires(FaultSite::kBackward, Ctx(4, 0, 0, 8)));
  EXPECT_FALSE(Fires(FaultSite::kBackward, Ctx(4, 1, 1, 8)));
  EXPECT_FALSE(Fires(FaultSite::kBackward, Ctx(4, 1, 0, 7)));
}

TEST_F(FaultsTest, BareKindMatchesAnySite) {
  ASSERT_TRUE(SetFaultRules("oom@times=0").ok());
  for (int i = 0; i < kNumFaultSites; ++i) {
    EXPECT_TRUE(Fires(static_cast<FaultSite>(i), FaultContext{})) << i;
  }
  ASSERT_TRUE(SetFaultRules("oom").ok());
  EXPECT_TRUE(Fires(FaultSite::kKbWrite, Ctx(123, 7, 9, 1)));
}

TEST_F(FaultsTest, TimesLimitsFiringsAndSetResetsCounters) {
  ASSERT_TRUE(SetFaultRules("oom@site=forward").ok());  // default times=1
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(1)));
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(2)));
  EXPECT_EQ(FaultsFired(), 1);

  ASSERT_TRUE(SetFaultRules("oom@site=forward,times=3").ok());
  EXPECT_EQ(FaultsFired(), 0);
  int fired = 0;
  for (int i = 0; i < 10; ++i) fired += Fires(FaultSite::kForward, Ctx(i));
  EXPECT_EQ(fired, 3);
  EXPECT_EQ(FaultsFired(), 3);

  ASSERT_TRUE(SetFaultRules("oom@site=forward,times=0").ok());
  fired = 0;
  for (int i = 0; i < 100; ++i) fired += Fires(FaultSite::kForward, Ctx(i));
  EXPECT_EQ(fired, 100);
  EXPECT_EQ(FaultsFired(), 100);

  // A non-matching call does not use up the budget.
  ASSERT_TRUE(SetFaultRules("oom@step=5").ok());
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(i)));
  EXPECT_TRUE(Fires(FaultSite::kForward, Ctx(5)));
}

TEST_F(FaultsTest, FirstFiringRuleWinsAndExhaustedRulesFallThrough) {
  ASSERT_TRUE(SetFaultRules("oom@step=1,bytes=10;oom@bytes=20").ok());
  try {
    FaultPoint(FaultSite::kForward, Ctx(1));
    FAIL() << "no fault";
  } catch (const DeviceOomError& e) {
    EXPECT_EQ(e.requested_bytes(), 10);
  }
  try {
    FaultPoint(FaultSite::kForward, Ctx(1));
    FAIL() << "no fault";
  } catch (const DeviceOomError& e) {
    EXPECT_EQ(e.requested_bytes(), 20);
  }
  EXPECT_FALSE(Fires(FaultSite::kForward, Ctx(1)));
  EXPECT_EQ(FaultsFired(), 2);
}

// (Parsing of error rules: FaultParseTest.EachKey.)
TEST_F(FaultsTest, ErrorKindThrowsANonOomExceptionAtTheCommitPhaseSites) {
  ASSERT_TRUE(SetFaultRules("error@step=2,rank=1,site=sync").ok());
  FaultPoint(FaultSite::kApply, Ctx(2, 1));  // another site: nothing
  FaultPoint(FaultSite::kSync, Ctx(2, 0));   // another rank: nothing
  try {
    FaultPoint(FaultSite::kSync, Ctx(2, 1));
    FAIL() << "no fault";
  } catch (const DeviceOomError&) {
    FAIL() << "an error rule must not look like an OOM";
  } catch (const std::bad_alloc&) {
    FAIL() << "an error rule must not look like a host OOM";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "injected error (fault rule 'error@step=2,rank=1,site=sync') at site sync, step 2, rank 1, micro -1");
  }
  EXPECT_EQ(FaultsFired(), 1);
}

TEST_F(FaultsTest, DeviceOomIsInjectedWithBytesAndMessage) {
  ASSERT_TRUE(SetFaultRules("oom@step=3,site=forward,bytes=4096").ok());
  FaultPoint(FaultSite::kForward, Ctx(2, 0, 1));  // wrong step: nothing
  try {
    FaultPoint(FaultSite::kForward, Ctx(3, 0, 1));
    FAIL() << "no fault";
  } catch (const DeviceOomError& e) {
    EXPECT_TRUE(e.injected());
    EXPECT_EQ(e.requested_bytes(), 4096);
    EXPECT_EQ(std::string(e.what()),
              "injected device OOM (fault rule 'oom@step=3,site=forward,bytes=4096') at site "
              "forward, step 3, rank 0, micro 1");
  }

  ASSERT_TRUE(SetFaultRules("oom").ok());
  try {
    FaultPoint(FaultSite::kBackward, Ctx(1));
    FAIL() << "no fault";
  } catch (const DeviceOomError& e) {
    EXPECT_EQ(e.requested_bytes(), 1 << 20);  // default
  }
}

TEST_F(FaultsTest, HostOomIsABadAllocWithBytesAndMessage) {
  ASSERT_TRUE(SetFaultRules("host_oom@site=micro_batch,bytes=777").ok());
  try {
    FaultPoint(FaultSite::kMicroBatch, Ctx(9, 2, 0));
    FAIL() << "no fault";
  } catch (const HostOomError& e) {
    EXPECT_EQ(e.requested_bytes(), 777);
    const std::string what = e.what();
    EXPECT_NE(what.find("injected host OOM"), std::string::npos) << what;
    EXPECT_NE(what.find("'host_oom@site=micro_batch,bytes=777'"), std::string::npos) << what;
    EXPECT_NE(what.find("at site micro_batch, step 9, rank 2, micro 0"), std::string::npos) << what;
  }
  ASSERT_TRUE(SetFaultRules("host_oom").ok());
  EXPECT_THROW(FaultPoint(FaultSite::kMicroBatch, Ctx(1)), std::bad_alloc);
}

TEST_F(FaultsTest, DelaySleepsAtLeastMsAndEvaluationContinues) {
  ASSERT_TRUE(SetFaultRules("delay@ms=50,site=vote").ok());
  auto start = std::chrono::steady_clock::now();
  FaultPoint(FaultSite::kVote, Ctx(1));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
  EXPECT_EQ(FaultsFired(), 1);

  // Used up (times=1): the next call does not sleep.
  start = std::chrono::steady_clock::now();
  FaultPoint(FaultSite::kVote, Ctx(2));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));

  // A delay does not end evaluation: the OOM after it still fires.
  ASSERT_TRUE(SetFaultRules("delay@ms=20;oom@site=commit").ok());
  start = std::chrono::steady_clock::now();
  EXPECT_THROW(FaultPoint(FaultSite::kCommit, Ctx(1)), DeviceOomError);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(20));
  EXPECT_EQ(FaultsFired(), 2);
}

TEST_F(FaultsTest, KillSendsSigkillAndSaysWhy) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (!SetFaultRules("kill@step=57,site=ckpt_write").ok()) std::exit(2);
        FaultPoint(FaultSite::kCkptWrite, Ctx(56));  // wrong step: survives
        FaultPoint(FaultSite::kCkptStage, Ctx(57));  // wrong site: survives
        FaultPoint(FaultSite::kCkptWrite, Ctx(57));
        std::exit(0);
      },
      testing::KilledBySignal(SIGKILL),
      "fault rule 'kill@step=57,site=ckpt_write'.*at site ckpt_write, step 57");
}

TEST_F(FaultsTest, ConcurrentThreadsNeverExceedTimes) {
  ASSERT_TRUE(SetFaultRules("oom@site=forward,times=5").ok());
  std::atomic<int> fired{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 4; ++rank) {
    threads.emplace_back([&, rank] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < 2000; ++i) {
        try {
          FaultPoint(FaultSite::kForward, Ctx(i, rank));
        } catch (const DeviceOomError&) {
          fired.fetch_add(1);
        }
      }
    });
  }
  go.store(true);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(fired.load(), 5);
  EXPECT_EQ(FaultsFired(), 5);
}

TEST_F(FaultsTest, RulesCanBeReplacedWhileThreadsFire) {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> ooms{0};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 4; ++rank) {
    threads.emplace_back([&, rank] {
      while (!stop.load()) {
        try {
          FaultPoint(FaultSite::kBackward, Ctx(1, rank));
        } catch (const DeviceOomError& e) {
          EXPECT_TRUE(e.injected());
          ooms.fetch_add(1);
        }
      }
    });
  }
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(SetFaultRules(i % 2 ? "oom@site=backward,times=0" : "delay@ms=0,times=0").ok());
    if (i % 3 == 0) ClearFaultRules();
    std::this_thread::yield();
  }
  ASSERT_TRUE(SetFaultRules("oom@site=backward,times=0").ok());
  while (ooms.load() == 0) std::this_thread::yield();
  ClearFaultRules();
  stop.store(true);
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(internal::g_faults_armed.load());
  EXPECT_EQ(FaultsFired(), 0);
  EXPECT_GT(ooms.load(), 0);
}

TEST_F(FaultsTest, EnvValueParsesInstallsOrReportsError) {
  EXPECT_TRUE(internal::LoadFaultRulesFromEnvValue(nullptr).ok());
  EXPECT_TRUE(internal::LoadFaultRulesFromEnvValue("").ok());
  EXPECT_TRUE(internal::LoadFaultRulesFromEnvValue("  ").ok());
  EXPECT_FALSE(internal::g_faults_armed.load());

  ASSERT_TRUE(SetFaultRules("oom@step=9").ok());
  // Unset/empty does not undo rules set through the API.
  EXPECT_TRUE(internal::LoadFaultRulesFromEnvValue(nullptr).ok());
  EXPECT_EQ(ActiveFaultRules(), "oom@step=9");

  const Status bad = internal::LoadFaultRulesFromEnvValue("oom@step=x");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("OOMGUARD_FAULTS"), std::string::npos) << bad;
  EXPECT_NE(bad.message().find("fault rule 'oom@step=x'"), std::string::npos) << bad;
  EXPECT_NE(bad.message().find("is not a number"), std::string::npos) << bad;
  EXPECT_EQ(ActiveFaultRules(), "oom@step=9");

  ASSERT_TRUE(internal::LoadFaultRulesFromEnvValue("kill@site=vote;").ok());
  EXPECT_EQ(ActiveFaultRules(), "kill@site=vote");
  EXPECT_TRUE(internal::g_faults_armed.load());
}

// LoadFaultRulesFromEnv reads the variable once per process, so these run in
// a fresh child process (threadsafe death-test style re-executes the binary).
TEST_F(FaultsTest, EnvBadValueIsReportedOnEveryCall) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("OOMGUARD_FAULTS", "oom@step=x", 1);
        const Status first = LoadFaultRulesFromEnv();
        setenv("OOMGUARD_FAULTS", "oom@step=1", 1);  // not read again
        const Status second = LoadFaultRulesFromEnv();
        std::fprintf(stderr, "%s\n", second.ToString().c_str());
        const bool ok = first.code() == StatusCode::kInvalidArgument && first == second &&
                        !internal::g_faults_armed.load() && ActiveFaultRules().empty();
        std::exit(ok ? 0 : 1);
      },
      testing::ExitedWithCode(0), "fault rule 'oom@step=x': step: 'x' is not a number");
}

TEST_F(FaultsTest, EnvGoodValueIsInstalledOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("OOMGUARD_FAULTS", " oom@step=2,site=forward ;", 1);
        const Status first = LoadFaultRulesFromEnv();
        if (!first.ok() || ActiveFaultRules() != "oom@step=2,site=forward") std::exit(1);
        ClearFaultRules();
        // The second call neither re-reads nor re-installs.
        if (!LoadFaultRulesFromEnv().ok() || internal::g_faults_armed.load()) std::exit(2);
        std::exit(0);
      },
      testing::ExitedWithCode(0), "");
}

TEST(FaultContextTest, CurrentContextIsPerThread) {
  SetCurrentFaultContext(Ctx(12, 3, 1, 64));
  FaultContext seen_elsewhere;
  std::thread([&] { seen_elsewhere = CurrentFaultContext(); }).join();
  EXPECT_EQ(seen_elsewhere.step, -1);
  EXPECT_EQ(seen_elsewhere.rank, 0);
  EXPECT_EQ(CurrentFaultContext().step, 12);
  EXPECT_EQ(CurrentFaultContext().rank, 3);
  EXPECT_EQ(CurrentFaultContext().micro, 1);
  EXPECT_EQ(CurrentFaultContext().size, 64);
  SetCurrentFaultContext(FaultContext{});
}

}  // namespace
}  // namespace oomguard
