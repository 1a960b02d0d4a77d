// CUDA tensors in the checkpointer: staged through pinned buffers on a side
// stream, restored from the snapshot and from disk. The round trip runs where
// a GPU is visible (tests/gpu/run.sh); here it skips with the reason.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"

#if defined(OOMGUARD_WITH_CUDA) && !defined(OOMGUARD_TSAN_BUILD)
#include <cuda_runtime_api.h>

#include "sdk/checkpoint/device_copy.h"
#define OOMGUARD_CKPT_CUDA_TEST 1
#endif

namespace oomguard {
namespace {

namespace fs = std::filesystem;

std::string MakeDir() {
  std::string t = (fs::temp_directory_path() / "oomguard-ckpt-cuda-XXXXXX").string();
  if (mkdtemp(t.data()) == nullptr) return "";
  return t;
}

TEST(CheckpointerCuda, CudaTensorWithoutAGpuIsAClearError) {
  int n = 0;
#ifdef OOMGUARD_CKPT_CUDA_TEST
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
#endif
  if (n > 0) GTEST_SKIP() << "a GPU is visible: covered by the round trip";
  const std::string dir = MakeDir();
  CheckpointOptions o;
  o.dir = dir;
  auto c = Checkpointer::Create(o).value();
  float fake = 0;
  Status s = c->AddTensor("model/w", DType::kFloat32, {1}, &fake, MemoryLocation::kCuda);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("model/w"), std::string::npos) << s;
  fs::remove_all(dir);
}

TEST(CheckpointerCuda, RoundTripThroughSnapshotAndDisk) {
#ifndef OOMGUARD_CKPT_CUDA_TEST
  GTEST_SKIP() << "built without CUDA (OOMGUARD_WITH_CUDA=OFF)";
#else
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    GTEST_SKIP() << "no GPU is visible (no driver or no device)";
  }
  const std::string dir = MakeDir();
  const size_t count = (3 << 20) + 5;  // several chunks and an odd tail
  std::vector<float> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 1000) * 0.25f;
  float* dev = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), count * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), count * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  CheckpointOptions o;
  o.dir = dir;
  auto c = Checkpointer::Create(o).value();
  ASSERT_TRUE(c->AddTensor("model/w", DType::kFloat32, {static_cast<int64_t>(count)}, dev, MemoryLocation::kCuda).ok());
  ASSERT_TRUE(c->SaveAsync(7).ok());
  ASSERT_TRUE(c->Wait().ok());
  // Overwrite on the device, then restore from the in-memory snapshot.
  ASSERT_EQ(cudaMemset(dev, 0, count * sizeof(float)), cudaSuccess);
  Status r = c->Restore(7);
  ASSERT_TRUE(r.ok()) << r;
  std::vector<float> back(count);
  ASSERT_EQ(cudaMemcpy(back.data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  // And from disk, through a fresh checkpointer.
  ASSERT_EQ(cudaMemset(dev, 0, count * sizeof(float)), cudaSuccess);
  auto c2 = Checkpointer::Create(o).value();
  ASSERT_TRUE(c2->AddTensor("model/w", DType::kFloat32, {static_cast<int64_t>(count)}, dev, MemoryLocation::kCuda).ok());
  auto l = c2->LoadLatest();
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(*l, 7);
  ASSERT_EQ(cudaMemcpy(back.data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  cudaFree(dev);
  fs::remove_all(dir);
#endif
}

#ifdef OOMGUARD_CKPT_CUDA_TEST
bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}
#endif

// The staging copy waits for the streams it is given: a large write queued on
// a side stream right before SaveAsync is what the checkpoint holds.
TEST(CheckpointerCuda, StagingWaitsForTheStreamsItIsGiven) {
#ifndef OOMGUARD_CKPT_CUDA_TEST
  GTEST_SKIP() << "built without CUDA (OOMGUARD_WITH_CUDA=OFF)";
#else
  if (!HaveGpu()) GTEST_SKIP() << "no GPU is visible (no driver or no device)";
  const std::string dir = MakeDir();
  const size_t bytes = size_t{1} << 30;  // long enough that an unordered copy would overtake the write
  uint8_t* dev = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(dev, 0, bytes), cudaSuccess);
  cudaStream_t side;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  CheckpointOptions o;
  o.dir = dir;
  o.fsync = false;
  o.cuda_streams = [side] { return std::vector<void*>{side}; };
  auto c = Checkpointer::Create(o).value();
  ASSERT_TRUE(c->AddTensor("model/w", DType::kUInt8, {static_cast<int64_t>(bytes)}, dev, MemoryLocation::kCuda).ok());
  for (int round = 1; round <= 3; ++round) {
    ASSERT_EQ(cudaMemsetAsync(dev, round, bytes, side), cudaSuccess);
    ASSERT_TRUE(c->SaveAsync(round).ok());  // no host synchronisation in between
    ASSERT_TRUE(c->Wait().ok());
    ASSERT_EQ(cudaMemset(dev, 0, bytes), cudaSuccess);
    ASSERT_TRUE(c->Restore(round).ok());
    uint8_t first = 0, last = 0;
    ASSERT_EQ(cudaMemcpy(&first, dev, 1, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(&last, dev + bytes - 1, 1, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(first, round);
    EXPECT_EQ(last, round) << "the copy ran before the side stream's write finished";
  }
  cudaStreamDestroy(side);
  cudaFree(dev);
  fs::remove_all(dir);
#endif
}

// A buffer the driver will not page-lock is reported as such (the caller
// keeps it pageable instead of recording it as pinned).
TEST(CheckpointerCuda, PinHostSaysWhenTheDriverRefused) {
#ifndef OOMGUARD_CKPT_CUDA_TEST
  GTEST_SKIP() << "built without CUDA (OOMGUARD_WITH_CUDA=OFF)";
#else
  if (!HaveGpu()) GTEST_SKIP() << "no GPU is visible (no driver or no device)";
  std::vector<uint8_t> buf(1 << 20);
  ASSERT_TRUE(ckpt::PinHost(buf.data(), buf.size(), 0));
  EXPECT_FALSE(ckpt::PinHost(buf.data(), buf.size(), 0)) << "registering a pinned range again must fail";
  ckpt::UnpinHost(buf.data(), 0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "no error is left behind";
#endif
}

TEST(CheckpointerCuda, DeviceCopierWithoutAGpuIsUnavailableOrUnimplemented) {
#ifdef OOMGUARD_CKPT_CUDA_TEST
  if (HaveGpu()) GTEST_SKIP() << "a GPU is visible";
  auto c = ckpt::DeviceCopier::Create(0);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status();
  EXPECT_NE(c.status().message().find("no GPU is visible"), std::string::npos) << c.status();
#else
  GTEST_SKIP() << "built without CUDA (OOMGUARD_WITH_CUDA=OFF)";
#endif
}

}  // namespace
}  // namespace oomguard
