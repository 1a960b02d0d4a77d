// Staging memory: the streamed copy equals memcpy at every size and
// alignment, and buffers are usable before and after Prefault.
#include "sdk/checkpoint/host_buffer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace oomguard::ckpt {
namespace {

TEST(HostBufferTest, StreamCopyEqualsMemcpyAtEverySizeAndAlignment) {
  std::mt19937 rng(7);
  std::vector<uint8_t> src(3 << 20);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  HostBuffer dst(src.size() + 64);
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{63}, size_t{64} << 10, (size_t{64} << 10) + 17,
                   size_t{1} << 20, (size_t{3} << 20) - 100}) {
    for (size_t dst_off : {0, 1, 7, 16, 33}) {
      for (size_t src_off : {0, 3}) {
        if (n + src_off > src.size()) continue;
        std::memset(dst.data(), 0xee, dst.size());
        StreamCopy(dst.data() + dst_off, src.data() + src_off, n);
        ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_off, n), 0)
            << n << " bytes, dst+" << dst_off << ", src+" << src_off;
        // Nothing written outside [dst_off, dst_off + n).
        for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst.data()[i], 0xee);
        for (size_t i = dst_off + n; i < dst_off + n + 16 && i < dst.size(); ++i) ASSERT_EQ(dst.data()[i], 0xee);
      }
    }
  }
}

TEST(HostBufferTest, PageAlignedAndWritableBeforeAndAfterPrefault) {
  HostBuffer b(5 << 20);
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 4096, 0u);
  EXPECT_EQ(b.size(), size_t{5} << 20);
  b.data()[0] = 1;
  b.Prefault();
  EXPECT_EQ(b.data()[0], 1) << "prefaulting keeps what was written";
  b.data()[b.size() - 1] = 2;
  HostBuffer moved = std::move(b);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(moved.data()[moved.size() - 1], 2);
  HostBuffer empty(0);
  EXPECT_EQ(empty.data(), nullptr);
  empty.Prefault();
}

}  // namespace
}  // namespace oomguard::ckpt
