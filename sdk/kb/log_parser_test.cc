#include "sdk/kb/log_parser.h"

#include <gtest/gtest.h>

#include <string>

#include "oomguard/knowledge_base.h"

namespace oomguard::kb {
namespace {

std::vector<Incident> Parse(const std::string& text, const std::string& name = "job.log") {
  LogParseOptions o;
  o.source_name = name;
  auto r = ParseOomLog(text, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<Incident>{};
}

const char* kJob =
    "[rank1]: step 1200 | loss 2.3990\n"
    "[rank1]: Traceback (most recent call last):\n"
    "[rank1]:   File \"/workspace/train.py\", line 187, in main\n"
    "[rank1]:     loss.backward()\n"
    "[rank1]:   File \"torch/autograd/__init__.py\", line 266, in backward\n"
    "[rank1]:     Variable._execution_engine.run_backward(\n"
    "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of "
    "23.65 GiB of which 1.66 GiB is free. Including non-PyTorch memory, this process has 20.81 GiB memory in use. "
    "Of the allocated memory 12.09 GiB is allocated by PyTorch, and 4.84 GiB is "
    "reserved by PyTorch but unallocated.\n"
    "[rank0]: step 1250 | loss 2.3871\n"
    "[2059991.491542] Out of memory: Killed process 25315 (python3) total-vm:53312244kB, anon-rss:31451456kB\n"
    "ng30903:3063028:3066152 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'\n"
    "ng30903:3063028:3066152 [3] include/alloc.h:185 NCCL WARN Failed to CUDA calloc 6291456 bytes\n";

TEST(LogParserTest, EveryOomOfAJobIsAnEventWithItsEvidence) {
  std::vector<Incident> incs = Parse(kJob);
  ASSERT_EQ(incs.size(), 3u);

  const Incident& torch = incs[0];
  EXPECT_EQ(torch.source, "job.log:7");
  EXPECT_EQ(torch.kind, IncidentKind::kDevice);
  EXPECT_EQ(torch.phase, Phase::kBackward);
  EXPECT_EQ(torch.rank, 1);
  EXPECT_TRUE(IsKnown(torch, "rank"));
  EXPECT_EQ(torch.step, 1200);
  EXPECT_TRUE(IsKnown(torch, "step"));
  EXPECT_EQ(torch.requested_bytes, int64_t{3} << 30);
  EXPECT_EQ(torch.exception_type, "torch.OutOfMemoryError");
  EXPECT_EQ(torch.message.rfind("torch.OutOfMemoryError", 0), 0u) << "the rank prefix is removed";
  EXPECT_NE(torch.context.find("loss.backward()"), std::string::npos);

  const Incident& killer = incs[1];
  EXPECT_EQ(killer.kind, IncidentKind::kHost);
  EXPECT_FALSE(IsKnown(killer, "rank"));
  EXPECT_EQ(killer.source, "job.log:9");

  const Incident& nccl = incs[2];
  EXPECT_EQ(nccl.kind, IncidentKind::kDevice);
  EXPECT_EQ(nccl.host, "ng30903");
  EXPECT_EQ(nccl.rank, 3);
  EXPECT_EQ(nccl.requested_bytes, 6291456) << "both NCCL lines are one event";

  // Classified, each gets a pattern that fits its evidence.
  Incident c = torch;
  ClassifyInPlace(&c);
  EXPECT_EQ(c.pattern, "fragmentation") << c.evidence;
  c = nccl;
  ClassifyInPlace(&c);
  EXPECT_EQ(c.pattern, "foreign_memory") << c.evidence;
  c = killer;
  ClassifyInPlace(&c);
  EXPECT_EQ(c.pattern, "host_memory") << c.evidence;
}

TEST(LogParserTest, IdsDependOnTextAndLineSoReimportingIsIdempotent) {
  std::vector<Incident> a = Parse(kJob), b = Parse(kJob, "copy-of-job.log");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].id, b[i].id);
  std::vector<Incident> shifted = Parse(std::string("one more line\n") + kJob);
  ASSERT_EQ(shifted.size(), a.size());
  EXPECT_NE(shifted[0].id, a[0].id);
  EXPECT_EQ(a[0].run_id, "job.log");
}

TEST(LogParserTest, OneFailurePrintedSeveralTimesIsOneEvent) {
  // A chained re-raise, and TensorFlow's allocator warning before its error.
  std::string chained =
      "Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n    x()\n"
      "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB\n\n"
      "During handling of the above exception, another exception occurred:\n\n"
      "Traceback (most recent call last):\n  File \"a.py\", line 9, in g\n    f()\n"
      "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB\n";
  EXPECT_EQ(Parse(chained).size(), 1u);
  std::string tf =
      "I tensorflow/core/common_runtime/bfc_allocator.cc:680] Stats: \nLimit:                 10625279591\n"
      "InUse:                  7350513920\n"
      "W tensorflow/core/common_runtime/bfc_allocator.cc:275] Allocator (GPU_0_bfc) ran out of memory trying to "
      "allocate 2.20GiB.\n"
      "W op_kernel.cc:1202] OP_REQUIRES failed : Resource exhausted: OOM when allocating tensor with shape[16,1024] "
      "and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc\n";
  std::vector<Incident> incs = Parse(tf);
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_NE(incs[0].message.find("Limit:"), std::string::npos) << "the allocator's limit travels with the message";
}

TEST(LogParserTest, TrainingProgressBetweenTwoOomsSeparatesThem) {
  std::string log =
      "2021-06-02 15:50:53 h root[1] DEBUG CUDA out of memory. Tried to allocate 422.00 MiB (GPU 0; 15.78 GiB total "
      "capacity; 13.10 GiB already allocated; 372.75 MiB free; 13.78 GiB reserved in total by PyTorch)\n"
      "2021-06-02 15:50:59 h root[1] INFO Iteration: 15/1184, epoch 0, loss: 0.0056\n"
      "2021-06-02 15:51:03 h root[1] DEBUG CUDA out of memory. Tried to allocate 422.00 MiB (GPU 0; 15.78 GiB total "
      "capacity; 13.10 GiB already allocated; 372.75 MiB free; 13.78 GiB reserved in total by PyTorch)\n";
  std::vector<Incident> incs = Parse(log);
  ASSERT_EQ(incs.size(), 2u);
  EXPECT_FALSE(IsKnown(incs[0], "step"));
  EXPECT_EQ(incs[1].step, 15);
  EXPECT_EQ(incs[1].time_unix_ms, 1622649063000);  // 2021-06-02 15:51:03 UTC
  EXPECT_EQ(incs[0].host, "h");
}

TEST(LogParserTest, HostSideFormats) {
  struct Case {
    const char* text;
    size_t events;
  } cases[] = {
      {"Epoch: [0][511/1736]\t Loss 0.51\n/var/spool/slurmd/job00191/slurm_script: line 28:  8156 Killed   "
       "python3 main.py\nslurmstepd: error: Detected 1 oom-kill event(s) in StepId=191.batch cgroup.\n",
       1},
      {"    Last State:     Terminated\n      Reason:       OOMKilled\n      Exit Code:    137\n", 1},
      {"Loading checkpoint shards:  38%|####      | 3/8 [00:02<00:03,  1.28it/s]Killed\n", 1},
      {"Process finished with exit code 137 (interrupted by signal 9: SIGKILL)\n", 1},
      {"RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed.\n", 1},
  };
  for (const Case& c : cases) {
    std::vector<Incident> incs = Parse(c.text);
    ASSERT_EQ(incs.size(), c.events) << c.text;
    EXPECT_EQ(incs[0].kind, IncidentKind::kHost) << c.text;
  }
  EXPECT_TRUE(Parse("Epoch: [0][511/1736]\t Loss 0.51\nKilled 3 zombie threads politely\n").empty());
}

TEST(LogParserTest, ADescriptionWithoutAnErrorRecordIsOneEvent) {
  std::vector<Incident> incs =
      Parse("In the process of training, GPU memory keeps increasing until out of memory. Can you fix it?\n"
            "It says out of memory again on the second run.\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kDevice);
  // A sentence quoting "out of memory" is not an error record of its own.
  incs = Parse("`fit()` fails with \"out of memory\" error:\n"
               "RuntimeError: cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/THCStorage.cu:58\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kDevice);
  EXPECT_EQ(incs[0].source, "job.log:2");
}

TEST(LogParserTest, NoOomNoEventsAndBadInputIsRejected) {
  EXPECT_TRUE(Parse("step 1 loss 2.0\nstep 2 loss 1.9\nmemory usage is fine\n").empty());
  LogParseOptions o;
  o.source_name = "weights.bin";
  auto r = ParseOomLog(std::string("PK\0\0binary", 10), o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("weights.bin: not a text log"), std::string::npos) << r.status();
  o.max_events = 1;
  r = ParseOomLog(kJob, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("3 OOM events"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace oomguard::kb
