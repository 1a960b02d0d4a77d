#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/classifier_facts.h"
#include "sdk/kb/text_model.h"

namespace oomguard {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

Incident Base() {
  Incident i;
  i.id = "t";
  i.kind = IncidentKind::kDevice;
  i.phase = Phase::kForward;
  i.step = 100;
  i.steps_ok_before = 50;
  i.memory.total = 16 * kGiB;
  i.memory.reserved = 15 * kGiB;
  i.memory.allocated = 15 * kGiB - kGiB / 2;
  i.memory.free = kGiB / 2;
  i.requested_bytes = 2 * kGiB;
  return i;
}

// An incident as the log importer makes it: a message, its context, nothing else known.
Incident Imported(std::string message, std::string context = "") {
  Incident i;
  i.id = "imported";
  i.message = std::move(message);
  i.context = std::move(context);
  i.phase = Phase::kUnknown;
  i.unknown = {"step", "steps_ok_before", "rank"};
  return i;
}

bool Has(const std::string& hay, const char* needle) { return hay.find(needle) != std::string::npos; }

TEST(ClassifierTest, CatalogueHasFourteenPatternsWithRemedies) {
  std::set<std::string> names;
  for (const auto& p : PatternCatalogue()) {
    names.insert(p.name);
    EXPECT_GE(p.remedies.size(), 3u) << p.name;
    EXPECT_FALSE(p.rule.empty()) << p.name;
    EXPECT_FALSE(p.signal.empty()) << p.name;
  }
  EXPECT_EQ(names, (std::set<std::string>{"startup_capacity", "activation_spike", "gradual_growth", "fragmentation",
                                           "rank_imbalance", "optimizer_state", "host_dataloader",
                                           "checkpoint_staging", "workspace", "foreign_memory", "eval_without_no_grad",
                                           "checkpoint_load", "host_memory", "impossible_request"}));
}

TEST(ClassifierTest, NoSignalIsUnknownWithLowConfidence) {
  Incident i = Base();
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "unknown");
  EXPECT_LT(c.confidence, 0.5);
  EXPECT_FALSE(c.remedies.empty());
  EXPECT_TRUE(Has(c.evidence, "Missing:")) << c.evidence;
}

TEST(ClassifierTest, FirstStepIsStartupCapacity) {
  Incident i = Base();
  i.step = 0;
  i.steps_ok_before = 0;
  EXPECT_EQ(ClassifyIncident(i).pattern, "startup_capacity");
  i.phase = Phase::kOptimizer;  // the first optimizer step is the more specific rule
  EXPECT_EQ(ClassifyIncident(i).pattern, "optimizer_state");
}

// The guard records an OOM in the sync buffers, at the vote or in the
// gradient sum as phase "commit": gradients and communication buffers, not
// the optimizer's state, whatever the step.
TEST(ClassifierTest, SyncAndVoteOomsAreNotOptimizerState) {
  Incident i = Base();
  i.phase = Phase::kCommit;
  for (int64_t step : {0, 1, 100}) {
    i.step = step;
    i.steps_ok_before = step == 0 ? 0 : step;
    Classification c = ClassifyIncident(i);
    EXPECT_NE(c.pattern, "optimizer_state") << "step " << step << ": " << c.evidence;
  }
  i.step = 0;
  i.steps_ok_before = 0;
  EXPECT_EQ(ClassifyIncident(i).pattern, "startup_capacity") << "the step's own buffers do not fit from the start";
}

TEST(ClassifierTest, OomRightAfterTheFirstOptimizerStepIsOptimizerState) {
  // Adam creates its moments in the first optimizer step, so the second
  // iteration's forward is the first to run beside them.
  Incident i = Base();
  i.step = 1;
  i.steps_ok_before = 1;
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "optimizer_state") << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "exactly one step completed")) << c.evidence;
  i.step = 100;
  i.steps_ok_before = 50;
  EXPECT_NE(ClassifyIncident(i).pattern, "optimizer_state");
}

TEST(ClassifierTest, AbsentStepIsNotStepZero) {
  // The same figures as a first-step incident, but the step is unknown: no
  // step-based pattern, and the evidence names what is missing.
  Incident i = Base();
  i.step = 0;
  i.steps_ok_before = 0;
  i.unknown = {"step", "steps_ok_before"};
  Classification c = ClassifyIncident(i);
  EXPECT_NE(c.pattern, "startup_capacity") << c.evidence;
  EXPECT_NE(c.pattern, "optimizer_state") << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "the step it failed at")) << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "how many steps ran before")) << c.evidence;

  // Only a message: the figures are read from it, nothing else is assumed.
  c = ClassifyIncident(Imported(
      "CUDA out of memory. Tried to allocate 240.00 MiB (GPU 0; 14.76 GiB total capacity; 13.54 GiB already "
      "allocated; 73.75 MiB free; 13.63 GiB reserved in total by PyTorch)"));
  EXPECT_EQ(c.pattern, "unknown") << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "13.5 GiB of the 14.8 GiB device is in live tensors")) << c.evidence;
  EXPECT_FALSE(Has(c.evidence, "the failing request alone")) << c.evidence;  // 240 MiB is 1.6%

  // A request of a large share of the device is pointed out, not classified.
  c = ClassifyIncident(Imported(
      "CUDA out of memory. Tried to allocate 6.00 GiB (GPU 0; 10.00 GiB total capacity; 3.40 GiB already "
      "allocated; 5.90 GiB free; 3.50 GiB reserved in total by PyTorch)"));
  EXPECT_EQ(c.pattern, "unknown") << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "the failing request alone is 6.0 GiB (60% of the device)")) << c.evidence;
}

TEST(ClassifierTest, SpikeNeedsCostRatioAboveThreshold) {
  Incident i = Base();
  i.sample_cost_median = 1000;
  i.sample_cost_this = 1400;  // 1.4x: below 1.5x
  EXPECT_NE(ClassifyIncident(i).pattern, "activation_spike");
  i.sample_cost_this = 4000;
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "activation_spike");
  EXPECT_TRUE(Has(c.evidence, "4x")) << c.evidence;
  bool bucketing = false;
  for (const auto& r : c.remedies) bucketing |= r.find("length") != std::string::npos;
  EXPECT_TRUE(bucketing);
}

TEST(ClassifierTest, FragmentationEvidenceNamesTheShareOfReserved) {
  Incident i = Base();
  i.memory.allocated = 10 * kGiB;
  i.memory.reserved = 15 * kGiB;  // 5 GiB cached free = 33% of reserved
  i.memory.inactive_split = 4 * kGiB;
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "fragmentation");
  EXPECT_TRUE(Has(c.evidence, "33% of the 15.0 GiB reserved")) << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "request of 2.0 GiB")) << c.evidence;
  // The same request with little cached free memory is not fragmentation.
  i.memory.allocated = 15 * kGiB - kGiB / 4;
  i.memory.inactive_split = 0;
  EXPECT_NE(ClassifyIncident(i).pattern, "fragmentation");
}

TEST(ClassifierTest, FragmentationThresholdsFollowTheRequestNotTheDevice) {
  // 3.9 GiB stranded on an 80 GiB device against a 250 MiB request: 5% of
  // capacity, missed by a capacity-relative threshold.
  Incident i = Base();
  i.memory.total = 80 * kGiB;
  i.memory.reserved = 78 * kGiB;
  i.memory.allocated = 78 * kGiB - 3900 * kMiB;
  i.memory.free = 100 * kMiB;
  i.requested_bytes = 250 * kMiB;
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "fragmentation") << c.evidence;
  EXPECT_GE(c.confidence, 0.6);
  // A few hundred MiB of allocator slack on a full device is rounding, not
  // fragmentation, even when it exceeds a small request.
  i.memory.total = 11 * kGiB;
  i.memory.reserved = 10 * kGiB + 100 * kMiB;
  i.memory.allocated = 10 * kGiB - 200 * kMiB;
  i.memory.free = 10 * kMiB;
  i.requested_bytes = 20 * kMiB;
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
  i.kind = IncidentKind::kDevice;
  i.phase = Phase::kForward;
  i.steps_ok_before = 3;
  i.step = 4;
  i.message =
      "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB of which 5.56 MiB "
      "is free. Of the allocated memory 40.00 GiB is allocated by PyTorch, and 800.00 MiB is reserved by PyTorch "
      "but unallocated.";
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "foreign_memory") << c.evidence;
}

TEST(ClassifierTest, LegacyCachedFigureIsTheFreeCacheNotTheReservedTotal) {
  // Read as "reserved = 300 MiB", 10 GiB would look like another process's.
  Incident i = Imported(
      "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.92 GiB total capacity; 9.80 GiB "
      "already allocated; 10.00 MiB free; 300.00 MiB cached)");
  EXPECT_NE(ClassifyIncident(i).pattern, "foreign_memory") << ClassifyIncident(i).evidence;
  i.message =
      "RuntimeError: CUDA out of memory. Tried to allocate 352.00 MiB (GPU 0; 7.92 GiB total capacity; 1.67 GiB "
      "already allocated; 156.00 MiB free; 124.28 MiB cached)";
  EXPECT_EQ(ClassifyIncident(i).pattern, "foreign_memory");
}

TEST(ClassifierTest, AProcessListedUnderAnotherPidCanBeThisOne) {
  // In a container NVML shows this process under a host pid: 15.25 GiB in use
  // against 14.45 GiB reserved is itself, not a neighbour.
  Classification c = ClassifyIncident(Imported(
      "CUDA out of memory. Tried to allocate 546.00 MiB. GPU 0 has a total capacity of 15.77 GiB of which 514.19 MiB "
      "is free. Process 562167 has 15.25 GiB memory in use. Of the allocated memory 13.73 GiB is allocated by "
      "PyTorch, and 736.86 MiB is reserved by PyTorch but unallocated."));
  EXPECT_NE(c.pattern, "foreign_memory") << c.evidence;
  c = ClassifyIncident(Imported(
      "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.69 GiB of which 1.56 MiB is "
      "free. Process 2235 has 10.64 GiB memory in use. Including non-PyTorch memory, this process has 13.04 GiB "
      "memory in use. Of the allocated memory 12.20 GiB is allocated by PyTorch, and 100.00 MiB is reserved by "
      "PyTorch but unallocated."));
  EXPECT_EQ(c.pattern, "foreign_memory") << c.evidence;
  EXPECT_GE(c.confidence, 0.8);
}

TEST(ClassifierTest, ImpossibleRequestIsABugNotCapacity) {
  Classification c = ClassifyIncident(Imported(
      "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 243.00 GiB (GPU 0; 15.99 GiB total "
      "capacity; 13.51 GiB already allocated; 0 bytes free; 15.91 GiB reserved in total by PyTorch)"));
  EXPECT_EQ(c.pattern, "impossible_request");
  EXPECT_GE(c.confidence, 0.8);
  // No capacity printed: beyond the largest device there is, it is a size bug.
  c = ClassifyIncident(Imported("RuntimeError: CUDA out of memory. Tried to allocate 243.00 GiB"));
  EXPECT_EQ(c.pattern, "impossible_request") << c.evidence;
  EXPECT_NE(ClassifyIncident(Imported("RuntimeError: CUDA out of memory. Tried to allocate 120.00 GiB")).pattern,
            "impossible_request");
  c = ClassifyIncident(Imported("CUDA out of memory. Tried to allocate more than 1EB memory."));
  EXPECT_EQ(c.pattern, "impossible_request");
  EXPECT_TRUE(Has(c.evidence, "more than 1 EB")) << c.evidence;
  // A request a little over the device is a capacity question, not a bug.
  Incident i = Base();
  i.requested_bytes = 20 * kGiB;
  EXPECT_NE(ClassifyIncident(i).pattern, "impossible_request");
}

TEST(ClassifierTest, EvaluationWithoutNoGradNeedsNoSignOfNoGrad) {
  const std::string msg = "RuntimeError: CUDA error: out of memory";
  std::string ctx =
      "Traceback (most recent call last):\n  File \"train.py\", line 349, in <module>\n    main()\n"
      "  File \"train.py\", line 282, in validate\n    scores_copy = scores.clone()\n" + msg + "\n";
  Classification c = ClassifyIncident(Imported(msg, ctx));
  EXPECT_EQ(c.pattern, "eval_without_no_grad") << c.evidence;
  // The same failure under @torch.no_grad() (decorate_context) is not it.
  ctx = "Traceback (most recent call last):\n  File \"train.py\", line 349, in <module>\n    main()\n"
        "  File \"/usr/lib/python3/site-packages/torch/utils/_contextlib.py\", line 115, in decorate_context\n"
        "    return func(*args, **kwargs)\n  File \"train.py\", line 282, in validate\n    scores_copy = "
        "scores.clone()\n" + msg + "\n";
  EXPECT_NE(ClassifyIncident(Imported(msg, ctx)).pattern, "eval_without_no_grad");
}

TEST(ClassifierTest, EvaluationRecordedWithAutogradOnOrOff) {
  Incident i = Base();
  i.phase = Phase::kEval;
  i.memory.reserved = i.memory.allocated;  // no cached slack: fragmentation stays out of it
  Classification c = ClassifyIncident(i);
  EXPECT_NE(c.pattern, "eval_without_no_grad") << "the phase alone does not say gradients were on";
  i.framework.grad_recording = true;
  c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "eval_without_no_grad") << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "recording autograd graphs")) << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "autograd recording at the OOM")) << c.evidence;
  i.framework.grad_recording = false;
  c = ClassifyIncident(i);
  EXPECT_NE(c.pattern, "eval_without_no_grad") << c.evidence;
  // Off in evaluation rules the pattern out whatever a description says.
  std::vector<std::string_view> out = kb::RuledOut(i);
  EXPECT_NE(std::find(out.begin(), out.end(), "eval_without_no_grad"), out.end());
  // Recording in a training phase is normal: no evidence for it.
  i.phase = Phase::kForward;
  i.framework.grad_recording = true;
  EXPECT_NE(ClassifyIncident(i).pattern, "eval_without_no_grad");
}

TEST(ClassifierTest, AnEpochOrManyStepsBeforeTheOomRuleOutStartupCapacity) {
  auto ruled_out_startup = [](const char* text) {
    Incident i = Imported(text);
    std::vector<std::string_view> out = kb::RuledOut(i);
    return std::find(out.begin(), out.end(), "startup_capacity") != out.end();
  };
  EXPECT_TRUE(ruled_out_startup("RuntimeError: CUDA out of memory. It trained fine for 100 epochs before this."));
  EXPECT_TRUE(ruled_out_startup("RuntimeError: CUDA out of memory after 5000 iterations."));
  // A few steps, or nothing said about progress, leave it open.
  EXPECT_FALSE(ruled_out_startup("RuntimeError: CUDA out of memory after 3 steps."));
  EXPECT_FALSE(ruled_out_startup("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"));
  Incident i = Base();
  i.steps_ok_before = 500;
  std::vector<std::string_view> out = kb::RuledOut(i);
  EXPECT_NE(std::find(out.begin(), out.end(), "startup_capacity"), out.end());
  i.steps_ok_before = 0;
  out = kb::RuledOut(i);
  EXPECT_EQ(std::find(out.begin(), out.end(), "startup_capacity"), out.end());
}

TEST(ClassifierTest, CopiesOfTheModelStateAreACheckpointBesideTheModel) {
  Incident i = Base();
  i.memory.reserved = i.memory.allocated;
  i.step = 0;
  i.steps_ok_before = 0;
  EXPECT_EQ(ClassifyIncident(i).pattern, "startup_capacity");
  // 3 GiB of copies, while the request lacks 1.5 GiB: without them it fits.
  i.framework.state_copy_bytes = 3 * kGiB;
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "checkpoint_load") << c.evidence;
  EXPECT_GE(c.confidence, 0.85) << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "request would fit")) << c.evidence;
  // A few copied buffers (under 10% of what is allocated, short of the shortfall) decide nothing.
  i.framework.state_copy_bytes = 64 * kMiB;
  EXPECT_EQ(ClassifyIncident(i).pattern, "startup_capacity");
  // Host memory is host_memory's, copies or not.
  i.kind = IncidentKind::kHost;
  i.framework.state_copy_bytes = 3 * kGiB;
  EXPECT_NE(ClassifyIncident(i).pattern, "checkpoint_load");
}

TEST(ClassifierTest, CheckpointLoadOnTheDeviceButHostMemoryOnTheHost) {
  const std::string ctx =
      "Traceback (most recent call last):\n  File \"demo.py\", line 124, in <module>\n    checkpoint = "
      "torch.load(args.checkpoint)\n  File \"site-packages/torch/serialization.py\", line 135, in "
      "_cuda_deserialize\n    return storage_type(obj.size())\nRuntimeError: CUDA error: out of memory\n";
  Incident i = Imported("RuntimeError: CUDA error: out of memory", ctx);
  Classification c = ClassifyIncident(i);
  EXPECT_EQ(c.pattern, "checkpoint_load") << c.evidence;
  EXPECT_TRUE(Has(c.evidence, "_cuda_deserialize")) << c.evidence;
  i.message = "RuntimeError: [enforce fail at alloc_cpu.cpp:75] DefaultCPUAllocator: can't allocate memory: you tried "
              "to allocate 123456 bytes.";
  i.context = ctx;
  EXPECT_EQ(ClassifyIncident(i).pattern, "host_memory");
}

TEST(ClassifierTest, HostMemoryInOrOutsideTheDataPipeline) {
  EXPECT_EQ(ClassifyIncident(Imported("RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed."))
                .pattern,
            "host_dataloader");
  Incident bare = Imported("Out of memory: Killed process 25315 (python3) total-vm:53312244kB, anon-rss:31451456kB");
  Classification c = ClassifyIncident(bare);
  EXPECT_EQ(c.pattern, "host_memory");
  EXPECT_LE(c.confidence, 0.5);  // nothing says where the memory went
  Incident killed = Imported("Killed", "Loading checkpoint shards:  38%|###       | 3/8 [00:02<00:03]Killed\n");
  killed.kind = IncidentKind::kHost;  // the importer's reading of a bare "Killed"
  c = ClassifyIncident(killed);
  EXPECT_EQ(c.pattern, "host_memory");
  EXPECT_GE(c.confidence, 0.7);
}

TEST(ClassifierTest, NcclOutOfMemoryIsForeignMemory) {
  Incident i = Imported("ng30903:3063028:3066152 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'");
  i.kind = IncidentKind::kDevice;
  EXPECT_EQ(ClassifyIncident(i).pattern, "foreign_memory");
}

TEST(ClassifierTest, ProgressAndDescriptionsDecideWhenFiguresCannot) {
  // Logged progress at 0/N: the first step.
  Classification c = ClassifyIncident(Imported(
      "RuntimeError: CUDA out of memory.", "INFO: Train epoch: 0 [0/795]\tAvg. Loss: 3.751\nRuntimeError: CUDA out of "
                                           "memory.\n"));
  EXPECT_EQ(c.pattern, "startup_capacity") << c.evidence;
  // Memory said to keep growing over epochs.
  c = ClassifyIncident(Imported("CUDA out of memory", "I am unable to train for more than ~2 epochs. Tracking the GPU "
                                                      "memory a slow and steady increase is visible.\nCUDA out of "
                                                      "memory\n"));
  EXPECT_EQ(c.pattern, "gradual_growth") << c.evidence;
  // A description is weaker evidence than figures: 0.8 or more only where the
  // calibration holds a step that validation showed right 95% of the time.
  if (c.confidence >= 0.8) {
    ASSERT_FALSE(kb::TextModel().calibration.empty());
    EXPECT_GE(kb::TextModel().calibration.back().second, 0.95) << c.evidence;
  }
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
