// Each message format the SDK reads, parsed into its figures. The messages are
// quoted from public reports (tests/kb/testdata/reports/ has their sources).
#include "sdk/memory/oom_message.h"

#include <gtest/gtest.h>

#include <cmath>

#include "oomguard/oom.h"

namespace oomguard::internal {
namespace {

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * kKiB;
constexpr int64_t kGiB = 1024 * kMiB;

int64_t Gi(double v) { return static_cast<int64_t>(std::llround(v * static_cast<double>(kGiB))); }
int64_t Mi(double v) { return static_cast<int64_t>(std::llround(v * static_cast<double>(kMiB))); }

TEST(OomFiguresTest, PyTorch2WithProcessesAndMisspelledCapacity) {
  OomFigures f = ParseOomFigures(
      "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB. GPU 0 has a total capacty "
      "of 15.90 GiB of which 8.44 MiB is free. Process 1246069 has 577.00 MiB memory in use. Including "
      "non-PyTorch memory, this process has 15.32 GiB memory in use. Of the allocated memory 14.12 GiB is "
      "allocated by PyTorch, and 410.41 MiB is reserved by PyTorch but unallocated.");
  EXPECT_EQ(f.format, "pytorch");
  EXPECT_EQ(f.device, "cuda");
  EXPECT_EQ(f.device_index, 0);
  EXPECT_EQ(f.requested, Mi(138));
  EXPECT_EQ(f.capacity, Gi(15.90));
  EXPECT_EQ(f.free, Mi(8.44));
  EXPECT_EQ(f.process_in_use, Gi(15.32));
  ASSERT_EQ(f.other_processes.size(), 1u);
  EXPECT_EQ(f.other_processes[0].pid, 1246069);
  EXPECT_EQ(f.other_processes[0].bytes, Mi(577));
  EXPECT_EQ(f.allocated, Gi(14.12));
  EXPECT_EQ(f.reserved, Gi(14.12) + Mi(410.41));
  EXPECT_EQ(f.cached_free(), Mi(410.41));
}

TEST(OomFiguresTest, PyTorch2PrivatePoolsAndSeveralProcesses) {
  OomFigures f = ParseOomFigures(
      "CUDA out of memory. Tried to allocate 546.00 MiB. GPU 0 has a total capacity of 15.77 GiB of which "
      "514.19 MiB is free. Process 562167 has 15.25 GiB memory in use. Process 7 has 1.19 GiB memory in use. Of "
      "the allocated memory 13.73 GiB is allocated by PyTorch, with 46.00 MiB allocated in private pools (e.g., "
      "CUDA Graphs), and 736.86 MiB is reserved by PyTorch but unallocated.");
  EXPECT_EQ(f.requested, Mi(546));
  EXPECT_EQ(f.free, Mi(514.19));
  ASSERT_EQ(f.other_processes.size(), 2u);
  EXPECT_EQ(f.other_processes_total(), Gi(15.25) + Gi(1.19));
  EXPECT_FALSE(f.process_in_use.has_value());  // not printed: stays unknown
  EXPECT_EQ(f.reserved, Gi(13.73) + Mi(736.86));
}

TEST(OomFiguresTest, PyTorch1ReservedInTotal) {
  OomFigures f = ParseOomFigures(
      "RuntimeError: CUDA out of memory. Tried to allocate 2.93 GiB (GPU 0; 23.80 GiB total capacity; 12.04 GiB "
      "already allocated; 2.82 GiB free; 19.69 GiB reserved in total by Pytorch)");
  EXPECT_EQ(f.format, "pytorch-1.x");
  EXPECT_EQ(f.requested, Gi(2.93));
  EXPECT_EQ(f.capacity, Gi(23.80));
  EXPECT_EQ(f.allocated, Gi(12.04));
  EXPECT_EQ(f.free, Gi(2.82));
  EXPECT_EQ(f.reserved, Gi(19.69));
  EXPECT_TRUE(f.other_processes.empty());
}

TEST(OomFiguresTest, PyTorch1WrappedOverLinesWithoutParenthesis) {
  // nanoGPT #236 prints "GPU 0;" on its own line; rich consoles wrap mid-figure.
  OomFigures f = ParseOomFigures(
      "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB \nGPU 0; 8.00 GiB total "
      "capacity; 7.20 GiB already allocated; 0 bytes free; 7.30 GiB reserved in total by PyTorch");
  EXPECT_EQ(f.capacity, Gi(8));
  EXPECT_EQ(f.free, 0);  // printed as "0 bytes": known, and zero
  EXPECT_EQ(f.reserved, Gi(7.30));
  f = ParseOomFigures(
      "RuntimeError: CUDA out of memory. Tried to allocate 162.00 MiB (GPU 2; 79.35 GiB\ntotal capacity; 77.00 "
      "GiB already allocated; 146.19 MiB free; 77.01 GiB reserved\nin total by PyTorch)");
  EXPECT_EQ(f.device_index, 2);
  EXPECT_EQ(f.capacity, Gi(79.35));
  EXPECT_EQ(f.reserved, Gi(77.01));
}

TEST(OomFiguresTest, PyTorchUpTo13CachedIsTheFreeCache) {
  // "X cached" is cached minus allocated in PyTorch <= 1.3; reading it as the
  // reserved total made most of the device look like another process's.
  OomFigures f = ParseOomFigures(
      "RuntimeError: CUDA out of memory. Tried to allocate 352.00 MiB (GPU 0; 7.92 GiB total capacity; 1.67 GiB "
      "already allocated; 156.00 MiB free; 124.28 MiB cached)");
  EXPECT_EQ(f.format, "pytorch-cached");
  EXPECT_EQ(f.allocated, Gi(1.67));
  EXPECT_EQ(f.reserved, Gi(1.67) + Mi(124.28));
  EXPECT_EQ(f.free, Mi(156));
}

TEST(OomFiguresTest, NpuMessageIsDeviceMemory) {
  const char* msg =
      "RuntimeError: NPU out of memory. Tried to allocate 5.03 GiB (NPU 3; 60.96 GiB total capacity; 49.47 GiB "
      "already allocated; 49.47 GiB current active; 1.32 GiB free; 57.55 GiB reserved in total by PyTorch)";
  OomFigures f = ParseOomFigures(msg);
  EXPECT_EQ(f.device, "npu");
  EXPECT_EQ(f.device_index, 3);
  EXPECT_EQ(f.allocated, Gi(49.47));
  EXPECT_EQ(f.reserved, Gi(57.55));
  EXPECT_EQ(ClassifyMessage(msg).kind, OomKind::kDevice);
}

TEST(OomFiguresTest, TensorFlowShapeAndBfcStats) {
  OomFigures f = ParseOomFigures(
      "I tensorflow/core/common_runtime/bfc_allocator.cc:680] Stats: \nLimit:                 10625279591\n"
      "InUse:                  7350513920\nMaxInUse:               7464792320\n"
      "OP_REQUIRES failed at tile_ops.cc:123 : Resource exhausted: OOM when allocating tensor with "
      "shape[16,1,892800,8,4,2,2] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator "
      "GPU_0_bfc");
  EXPECT_EQ(f.format, "tensorflow");
  EXPECT_EQ(f.device, "cuda");
  EXPECT_EQ(f.device_index, 0);
  EXPECT_EQ(f.requested, int64_t{16} * 892800 * 8 * 4 * 2 * 2 * 4);
  EXPECT_EQ(f.capacity, 10625279591);
  EXPECT_EQ(f.allocated, 7350513920);
  EXPECT_FALSE(f.reserved.has_value());
}

TEST(OomFiguresTest, XlaRequestAndProgramTotal) {
  const char* msg =
      "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
      "4770354232 bytes.\nBufferAssignment OOM Debugging.\nBufferAssignment stats:\n parameter allocation: "
      "372.76MiB\n total allocation: 14.44GiB\n total fragmentation: 680.30MiB (4.60%)";
  OomFigures f = ParseOomFigures(msg);
  EXPECT_EQ(f.format, "xla");
  EXPECT_EQ(f.requested, 4770354232);
  EXPECT_EQ(f.program_total, Gi(14.44));
  EXPECT_EQ(ClassifyMessage(msg).kind, OomKind::kDevice);
  EXPECT_EQ(ParseOomFigures("RESOURCE_EXHAUSTED: Out of memory allocating 20029400304 bytes.").requested,
            20029400304);
}

TEST(OomFiguresTest, NcclAndCublasAndCudnn) {
  EXPECT_EQ(ClassifyMessage("host:1:2 [0] enqueue.cc:1085 NCCL WARN Cuda failure 'out of memory'").kind,
            OomKind::kDevice);
  OomFigures f = ParseOomFigures("node:2134736:2285781 [0] include/alloc.h:185 NCCL WARN Failed to CUDA calloc "
                                 "6291456 bytes");
  EXPECT_EQ(f.format, "nccl");
  EXPECT_EQ(f.requested, 6291456);
  EXPECT_EQ(ClassifyMessage("NCCL WARN Failed to CUDA calloc 6291456 bytes").kind, OomKind::kDevice);
  EXPECT_EQ(ClassifyMessage("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                            "`cublasCreate(handle)`").kind,
            OomKind::kWorkspace);
  EXPECT_EQ(ClassifyMessage("E tensorflow/stream_executor/cuda/cuda_blas.cc:372] failed to create cublas handle: "
                            "CUBLAS_STATUS_ALLOC_FAILED").kind,
            OomKind::kWorkspace);
  EXPECT_EQ(ClassifyMessage("Error in CuDNN: CUDNN_STATUS_ALLOC_FAILED (cudnnFindConvolutionForwardAlgorithm)").kind,
            OomKind::kWorkspace);
  EXPECT_EQ(ClassifyMessage("NCCL INFO Channel 00 : 0[1020] -> 2[1040] via SHM/direct/direct").kind,
            OomKind::kNone);
}

TEST(OomFiguresTest, HostFormats) {
  OomFigures f = ParseOomFigures(
      "RuntimeError: [enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: "
      "you tried to allocate 335544320000 bytes. Error code 12 (Cannot allocate memory)");
  EXPECT_EQ(f.device, "cpu");
  EXPECT_EQ(f.format, "cpu-allocator");
  EXPECT_EQ(f.requested, 335544320000);
  f = ParseOomFigures(
      "[2059991.491542] Out of memory: Killed process 25315 (python3) total-vm:53312244kB, anon-rss:31451456kB, "
      "file-rss:74816kB, shmem-rss:12296kB");
  EXPECT_EQ(f.format, "oom-killer");
  EXPECT_EQ(f.host_rss, int64_t{31451456} * kKiB);  // the kernel's kB are KiB
  EXPECT_FALSE(f.requested.has_value());
  for (const char* msg : {
           "Out of memory: Killed process 7899 (python) total-vm:26184840kB",
           "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,task=python",
           "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=191.batch cgroup.",
           "slurmstepd: error: Detected 2 oom_kill events in StepId=JOBID.13. Some of the step tasks have been OOM "
           "Killed.",
           "      Reason:       OOMKilled",
           "RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed.",
           "Process finished with exit code 137 (interrupted by signal 9: SIGKILL)",
           "RuntimeError: DataLoader worker (pid 3855) is killed by signal: Bus error. It is possible that "
           "dataloader's workers are out of shared memory.",
           "DeepSpeedZeRoOffload initialization failed (can't allocate memory)",
           "MemoryError: bad allocation",
       }) {
    EXPECT_EQ(ClassifyMessage(msg).kind, OomKind::kHost) << msg;
  }
  for (const char* msg : {"RuntimeError: DataLoader worker (pid 25902) is killed by signal: Segmentation fault",
                          "Process finished with exit code 1", "Killed 3 zombie threads politely"}) {
    EXPECT_EQ(ClassifyMessage(msg).kind, OomKind::kNone) << msg;
  }
}

TEST(OomFiguresTest, AbsurdRequests) {
  OomFigures f = ParseOomFigures("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate more than 1EB "
                                 "memory.");
  EXPECT_EQ(f.requested, int64_t{1000000000000000000});
  EXPECT_TRUE(f.requested_is_lower_bound);
  EXPECT_EQ(f.format, "pytorch-request");
  // Another library named on the line does not make it that library's message.
  f = ParseOomFigures("Does an NCCL timeout lead to \"torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to "
                      "allocate more than 1EB memory\"?");
  EXPECT_EQ(f.format, "pytorch-request");
  EXPECT_TRUE(f.requested_is_lower_bound);
  f = ParseOomFigures("CUDA out of memory. Tried to allocate 13535.27 GiB. GPU 0 has a total capacity of 79.14 GiB "
                      "of which 61.76 GiB is free.");
  EXPECT_EQ(f.requested, Gi(13535.27));
  EXPECT_FALSE(f.requested_is_lower_bound);
  EXPECT_EQ(f.free, Gi(61.76));
}

TEST(OomFiguresTest, MpsFigures) {
  OomFigures f = ParseOomFigures(
      "RuntimeError: MPS backend out of memory (MPS allocated: 1.01 GB, other allocations: 7.36 GB, max allowed: "
      "18.13 GB). Tried to allocate 256 bytes on shared pool.");
  EXPECT_EQ(f.device, "mps");
  EXPECT_EQ(f.allocated, 1010000000);
  EXPECT_EQ(f.capacity, 18130000000);
  EXPECT_EQ(f.process_in_use, 1010000000 + 7360000000);
  EXPECT_EQ(f.requested, 256);
}

TEST(OomFiguresTest, MlxMetalFigures) {
  // ml-explore/mlx#3082: one buffer larger than Metal allows; the request is read, and Metal's
  // per-buffer limit is not taken for the device's capacity.
  OomFigures f = ParseOomFigures("RuntimeError: [metal::malloc] Attempting to allocate 86587211776 bytes which is "
                                 "greater than the maximum allowed buffer size of 86586540032 bytes.");
  EXPECT_EQ(f.format, "mlx-metal");
  EXPECT_EQ(f.device, "metal");
  EXPECT_EQ(f.requested, 86587211776);
  EXPECT_FALSE(f.capacity);
  // jjang-ai/vmlx#58: a command buffer refused for memory prints no figure.
  f = ParseOomFigures("libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command "
                      "buffer execution failed: Insufficient Memory");
  EXPECT_EQ(f.format, "mlx-metal");
  EXPECT_EQ(f.device, "metal");
  EXPECT_FALSE(f.requested || f.capacity || f.free);
}

TEST(OomFiguresTest, GgmlBufferFigures) {
  // ggml-org/llama.cpp#9352: the buffer's plain byte count is the request; the buffer type names
  // the device and its index ("ROCm0": hip, 0).
  OomFigures f = ParseOomFigures("ggml_gallocr_reserve_n: failed to allocate ROCm0 buffer of size 18035509504");
  EXPECT_EQ(f.format, "ggml");
  EXPECT_EQ(f.device, "hip");
  EXPECT_EQ(f.device_index, 0);
  EXPECT_EQ(f.requested, 18035509504);
  EXPECT_FALSE(f.capacity || f.free);
  f = ParseOomFigures("ggml_gallocr_reserve_n: failed to allocate CPU buffer of size 2147483648");
  EXPECT_EQ(f.format, "ggml");
  EXPECT_EQ(f.device, "cpu");
  EXPECT_EQ(f.device_index, -1);
  EXPECT_EQ(f.requested, 2147483648);
  // A line for a buffer it did allocate is none of ggml's failures.
  f = ParseOomFigures("llama_new_context_with_model:  CUDA0 compute buffer size =   164.01 MiB");
  EXPECT_EQ(f.format, "");
  EXPECT_FALSE(f.requested);
}

TEST(OomFiguresTest, OllamaSystemMemoryFigures) {
  // continuedev/continue#9668: Ollama refusing a model the host cannot hold. The first size is
  // the model's need (the request), the second what the host had free; host memory.
  OomFigures f = ParseOomFigures("\"model requires more system memory (19.3 GiB) than is available (14.8 GiB)\"");
  EXPECT_EQ(f.format, "ollama");
  EXPECT_EQ(f.device, "cpu");
  EXPECT_EQ(f.requested, static_cast<int64_t>(19.3 * (1LL << 30)));
  EXPECT_EQ(f.free, static_cast<int64_t>(14.8 * (1LL << 30)));
  EXPECT_FALSE(f.capacity);
  OomInfo info = ClassifyMessage("model requires more system memory (19.3 GiB) than is available (14.8 GiB)");
  EXPECT_EQ(info.kind, OomKind::kHost);
  EXPECT_EQ(info.requested_bytes, static_cast<int64_t>(19.3 * (1LL << 30)));
  // Without the figures it is no Ollama refusal.
  EXPECT_EQ(ParseOomFigures("the model requires more system memory than my laptop has").format, "");
  EXPECT_EQ(ClassifyMessage("the model requires more system memory than my laptop has").kind, OomKind::kNone);
}

TEST(OomFiguresTest, Batch20Formats) {
  // clab/dynet#983: DyNet's allocator; n is the request in bytes, CPU is host memory.
  OomFigures f = ParseOomFigures("CPU memory allocation failed n=2097152000 align=32");
  EXPECT_EQ(f.format, "dynet");
  EXPECT_EQ(f.device, "cpu");
  EXPECT_EQ(f.requested, 2097152000);
  OomInfo info = ClassifyMessage("CPU memory allocation failed n=2097152000 align=32");
  EXPECT_EQ(info.kind, OomKind::kHost);
  EXPECT_EQ(info.requested_bytes, 2097152000);
  EXPECT_EQ(ClassifyMessage("GPU memory allocation failed n=1048576 align=256").kind, OomKind::kDevice);
  // JingyunLiang/SwinIR#78, YYuX-1145/Bert-VITS2-Integration-package#5: Windows out of commit (RAM and
  // page file) is host memory, in English and in Chinese.
  EXPECT_EQ(ClassifyMessage("OSError: [WinError 1455] The paging file is too small for this operation to complete. "
                            "Error loading \"D:\\torch\\lib\\shm.dll\" or one of its dependencies.")
                .kind,
            OomKind::kHost);
  EXPECT_EQ(ClassifyMessage("OSError: [WinError 1455] 页面文件太小，无法完成操作。").kind, OomKind::kHost);
  // ml-explore/mlx-examples#70: MLX's allocator refusing a buffer is Metal's (device) memory.
  info = ClassifyMessage("libc++abi: terminating due to uncaught exception of type std::runtime_error: "
                         "[malloc_or_wait] Unable to allocate 12 bytes.");
  EXPECT_EQ(info.kind, OomKind::kDevice);
  EXPECT_EQ(info.requested_bytes, 12);
  // huggingface/text-generation-inference#710: TGI's KV cache does not fit on the card.
  EXPECT_EQ(ClassifyMessage("Not enough memory to handle 16000 total tokens with 2 prefill tokens. You need to "
                            "decrease `--max-batch-total-tokens` or `--max-batch-prefill-tokens`")
                .kind,
            OomKind::kDevice);
  // Near misses: another Windows error, an allocation that succeeded.
  EXPECT_EQ(ClassifyMessage("OSError: [WinError 126] The specified module could not be found.").kind,
            OomKind::kNone);
  EXPECT_EQ(ClassifyMessage("CPU memory allocation of 2 GB done in 3 ms").kind, OomKind::kNone);
}

TEST(OomFiguresTest, NothingPrintedMeansNothingKnown) {
  OomFigures f = ParseOomFigures("RuntimeError: CUDA error: out of memory");
  EXPECT_FALSE(f.requested || f.capacity || f.free || f.allocated || f.reserved || f.process_in_use);
  EXPECT_TRUE(f.other_processes.empty());
}

}  // namespace
}  // namespace oomguard::internal
