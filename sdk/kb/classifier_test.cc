#include <gtest/gtest.h>

#include <set>

#include "oomguard/knowledge_base.h"

namespace oomguard {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

Incident Base() {
  Incident i;
  i.id = "t";
  i.kind = "device";
  i.phase = "forward";
  i.step = 100;
  i.steps_ok_before = 50;
  i.memory.total = 16 * kGiB;
  i.memory.reserved = 15 * kGiB;
  i.memory.allocated = 15 * kGiB - kGiB / 2;
  i.memory.free = kGiB / 2;
  i.requested_bytes = 2 * kGiB;
  return i;
}

TEST(ClassifierTest, CatalogueHasTenPatternsWithRemedies) {
  std::set<std::string> names;
  for (const auto& p : PatternCatalogue()) {
    names.insert(p.name);
    EXPECT_GE(p.remedies.size(), 3u) << p.name;
    EXPECT_FALSE(p.rule.empty()) << p.name;
  }
  EXPECT_EQ(names, (std::set<std::string>{"startup_capacity", "activation_spike", "gradual_growth", "fragmentation",
                                           "rank_imbalance", "optimizer_state", "host_dataloader",
                                           "checkpoint_staging", "workspace", "foreign_memory"}));
}

TEST(ClassifierTest, NoSignalIsUnknownWithLowConfidence) {
  Incident i = Base();
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "unknown");
  EXPECT_LT(c.confidence, 0.5);
  EXPECT_FALSE(c.remedies.empty());
}

TEST(ClassifierTest, FirstStepIsStartupCapacity) {
  Incident i = Base();
  i.step = 0;
  i.steps_ok_before = 0;
  EXPECT_EQ(ClassifyIncident(i).pattern, "startup_capacity");
  i.phase = "optimizer";  // the first optimizer step is the more specific rule
  EXPECT_EQ(ClassifyIncident(i).pattern, "optimizer_state");
}

TEST(ClassifierTest, SpikeNeedsCostRatioAboveThreshold) {
  Incident i = Base();
  i.sample_cost_median = 1000;
  i.sample_cost_this = 1400;  // 1.4x: below 1.5x
  EXPECT_NE(ClassifyIncident(i).pattern, "activation_spike");
  i.sample_cost_this = 4000;
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "activation_spike");
  EXPECT_NE(c.evidence.find("4x"), std::string::npos) << c.evidence;
  bool bucketing = false;
  for (const auto& r : c.remedies) bucketing |= r.find("length") != std::string::npos;
  EXPECT_TRUE(bucketing);
}

TEST(ClassifierTest, FragmentationEvidenceNamesTheShareOfCapacity) {
  Incident i = Base();
  i.memory.allocated = 10 * kGiB;
  i.memory.reserved = 15 * kGiB;  // 5 GiB slack = 31% of 16 GiB
  i.memory.inactive_split = 4 * kGiB;
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "fragmentation");
  EXPECT_NE(c.evidence.find("31% of capacity"), std::string::npos) << c.evidence;
  EXPECT_NE(c.evidence.find("2.0 GiB"), std::string::npos) << c.evidence;
  // The same request with little slack is not fragmentation.
  i.memory.allocated = 15 * kGiB - kGiB / 4;
  i.memory.inactive_split = 0;
  EXPECT_NE(ClassifyIncident(i).pattern, "fragmentation");
}

TEST(ClassifierTest, GrowthNeedsRisingPeaks) {
  Incident i = Base();
  for (int k = 0; k < 12; ++k) i.step_peaks.push_back(8 * kGiB + k * (kGiB / 8));
  EXPECT_EQ(ClassifyIncident(i).pattern, "gradual_growth");
  std::vector<int64_t> flat(12, 8 * kGiB);
  i.step_peaks = flat;
  EXPECT_NE(ClassifyIncident(i).pattern, "gradual_growth");
  // Noisy but not rising: alternating up/down.
  for (int k = 0; k < 12; ++k) i.step_peaks[static_cast<size_t>(k)] = 8 * kGiB + (k % 2) * kGiB;
  EXPECT_NE(ClassifyIncident(i).pattern, "gradual_growth");
}

TEST(ClassifierTest, RankImbalanceFromRankFigures) {
  Incident i = Base();
  i.world_size = 2;
  i.ranks = {{0, 15 * kGiB, 15 * kGiB, 15 * kGiB}, {1, 9 * kGiB, 9 * kGiB, 9 * kGiB}};
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "rank_imbalance");
  EXPECT_GE(c.confidence, 0.8);  // the failing rank (0) is the heaviest
  i.ranks[1].peak_allocated = 14 * kGiB;  // 7% spread: balanced
  EXPECT_NE(ClassifyIncident(i).pattern, "rank_imbalance");
}

TEST(ClassifierTest, MessageFillsMissingFigures) {
  Incident i;
  i.kind = "device";
  i.phase = "forward";
  i.steps_ok_before = 3;
  i.step = 4;
  i.message =
      "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB of which 5.56 MiB "
      "is free. Of the allocated memory 40.00 GiB is allocated by PyTorch, and 800.00 MiB is reserved by PyTorch "
      "but unallocated.";
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "foreign_memory") << c.evidence;
}

TEST(ClassifierTest, FingerprintIgnoresStepRankAndExactBytes) {
  Incident a = Base();
  ClassifyInPlace(&a);
  Incident b = a;
  b.step = 9999;
  b.rank = 7;
  b.requested_bytes = a.requested_bytes + 12345;  // same log2 bucket
  b.id = "other";
  EXPECT_EQ(IncidentFingerprint(a), IncidentFingerprint(b));
  b.requested_bytes = a.requested_bytes * 4;  // another bucket
  EXPECT_NE(IncidentFingerprint(a), IncidentFingerprint(b));
  b = a;
  b.workload = "other-model";
  EXPECT_NE(IncidentFingerprint(a), IncidentFingerprint(b));
  EXPECT_EQ(a.fingerprint.size(), 16u);
}

}  // namespace
}  // namespace oomguard
