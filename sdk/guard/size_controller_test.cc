#include "oomguard/size_controller.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace oomguard {
namespace {

SizeControllerOptions Opts(int64_t initial, int64_t min = 1, int64_t max = 1 << 20, int grow_after = 1) {
  SizeControllerOptions o;
  o.initial = initial;
  o.min = min;
  o.max = max;
  o.grow_after = grow_after;
  return o;
}

// Drives a controller against a device where sizes above `fits` fail, one
// attempt per step, and returns the number of OOMs.
struct Sim {
  int64_t ooms = 0;
  int64_t attempts = 0;
  void Run(SizeController& c, int64_t fits, int steps) {
    for (int s = 0; s < steps; ++s) {
      for (int tries = 0;; ++tries) {
        ASSERT_LT(tries, 64) << "a step must not loop forever";
        ++attempts;
        if (c.limit() > fits) {
          ++ooms;
          if (!c.OnOom(c.limit())) return;
          continue;
        }
        c.OnSuccess(c.limit(), true);
        break;
      }
    }
  }
};

TEST(SizeController, HalvesOnOom) {
  SizeController c(Opts(256));
  EXPECT_TRUE(c.OnOom(256));
  EXPECT_EQ(c.limit(), 128);
  EXPECT_EQ(c.bad(), 256);
  EXPECT_TRUE(c.OnOom(100));  // a micro-batch smaller than the limit failed
  EXPECT_EQ(c.limit(), 50);
  EXPECT_EQ(c.bad(), 100);
}

TEST(SizeController, NeverBelowMinimumAndEscalatesThere) {
  SizeController c(Opts(9, 4));
  EXPECT_TRUE(c.OnOom(9));
  EXPECT_EQ(c.limit(), 4);
  EXPECT_FALSE(c.OnOom(4)) << "an OOM at the minimum cannot be split further";
  EXPECT_EQ(c.limit(), 4);
}

TEST(SizeController, FailedProbeFallsBackToGood) {
  SizeController c(Opts(64, 1, 1024, 1));
  c.OnSuccess(64, true);  // proves 64, then probes 128
  EXPECT_TRUE(c.probing());
  EXPECT_EQ(c.limit(), 128);
  EXPECT_TRUE(c.OnOom(128));
  EXPECT_EQ(c.limit(), 64) << "a failed probe returns to the size known to fit";
  EXPECT_FALSE(c.probing());
}

TEST(SizeController, ConvergesWithinToleranceInLogOoms) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t max = 1 << (6 + rng() % 10);
    const int64_t fits = 1 + static_cast<int64_t>(rng() % max);
    const int64_t initial = 1 + static_cast<int64_t>(rng() % max);
    SizeController c(Opts(initial, 1, max, 1));
    Sim sim;
    sim.Run(c, fits, 200);
    ASSERT_LE(c.limit(), fits);
    EXPECT_GE(static_cast<double>(c.limit()), 0.95 * static_cast<double>(fits) - 1.0)
        << "fits " << fits << " initial " << initial << " max " << max;
    // Halving down is log2(initial/fits), bisection up is log2(1/tolerance) + log2(fits).
    const double bound = 2.0 * std::log2(static_cast<double>(max)) + 8;
    EXPECT_LE(static_cast<double>(sim.ooms), bound) << "fits " << fits << " initial " << initial;
  }
}

TEST(SizeController, ForgetsBadSizeAndProbesAgain) {
  SizeControllerOptions o = Opts(100, 1, 1000, 1);
  o.forget_bad_after = 5;
  SizeController c(o);
  Sim sim;
  sim.Run(c, 100, 50);  // probes 200 -> OOM -> bisects down to ~100
  ASSERT_TRUE(c.bad().has_value() || c.limit() >= 95);
  // Memory frees up: more now fits. Forgetting `bad` lets it grow again.
  Sim more;
  more.Run(c, 400, 200);
  EXPECT_GE(c.limit(), 380);
}

TEST(SizeController, NoGrowthWhenStepsFitInOneMicroBatch) {
  SizeController c(Opts(64, 1, 1024, 1));
  for (int i = 0; i < 10; ++i) c.OnSuccess(30, false);
  EXPECT_EQ(c.limit(), 64);
  EXPECT_FALSE(c.probing());
}

TEST(SizeController, GrowAfterZeroNeverGrows) {
  SizeController c(Opts(64, 1, 1024, 0));
  for (int i = 0; i < 100; ++i) c.OnSuccess(64, true);
  EXPECT_EQ(c.limit(), 64);
}

TEST(SizeController, SetLimitClamps) {
  SizeController c(Opts(64, 8, 128));
  c.SetLimit(1000);
  EXPECT_EQ(c.limit(), 128);
  c.SetLimit(1);
  EXPECT_EQ(c.limit(), 8);
}

TEST(SizeController, AdoptedPriorIsNotReprobedUntilForgotten) {
  SizeControllerOptions o = Opts(4096, 1, 8192, 1);
  o.forget_bad_after = 50;
  SizeController c(o);
  c.AdoptPrior(300);
  EXPECT_EQ(c.limit(), 300);
  EXPECT_EQ(c.good(), 300);
  ASSERT_TRUE(c.bad().has_value());
  EXPECT_GT(*c.bad(), 300);
  for (int i = 0; i < 40; ++i) c.OnSuccess(300, true);
  EXPECT_EQ(c.limit(), 300) << "no probe while the learned failing size is remembered";
  for (int i = 0; i < 20; ++i) c.OnSuccess(c.limit(), true);
  EXPECT_GT(c.limit(), 300) << "probing resumes once it is forgotten";
}

TEST(SizeController, ValidatesOptions) {
  EXPECT_TRUE(ValidateSizeControllerOptions(Opts(4)).ok());
  Status s = ValidateSizeControllerOptions(Opts(4, 0));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("min"), std::string::npos);
  EXPECT_NE(s.message().find("got 0"), std::string::npos);
  EXPECT_FALSE(ValidateSizeControllerOptions(Opts(4, 8)).ok());
  SizeControllerOptions o = Opts(4);
  o.tolerance = 1.5;
  EXPECT_NE(ValidateSizeControllerOptions(o).message().find("tolerance"), std::string::npos);
}

}  // namespace
}  // namespace oomguard
