// The classifier on real OOM reports (tests/kb/testdata/reports/): the floor
// the project holds it to. A case it gets wrong may only be wrong with
// confidence below 0.8, and at least 85% of the cases labelled with a pattern
// must be right. The cases labelled `unknown` (the report alone did not
// decide for whoever labelled it) are answered when the text model's
// validated floor says an answer is more often right than not (issue 25: the
// corpus labelled from resolutions shows most such reports resolve to a
// pattern); they count only against confident mistakes.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "tests/kb/dev_set.h"

namespace oomguard {
namespace {

const char* kDir = OOMGUARD_KB_TESTDATA "/reports";

TEST(DevSetTest, EveryCaseIsARealReportWithALabelAndAReason) {
  std::string error;
  std::vector<devset::Case> cases = devset::Load(kDir, &error);
  ASSERT_TRUE(error.empty()) << error;
  ASSERT_GE(cases.size(), 60u);
  std::set<std::string> patterns = {"unknown"};
  for (const auto& p : PatternCatalogue()) patterns.insert(p.name);
  std::set<std::string> labelled;
  for (const auto& c : cases) {
    EXPECT_EQ(c.source.rfind("https://", 0), 0u) << c.file << ": source must be an address";
    EXPECT_TRUE(patterns.count(c.label)) << c.file << ": label '" << c.label << "' is not a pattern";
    EXPECT_GE(c.why.size(), 20u) << c.file << ": say why in a sentence";
    EXPECT_FALSE(c.batch.empty()) << c.file;
    EXPECT_GE(c.text.size(), 30u) << c.file;
    labelled.insert(c.label);
  }
  // Every pattern of the catalogue has real reports behind it.
  for (const auto& p : PatternCatalogue()) EXPECT_TRUE(labelled.count(p.name)) << "no report labelled " << p.name;
}

TEST(DevSetTest, AccuracyFloorAndNoConfidentMistakes) {
  std::string error;
  std::vector<devset::Case> cases = devset::Load(kDir, &error);
  ASSERT_TRUE(error.empty()) << error;
  size_t right = 0, labelled = 0, unknown_right = 0, unknown = 0;
  std::map<std::string, int> misses;
  for (const auto& c : cases) {
    devset::Verdict v = devset::Diagnose(c);
    EXPECT_GE(v.events, 1u) << c.file << ": no OOM found in the report";
    const bool ok = v.pattern == c.label;
    if (c.label == "unknown") {
      ++unknown;
      unknown_right += ok;
    } else {
      ++labelled;
      right += ok;
    }
    if (ok) continue;
    ++misses[c.label + " -> " + v.pattern];
    EXPECT_LT(v.confidence, 0.8) << c.file << ": wrong (" << v.pattern << " for " << c.label
                                 << ") with confidence " << v.confidence << ": " << v.evidence;
  }
  ASSERT_GT(labelled, 0u);
  const double accuracy = static_cast<double>(right) / static_cast<double>(labelled);
  std::string summary;
  for (const auto& [k, n] : misses) summary += "\n  " + k + " x" + std::to_string(n);
  EXPECT_GE(accuracy, 0.85) << right << "/" << labelled << " right; misses:" << summary;
  std::printf("dev set: %zu/%zu labelled with a pattern right (%.1f%%); %zu/%zu labelled unknown left unknown%s\n",
              right, labelled, 100.0 * accuracy, unknown_right, unknown, summary.c_str());
}

}  // namespace
}  // namespace oomguard

namespace oomguard {
namespace {

const char* kCorpus = OOMGUARD_KB_TESTDATA "/corpus";

// The corpus labelled from resolutions (tests/kb/testdata/corpus/README.md).
TEST(CorpusTest, EveryRecordHasASourceALabelAResolutionAndASplitByRepository) {
  std::string error;
  std::vector<devset::Case> cases = devset::LoadCorpus(kCorpus, &error);
  ASSERT_TRUE(error.empty()) << error;
  ASSERT_GE(cases.size(), 60u);
  std::set<std::string> patterns;
  for (const auto& p : PatternCatalogue()) patterns.insert(p.name);
  std::map<std::string, std::string> split_of_repo;
  std::set<std::string> sources;
  for (const auto& c : cases) {
    EXPECT_EQ(c.source.rfind("https://", 0), 0u) << c.file;
    EXPECT_TRUE(sources.insert(c.source).second) << c.file << ": " << c.source << " twice";
    EXPECT_TRUE(patterns.count(c.label)) << c.file << ": label '" << c.label << "' is not a pattern";
    EXPECT_GE(c.why.size(), 20u) << c.file << ": say what resolved it in a sentence";
    EXPECT_GE(c.text.size(), 10u) << c.file;
    EXPECT_FALSE(c.repo.empty()) << c.file;
    auto [it, fresh] = split_of_repo.emplace(c.repo, c.split);
    EXPECT_EQ(it->second, c.split) << c.repo << " is in two splits";
  }
  std::set<std::string> splits;
  for (const auto& [repo, split] : split_of_repo) splits.insert(split);
  EXPECT_EQ(splits, (std::set<std::string>{"test", "train", "validation"}));
}

// Every report of the corpus describes an OOM, and diagnose finds it; on the
// test split (never trained or tuned on) the answers hold a floor below the
// measured figure (bench/RESULTS.md) and wrong answers at confidence >= 0.8
// are at most 3% of the split (issue 25's target).
TEST(CorpusTest, OomFoundEverywhereAndTheTestSplitHolds) {
  std::string error;
  std::vector<devset::Case> cases = devset::LoadCorpus(kCorpus, &error);
  ASSERT_TRUE(error.empty()) << error;
  size_t right = 0, total = 0, confident_wrong = 0;
  std::string wrong_list;
  for (const auto& c : cases) {
    devset::Verdict v = devset::Diagnose(c);
    EXPECT_GE(v.events, 1u) << c.file << " (" << c.source << "): no OOM found";
    if (c.split != "test") continue;
    ++total;
    if (v.pattern == c.label) {
      ++right;
    } else if (v.confidence >= 0.8) {
      ++confident_wrong;
      wrong_list += "\n  " + c.source + ": " + v.pattern + " for " + c.label;
    }
  }
  ASSERT_GT(total, 0u);
  // Issue 25's target, met since the calibration reads out-of-fold train
  // answers with validation's (2 of 116 wrong with batch 13, 21 answers at
  // >= 0.8; see bench/RESULTS.md): at most 3% of the split.
  EXPECT_LE(static_cast<double>(confident_wrong), 0.03 * static_cast<double>(total))
      << confident_wrong << " of " << total << " wrong at confidence >= 0.8:" << wrong_list;
  const double accuracy = static_cast<double>(right) / static_cast<double>(total);
  EXPECT_GE(accuracy, 0.6) << right << "/" << total << " right on the test split";
  std::printf("corpus test split: %zu/%zu right (%.1f%%)\n", right, total, 100.0 * accuracy);
}

}  // namespace
}  // namespace oomguard
