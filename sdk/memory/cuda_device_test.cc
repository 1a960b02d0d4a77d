// CudaDevice tests. They need a GPU; without one (or without CUDA in the
// build) they skip with the reason, and only the "no GPU" contract is checked.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "oomguard/device.h"
#include "oomguard/oom.h"

namespace oomguard {
namespace {

constexpr int64_t kMiB = 1024 * 1024;

TEST(CudaDeviceTest, UnavailableOrUnimplementedWithoutAGpu) {
  auto d = MakeCudaDevice(0);
  if (d.ok()) GTEST_SKIP() << "a GPU is visible: " << d.value()->Name();
  if (!CudaCompiled()) {
    EXPECT_EQ(d.status().code(), StatusCode::kUnimplemented);
    EXPECT_EQ(d.status().message(), "built without CUDA (OOMGUARD_WITH_CUDA=OFF)");
  } else {
    EXPECT_EQ(d.status().code(), StatusCode::kUnavailable) << d.status();
    EXPECT_NE(d.status().message().find("no GPU is visible"), std::string::npos) << d.status();
  }
}

class CudaDeviceGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaCompiled()) GTEST_SKIP() << "built without CUDA (OOMGUARD_WITH_CUDA=OFF)";
    auto d = MakeCudaDevice(0);
    if (!d.ok()) GTEST_SKIP() << d.status();
    device_ = std::move(d).value();
  }

  std::unique_ptr<Device> device_;
};

TEST_F(CudaDeviceGpuTest, BadIndexIsInvalidArgument) {
  auto d = MakeCudaDevice(1 << 20);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << d.status();
  EXPECT_EQ(MakeCudaDevice(-1).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaDeviceGpuTest, AllocateFreeAndStats) {
  EXPECT_EQ(device_->Name(), "cuda:0");
  MemoryStats before = device_->Stats();
  EXPECT_GT(before.total, 0);
  EXPECT_GT(before.free, 0);
  EXPECT_LE(before.free, before.total);

  void* p = device_->Allocate(64 * kMiB);
  ASSERT_NE(p, nullptr);
  MemoryStats s = device_->Stats();
  EXPECT_EQ(s.allocated, before.allocated + 64 * kMiB);
  EXPECT_GE(s.reserved, s.allocated);
  EXPECT_GE(s.peak_allocated, s.allocated);
  device_->Free(p);
  EXPECT_EQ(device_->Stats().allocated, before.allocated);
  device_->Free(nullptr);
}

TEST_F(CudaDeviceGpuTest, ExhaustionThrowsDeviceOomErrorAndRecovers) {
  const MemoryStats start = device_->Stats();
  // Chunks of 1/16 of the device: few iterations, and the leftover fragment
  // makes the last request fail for lack of memory, not for an address limit.
  const int64_t chunk = std::max<int64_t>(start.total / 16, 64 * kMiB);
  std::vector<void*> blocks;
  bool oom = false;
  for (int i = 0; i < 64 && !oom; ++i) {
    try {
      blocks.push_back(device_->Allocate(static_cast<size_t>(chunk)));
    } catch (const DeviceOomError& e) {
      oom = true;
      EXPECT_EQ(e.requested_bytes(), chunk);
      EXPECT_EQ(e.stats().allocated, static_cast<int64_t>(blocks.size()) * chunk);
      EXPECT_GE(e.stats().num_ooms, 1);
      OomInfo info = ClassifyException(std::current_exception());
      EXPECT_EQ(info.kind, OomKind::kDevice);
      EXPECT_EQ(info.requested_bytes, chunk);
    }
  }
  ASSERT_TRUE(oom) << "allocated " << blocks.size() << " chunks of " << chunk << " bytes without an OOM";
  MemoryStats s = device_->Stats();
  EXPECT_GE(s.num_ooms, 1);
  EXPECT_GE(s.num_alloc_retries, 1);
  EXPECT_GE(s.peak_allocated, static_cast<int64_t>(blocks.size()) * chunk);

  for (void* p : blocks) device_->Free(p);
  device_->ReleaseCaches();
  s = device_->Stats();
  EXPECT_EQ(s.allocated, start.allocated);
  EXPECT_LE(s.reserved, start.reserved + chunk);  // the cache went back to the driver
  EXPECT_GT(s.free, start.free - chunk);

  // The device is usable again after an OOM (the error was not left sticky).
  void* p = device_->Allocate(static_cast<size_t>(chunk));
  device_->Free(p);
  device_->ResetPeak();
  EXPECT_EQ(device_->Stats().peak_allocated, start.allocated);
}

}  // namespace
}  // namespace oomguard
