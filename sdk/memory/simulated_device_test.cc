#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "oomguard/device.h"
#include "oomguard/oom.h"

namespace oomguard {
namespace {

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * 1024;

// 8 MiB of 2 MiB segments; requests up to 1 MiB share segments.
SimulatedDeviceOptions SmallGpu(bool backing = false) {
  SimulatedDeviceOptions o;
  o.capacity_bytes = 8 * kMiB;
  o.segment_bytes = 2 * kMiB;
  o.small_request_bytes = 1 * kMiB;
  o.round_bytes = 512;
  o.backing = backing;
  return o;
}

std::unique_ptr<Device> Make(const SimulatedDeviceOptions& o) {
  auto d = MakeSimulatedDevice(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return std::move(d).value();
}

TEST(SimulatedDeviceTest, NameCarriesIndex) {
  SimulatedDeviceOptions o = SmallGpu();
  o.index = 3;
  EXPECT_EQ(Make(o)->Name(), "sim:3");
}

TEST(SimulatedDeviceTest, RoundsRequestsUp) {
  auto d = Make(SmallGpu());
  void* a = d->Allocate(1);
  EXPECT_EQ(d->Stats().allocated, 512);
  void* b = d->Allocate(0);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  EXPECT_EQ(d->Stats().allocated, 1024);
  void* c = d->Allocate(513);
  EXPECT_EQ(d->Stats().allocated, 2048);
  d->Free(a);
  d->Free(b);
  d->Free(c);
  EXPECT_EQ(d->Stats().allocated, 0);
}

TEST(SimulatedDeviceTest, FreedMemoryStaysReservedUntilReleaseCaches) {
  auto d = Make(SmallGpu());
  void* p = d->Allocate(100 * kKiB);
  MemoryStats s = d->Stats();
  EXPECT_EQ(s.allocated, 100 * kKiB);
  EXPECT_EQ(s.active, 100 * kKiB);
  EXPECT_EQ(s.reserved, 2 * kMiB);
  EXPECT_EQ(s.total, 8 * kMiB);
  EXPECT_EQ(s.free, 6 * kMiB);

  d->Free(p);
  s = d->Stats();
  EXPECT_EQ(s.allocated, 0);
  EXPECT_EQ(s.reserved, 2 * kMiB);  // cached, as PyTorch keeps it
  EXPECT_EQ(s.free, 6 * kMiB);
  EXPECT_EQ(s.inactive_split, 0);  // a fully free segment is not fragmentation

  d->ReleaseCaches();
  s = d->Stats();
  EXPECT_EQ(s.reserved, 0);
  EXPECT_EQ(s.free, 8 * kMiB);
}

TEST(SimulatedDeviceTest, CachedBlockIsReusedWithoutNewSegment) {
  auto d = Make(SmallGpu());
  void* p = d->Allocate(300 * kKiB);
  d->Free(p);
  void* q = d->Allocate(300 * kKiB);
  EXPECT_EQ(q, p);
  EXPECT_EQ(d->Stats().reserved, 2 * kMiB);
  d->Free(q);
}

TEST(SimulatedDeviceTest, LargeRequestGetsItsOwnRoundedSegment) {
  auto d = Make(SmallGpu());
  void* p = d->Allocate(3 * kMiB);
  MemoryStats s = d->Stats();
  EXPECT_EQ(s.allocated, 3 * kMiB);
  EXPECT_EQ(s.reserved, 4 * kMiB);
  EXPECT_EQ(s.inactive_split, 1 * kMiB);  // the split-off tail of a used segment
  void* q = d->Allocate(2 * kMiB + 1);    // rounds to 2 MiB + 512, segment of 4 MiB
  EXPECT_EQ(d->Stats().reserved, 8 * kMiB);
  d->Free(p);
  d->Free(q);
}

TEST(SimulatedDeviceTest, UnlimitedCapacityReportsZeroTotalAndFree) {
  SimulatedDeviceOptions o = SmallGpu();
  o.capacity_bytes = 0;
  auto d = Make(o);
  // With fake addresses nothing is really allocated, so a terabyte is fine.
  void* p = d->Allocate(size_t{1} << 40);
  MemoryStats s = d->Stats();
  EXPECT_EQ(s.total, 0);
  EXPECT_EQ(s.free, 0);
  EXPECT_EQ(s.allocated, int64_t{1} << 40);
  d->Free(p);
}

TEST(SimulatedDeviceTest, OomThrowsWithRequestedBytesAndStats) {
  auto d = Make(SmallGpu());
  void* p = d->Allocate(6 * kMiB);
  try {
    d->Allocate(4 * kMiB);
    FAIL() << "expected DeviceOomError";
  } catch (const DeviceOomError& e) {
    EXPECT_EQ(e.requested_bytes(), 4 * kMiB);
    EXPECT_FALSE(e.injected());
    EXPECT_EQ(e.stats().allocated, 6 * kMiB);
    EXPECT_EQ(e.stats().reserved, 6 * kMiB);
    EXPECT_EQ(e.stats().total, 8 * kMiB);
    EXPECT_EQ(e.stats().free, 2 * kMiB);
    EXPECT_EQ(e.stats().num_ooms, 1);
    const std::string what = e.what();
    EXPECT_NE(what.find("sim:0 out of memory. Tried to allocate 4.00 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("6.00 MiB already allocated"), std::string::npos) << what;
    // The message alone is enough for the classifier (incidents imported as text).
    OomInfo info = ClassifyMessage(what);
    EXPECT_EQ(info.kind, OomKind::kDevice);
    EXPECT_EQ(info.requested_bytes, 4 * kMiB);
  }
  MemoryStats s = d->Stats();
  EXPECT_EQ(s.num_ooms, 1);
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.allocated, 6 * kMiB);  // a failed allocation changes nothing else
  d->Free(p);
}

TEST(SimulatedDeviceTest, AbsurdRequestThrowsInsteadOfOverflowing) {
  auto d = Make(SmallGpu());
  EXPECT_THROW(d->Allocate(SIZE_MAX), DeviceOomError);
  EXPECT_THROW(d->Allocate(SIZE_MAX - 100), DeviceOomError);
  EXPECT_EQ(d->Stats().num_ooms, 2);
  EXPECT_EQ(d->Stats().reserved, 0);

  // Unlimited capacity with fake addresses: the address space is the limit,
  // and addresses never wrap around into duplicates.
  SimulatedDeviceOptions o = SmallGpu();
  o.capacity_bytes = 0;
  auto unlimited = Make(o);
  void* p = unlimited->Allocate(size_t{1} << 61);
  try {
    unlimited->Allocate(size_t{1} << 61);
    FAIL() << "expected DeviceOomError";
  } catch (const DeviceOomError& e) {
    EXPECT_NE(std::string(e.what()).find("address space"), std::string::npos) << e.what();
    EXPECT_EQ(e.requested_bytes(), int64_t{1} << 61);
  }
  unlimited->Free(p);
}

TEST(SimulatedDeviceTest, RetryReleasesCachedSegmentsBeforeFailing) {
  auto d = Make(SmallGpu());
  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(d->Allocate(1 * kMiB));  // 3 small segments
  for (void* p : blocks) d->Free(p);
  ASSERT_EQ(d->Stats().reserved, 6 * kMiB);

  // 4 MiB fits no cached (small) block and 6 + 4 > 8: release, retry, succeed.
  void* big = d->Allocate(4 * kMiB);
  MemoryStats s = d->Stats();
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_EQ(s.reserved, 4 * kMiB);
  EXPECT_EQ(s.allocated, 4 * kMiB);
  d->Free(big);
}

TEST(SimulatedDeviceTest, PeakTracksHighWaterMarkUntilReset) {
  auto d = Make(SmallGpu());
  void* a = d->Allocate(1 * kMiB);
  void* b = d->Allocate(3 * kMiB);
  d->Free(b);
  MemoryStats s = d->Stats();
  EXPECT_EQ(s.allocated, 1 * kMiB);
  EXPECT_EQ(s.peak_allocated, 4 * kMiB);
  d->ResetPeak();
  EXPECT_EQ(d->Stats().peak_allocated, 1 * kMiB);
  void* c = d->Allocate(512 * kKiB);
  EXPECT_EQ(d->Stats().peak_allocated, 1 * kMiB + 512 * kKiB);
  d->Free(a);
  d->Free(c);
  EXPECT_EQ(d->Stats().peak_allocated, 1 * kMiB + 512 * kKiB);
}

TEST(SimulatedDeviceTest, FragmentationStrandsFreeMemoryUntilNeighboursAreFreed) {
  auto d = Make(SmallGpu());
  // 32 blocks of 256 KiB fill the four 2 MiB segments in order (8 per segment).
  std::vector<void*> blocks;
  for (int i = 0; i < 32; ++i) blocks.push_back(d->Allocate(256 * kKiB));
  ASSERT_EQ(d->Stats().reserved, 8 * kMiB);
  for (int i = 0; i < 32; i += 2) d->Free(blocks[i]);

  MemoryStats s = d->Stats();
  EXPECT_EQ(s.allocated, 4 * kMiB);
  EXPECT_EQ(s.reserved, 8 * kMiB);
  EXPECT_EQ(s.inactive_split, 4 * kMiB);
  ASSERT_GE(s.total - s.allocated, 2 * kMiB);           // enough in sum ...
  EXPECT_THROW(d->Allocate(2 * kMiB), DeviceOomError);  // ... but not in one piece
  EXPECT_THROW(d->Allocate(512 * kKiB), DeviceOomError);
  EXPECT_EQ(d->Stats().num_ooms, 2);

  // Free the live neighbours in the first segment: its blocks coalesce.
  for (int i = 1; i < 8; i += 2) d->Free(blocks[i]);
  s = d->Stats();
  EXPECT_EQ(s.allocated, 3 * kMiB);
  EXPECT_EQ(s.inactive_split, 3 * kMiB);  // segment 0 is whole again, not stranded

  // 512 KiB now fits the coalesced block without a new segment.
  void* mid = d->Allocate(512 * kKiB);
  EXPECT_EQ(mid, blocks[0]);
  EXPECT_EQ(d->Stats().reserved, 8 * kMiB);
  d->Free(mid);

  // 2 MiB needs its own segment: the retry releases segment 0 and it fits.
  const int64_t retries_before = d->Stats().num_alloc_retries;
  void* big = d->Allocate(2 * kMiB);
  s = d->Stats();
  EXPECT_EQ(s.num_alloc_retries, retries_before + 1);
  EXPECT_EQ(s.reserved, 8 * kMiB);
  EXPECT_EQ(s.allocated, 5 * kMiB);
  d->Free(big);
  for (int i = 9; i < 32; i += 2) d->Free(blocks[i]);
  s = d->Stats();
  EXPECT_EQ(s.allocated, 0);
  EXPECT_EQ(s.inactive_split, 0);
  d->ReleaseCaches();
  EXPECT_EQ(d->Stats().reserved, 0);
}

TEST(SimulatedDeviceTest, BestFitPicksTheSmallestCachedBlockThatFits) {
  auto d = Make(SmallGpu());
  void* a = d->Allocate(512 * kKiB);
  void* sep1 = d->Allocate(4 * kKiB);
  void* b = d->Allocate(128 * kKiB);
  void* sep2 = d->Allocate(4 * kKiB);
  d->Free(a);
  d->Free(b);
  // Free blocks now: 512 KiB (a), 128 KiB (b) and the segment's large tail.
  EXPECT_EQ(d->Allocate(100 * kKiB), b);
  EXPECT_EQ(d->Allocate(500 * kKiB), a);
  EXPECT_EQ(d->Stats().reserved, 2 * kMiB);
  d->Free(a);
  d->Free(b);
  d->Free(sep1);
  d->Free(sep2);
}

TEST(SimulatedDeviceTest, FreeBlocksCoalesceWithBothNeighbours) {
  auto d = Make(SmallGpu());
  void* x = d->Allocate(640 * kKiB);
  void* y = d->Allocate(640 * kKiB);
  void* z = d->Allocate(640 * kKiB);  // 128 KiB tail left in the segment
  d->Free(x);
  d->Free(z);
  EXPECT_EQ(d->Stats().inactive_split, 2 * kMiB - 640 * kKiB);
  d->Free(y);  // merges with x before and z (and the tail) after
  void* whole = d->Allocate(1 * kMiB);
  EXPECT_EQ(whole, x);
  EXPECT_EQ(d->Stats().reserved, 2 * kMiB);
  d->Free(whole);
}

TEST(SimulatedDeviceTest, BackingMemoryIsRealAndWritable) {
  auto d = Make(SmallGpu(/*backing=*/true));
  auto* a = static_cast<unsigned char*>(d->Allocate(1000));
  auto* b = static_cast<unsigned char*>(d->Allocate(3 * kMiB));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 256, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 256, 0u);
  std::memset(a, 0xA5, 1000);
  std::memset(b, 0x5A, 3 * kMiB);
  EXPECT_EQ(a[0], 0xA5);
  EXPECT_EQ(a[999], 0xA5);
  EXPECT_EQ(b[0], 0x5A);
  EXPECT_EQ(b[3 * kMiB - 1], 0x5A);
  d->Free(a);
  d->Free(b);
}

TEST(SimulatedDeviceTest, FakeAddressesAreUniqueAndNonNull) {
  SimulatedDeviceOptions o = SmallGpu();
  o.capacity_bytes = 0;
  auto d = Make(o);
  std::set<void*> seen;
  std::vector<void*> live;
  for (int i = 0; i < 2000; ++i) {
    void* p = d->Allocate(static_cast<size_t>(1 + (i * 7919) % (3 * kMiB)));
    ASSERT_NE(p, nullptr);
    ASSERT_TRUE(seen.insert(p).second) << "duplicate address at " << i;
    live.push_back(p);
  }
  for (void* p : live) d->Free(p);
  EXPECT_EQ(d->Stats().allocated, 0);
}

TEST(SimulatedDeviceTest, FreeNullIsANoOp) {
  auto d = Make(SmallGpu());
  d->Free(nullptr);
  EXPECT_EQ(d->Stats().allocated, 0);
}

TEST(SimulatedDeviceDeathTest, FreeOfAnUnknownPointerAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto d = Make(SmallGpu());
  int local = 0;
  EXPECT_DEATH(d->Free(&local), "did not allocate");
  void* p = d->Allocate(10);
  d->Free(p);
  EXPECT_DEATH(d->Free(p), "already freed");
}

TEST(SimulatedDeviceTest, ConcurrentAllocateAndFreeKeepAccountingExact) {
  SimulatedDeviceOptions o = SmallGpu(/*backing=*/true);
  o.capacity_bytes = 256 * kMiB;
  auto d = Make(o);
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      std::uniform_int_distribution<size_t> size(1, 3 * kMiB);
      std::vector<std::pair<unsigned char*, size_t>> live;
      for (int i = 0; i < 3000; ++i) {
        if (live.size() < 8 && rng() % 3 != 0) {
          const size_t n = size(rng);
          auto* p = static_cast<unsigned char*>(d->Allocate(n));
          // Stamp first and last byte: an overlapping block would overwrite them.
          p[0] = static_cast<unsigned char>(t);
          p[n - 1] = static_cast<unsigned char>(t);
          live.emplace_back(p, n);
        } else if (!live.empty()) {
          auto [p, n] = live.back();
          live.pop_back();
          if (p[0] != t || p[n - 1] != t) corrupted.fetch_add(1);
          d->Free(p);
        }
        if (i % 500 == 0) d->ReleaseCaches();
      }
      for (auto [p, n] : live) d->Free(p);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupted.load(), 0);
  MemoryStats s = d->Stats();
  EXPECT_EQ(s.allocated, 0);
  EXPECT_EQ(s.inactive_split, 0);
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_GT(s.peak_allocated, 0);
  EXPECT_LE(s.peak_allocated, 4 * 8 * (3 * kMiB + 512));
  d->ReleaseCaches();
  EXPECT_EQ(d->Stats().reserved, 0);
}

TEST(SimulatedDeviceTest, DeviceBufferFreesOnScopeExitAndMoves) {
  auto d = Make(SmallGpu(/*backing=*/true));
  {
    DeviceBuffer buf(d.get(), 4096);
    ASSERT_NE(buf.data(), nullptr);
    EXPECT_EQ(buf.size(), 4096u);
    buf.as<float>()[0] = 1.5f;
    EXPECT_EQ(d->Stats().allocated, 4096);

    DeviceBuffer moved(std::move(buf));
    EXPECT_EQ(buf.data(), nullptr);  // NOLINT(bugprone-use-after-move): pinned behaviour
    EXPECT_EQ(moved.as<float>()[0], 1.5f);

    DeviceBuffer other(d.get(), 512);
    other = std::move(moved);  // frees other's block
    EXPECT_EQ(d->Stats().allocated, 4096);
    other.reset();
    EXPECT_EQ(d->Stats().allocated, 0);
    EXPECT_EQ(other.data(), nullptr);
    DeviceBuffer last(d.get(), 1024);
  }
  EXPECT_EQ(d->Stats().allocated, 0);
  EXPECT_THROW(DeviceBuffer(d.get(), 16 * kMiB), DeviceOomError);
}

TEST(SimulatedDeviceTest, RejectsBadOptionsNamingTheField) {
  struct Case {
    void (*mutate)(SimulatedDeviceOptions&);
    const char* message;
  };
  const Case cases[] = {
      {[](SimulatedDeviceOptions& o) { o.segment_bytes = 0; },
       "SimulatedDeviceOptions.segment_bytes must be > 0 (got 0)"},
      {[](SimulatedDeviceOptions& o) { o.round_bytes = 0; },
       "SimulatedDeviceOptions.round_bytes must be > 0 (got 0)"},
      {[](SimulatedDeviceOptions& o) { o.round_bytes = 3000; },
       "SimulatedDeviceOptions.round_bytes must be a divisor of segment_bytes=2097152 (got 3000)"},
      {[](SimulatedDeviceOptions& o) { o.capacity_bytes = -1; },
       "SimulatedDeviceOptions.capacity_bytes must be >= 0 (0: unlimited) (got -1)"},
      {[](SimulatedDeviceOptions& o) { o.small_request_bytes = 4 * kMiB; },
       "SimulatedDeviceOptions.small_request_bytes must be <= segment_bytes=2097152 (got "
       "4194304)"},
      {[](SimulatedDeviceOptions& o) { o.index = -2; }, "SimulatedDeviceOptions.index must be >= 0 (got -2)"},
  };
  for (const Case& c : cases) {
    SimulatedDeviceOptions o = SmallGpu();
    c.mutate(o);
    auto d = MakeSimulatedDevice(o);
    ASSERT_FALSE(d.ok()) << c.message;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(d.status().message(), c.message);
  }
  EXPECT_TRUE(MakeSimulatedDevice(SimulatedDeviceOptions{}).ok());
}

}  // namespace
}  // namespace oomguard
