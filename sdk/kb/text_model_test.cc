#include "sdk/kb/text_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <string>

namespace oomguard::kb {
namespace {

TEST(TextModelTest, ProbabilitiesAreADistributionOverTheShippedClasses) {
  const auto& m = TextModel();
  ASSERT_TRUE(m.trained) << "sdk/kb/text_model_weights.inc holds no trained weights";
  const auto p = TextProbabilities("RuntimeError: DataLoader worker (pid 1620) is killed by signal: Killed.");
  ASSERT_EQ(p.size(), m.classes.size());
  EXPECT_NEAR(std::accumulate(p.begin(), p.end(), 0.0), 1.0, 1e-9);
  for (double v : p) EXPECT_GE(v, 0.0);
}

TEST(TextModelTest, CalibrationNeverFallsAsTheScoreRises) {
  double last = -1;
  for (double s = -0.5; s <= 2.5; s += 0.01) {
    const double c = CalibratedConfidence(s);
    EXPECT_GE(c, last - 1e-12) << s;
    EXPECT_GE(c, 0.0);
    EXPECT_LE(c, 1.0);
    last = c;
  }
}

TEST(TextModelTest, FeaturesAreNormalisedAndFoldCaseAndDigits) {
  const auto a = TextFeatures("CUDA out of memory. Tried to allocate 20.00 MiB", 4096);
  const auto b = TextFeatures("cuda out of memory. tried to allocate 31.50 mib", 4096);
  ASSERT_FALSE(a.empty());
  double norm = 0;
  for (const auto& [k, v] : a) norm += static_cast<double>(v) * v;
  EXPECT_NEAR(norm, 1.0, 1e-5);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_NEAR(a[i].second, b[i].second, 1e-6);
  }
}

// The training script computes the same features (scripts/train_text_model.py
// --self-check); a drift between the two would silently void the weights.
TEST(TextModelTest, FeaturesMatchTheTrainingScript) {
#ifndef OOMGUARD_TEST_PYTHON
  GTEST_SKIP() << "no Python interpreter configured";
#else
  const std::string text = "torch.OutOfMemoryError: CUDA out of memory in validate() 显存不足 _cuda_deserialize";
  const std::string cmd = std::string(OOMGUARD_TEST_PYTHON) + " " + OOMGUARD_SOURCE_DIR +
                          "/scripts/train_text_model.py --buckets " + std::to_string(TextModel().buckets) +
                          " --self-check '" + text + "' 2>/dev/null";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::map<int, double> py;
  int k;
  double v;
  while (std::fscanf(f, "%d %lf", &k, &v) == 2) py[k] = v;
  const int rc = pclose(f);
  if (rc != 0 && py.empty()) GTEST_SKIP() << "the training script did not run here (numpy missing?)";
  const auto cc = TextFeatures(text, TextModel().buckets);
  ASSERT_EQ(cc.size(), py.size());
  for (const auto& [bucket, value] : cc) {
    ASSERT_TRUE(py.count(bucket)) << bucket;
    EXPECT_NEAR(value, py[bucket], 1e-5) << bucket;
  }
#endif
}

// The script answers from the shipped weights (--probs) what the C++
// inference answers: the weights file is read the same way on both sides.
TEST(TextModelTest, ProbabilitiesMatchTheTrainingScript) {
#ifndef OOMGUARD_TEST_PYTHON
  GTEST_SKIP() << "no Python interpreter configured";
#else
  const std::string text =
      "# OOM after 3 epochs\nRuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB; memory keeps growing";
  const std::string cmd = std::string(OOMGUARD_TEST_PYTHON) + " " + OOMGUARD_SOURCE_DIR +
                          "/scripts/train_text_model.py --out " + OOMGUARD_SOURCE_DIR +
                          "/sdk/kb/text_model_weights.inc --probs '" + text + "' 2>/dev/null";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::map<std::string, double> py;
  char name[64];
  double v;
  while (std::fscanf(f, "%63s %lf", name, &v) == 2) py[name] = v;
  const int rc = pclose(f);
  if (rc != 0 && py.empty()) GTEST_SKIP() << "the training script did not run here (numpy missing?)";
  const auto& m = TextModel();
  const auto cc = TextProbabilities(text);
  ASSERT_EQ(py.size(), m.classes.size());
  for (size_t c = 0; c < cc.size(); ++c) {
    ASSERT_TRUE(py.count(m.classes[c])) << m.classes[c];
    EXPECT_NEAR(cc[c], py[m.classes[c]], 1e-5) << m.classes[c];
  }
#endif
}

}  // namespace
}  // namespace oomguard::kb
