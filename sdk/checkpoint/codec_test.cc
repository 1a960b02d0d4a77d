// Unit tests of a checkpoint's building blocks: the chunk codec (shuffle,
// zstd, the fused unshuffle + hash), the chunk layout, the manifest, and
// compression = auto's choice. The Checkpointer's own tests are in
// checkpointer_test.cc; the shared helpers in checkpoint_testing.h.
#include "sdk/checkpoint/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/checkpoint_testing.h"
#include "sdk/checkpoint/compression.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/xxh.h"

namespace oomguard {
namespace {

using ckpt_testing::Weights;

TEST(CodecTest, ShuffleRoundTripWithTrailingBytes) {
  std::vector<uint8_t> in(103), mid(103), out(103);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 7 + 1);
  ckpt::Shuffle(in.data(), mid.data(), in.size(), 4);
  EXPECT_EQ(mid[1], in[4]);   // byte 0 of element 1
  EXPECT_EQ(mid[25], in[1]);  // byte 1 of element 0 (n = 25)
  ckpt::Unshuffle(mid.data(), out.data(), mid.size(), 4);
  EXPECT_EQ(in, out);
}

// The vector transpose (blocks of 16 elements) against the definition of
// HDF5's shuffle, for every element size and for lengths around the block
// edges, with trailing bytes that fill no element.
TEST(CodecTest, ShuffleMatchesDefinitionForEveryElementSizeAndLength) {
  std::mt19937 rng(7);
  for (size_t es : {1u, 2u, 3u, 4u, 5u, 8u, 16u}) {
    for (size_t bytes : {0u, 1u, 15u, 16u, 31u, 32u, 63u, 64u, 65u, 127u, 128u, 129u, 255u, 256u, 1000u,
                         4099u, 65536u + 7u}) {
      std::vector<uint8_t> in(bytes), mid(bytes, 0xee), out(bytes, 0xdd);
      for (auto& b : in) b = static_cast<uint8_t>(rng());
      ckpt::Shuffle(in.data(), mid.data(), bytes, es);
      const size_t n = bytes / es;
      bool ok = true;
      for (size_t i = 0; i < n && ok; ++i)
        for (size_t j = 0; j < es; ++j)
          if (mid[j * n + i] != in[i * es + j]) {
            ADD_FAILURE() << "elem_size " << es << " bytes " << bytes << ": element " << i << " byte " << j;
            ok = false;
            break;
          }
      for (size_t t = n * es; t < bytes; ++t) EXPECT_EQ(mid[t], in[t]) << "trailing byte " << t;
      ckpt::Unshuffle(mid.data(), out.data(), bytes, es);
      EXPECT_EQ(in, out) << "elem_size " << es << " bytes " << bytes;
    }
  }
}

// The load's fused unshuffle + hash (AVX2 blocks of 32 elements where the
// CPU has them, SSE2 blocks of 16, scalar tails) against the definition: the
// first `keep` bytes in element order, their XXH3, nothing written past them.
TEST(CodecTest, UnshuffleHashedMatchesDefinitionAndHash) {
  std::mt19937 rng(11);
  for (size_t es : {1u, 2u, 4u, 8u}) {
    for (size_t n : {0u, 1u, 16u, 31u, 32u, 33u, 47u, 48u, 64u, 95u, 100u, 1000u, 4096u + 19u}) {
      const size_t bytes = n * es;
      std::vector<uint8_t> in(bytes), shuffled(bytes);
      for (auto& b : in) b = static_cast<uint8_t>(rng());
      ckpt::Shuffle(in.data(), shuffled.data(), bytes, es);
      for (size_t keep_elems : {n, n / 2, n > 0 ? n - 1 : 0}) {
        const size_t keep = keep_elems * es;
        std::vector<uint8_t> out(bytes + 8, 0xcd);
        const uint64_t h = ckpt::UnshuffleHashed(shuffled.data(), out.data(), bytes, es, keep);
        EXPECT_TRUE(std::equal(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(keep), out.begin()))
            << "elem_size " << es << " n " << n << " keep " << keep;
        EXPECT_EQ(h, XXH3_64bits(in.data(), keep)) << "elem_size " << es << " n " << n << " keep " << keep;
        for (size_t t = keep; t < out.size(); ++t) ASSERT_EQ(out[t], 0xcd) << "byte " << t << " written";
      }
    }
  }
}

// The float-tuned match finder must stay a plain zstd frame (decoded by the
// same path as any other) and must not cost ratio on weights.
TEST(CodecTest, FloatTunedFramesDecodeAndKeepTheRatio) {
  auto w = Weights(1 << 18, 3);  // 1 MiB
  const auto* p = reinterpret_cast<const uint8_t*>(w.data());
  std::vector<uint8_t> scratch;
  auto plain = ckpt::EncodeChunk(p, w.size() * 4, 4, 1, &scratch, false);
  auto tuned = ckpt::EncodeChunk(p, w.size() * 4, 4, 1, &scratch, true);
  ASSERT_FALSE(plain.empty());
  ASSERT_FALSE(tuned.empty());
  EXPECT_NE(plain, tuned);  // the settings took effect
  EXPECT_LE(static_cast<double>(tuned.size()), 1.01 * static_cast<double>(plain.size()));
  std::vector<float> back(w.size());
  ASSERT_EQ(ckpt::DecodeChunk(tuned.data(), tuned.size(), 4, reinterpret_cast<uint8_t*>(back.data()),
                              w.size() * 4, &scratch),
            "");
  EXPECT_EQ(back, w);
}

TEST(CodecTest, EncodeDecodeAndRejectGarbage) {
  auto w = Weights(1000, 1);
  std::vector<uint8_t> scratch;
  auto frame = ckpt::EncodeChunk(reinterpret_cast<const uint8_t*>(w.data()), 4000, 4, 1, &scratch);
  ASSERT_FALSE(frame.empty());
  EXPECT_LT(frame.size(), 4000u);
  std::vector<float> back(1000);
  EXPECT_EQ(ckpt::DecodeChunk(frame.data(), frame.size(), 4, reinterpret_cast<uint8_t*>(back.data()), 4000,
                              &scratch),
            "");
  EXPECT_EQ(w, back);
  EXPECT_NE(ckpt::DecodeChunk(frame.data(), frame.size(), 4, reinterpret_cast<uint8_t*>(back.data()), 3996,
                              &scratch),
            "");
  frame[frame.size() / 2] ^= 0xff;
  std::string err = ckpt::DecodeChunk(frame.data(), frame.size(), 4, reinterpret_cast<uint8_t*>(back.data()),
                                      4000, &scratch);
  if (err.empty()) EXPECT_NE(w, back);  // zstd without checksum may decode garbage; xxh3 catches it
  EXPECT_EQ(ckpt::Hex64(0x1234), "0000000000001234");
}

TEST(LayoutTest, ChunksAreContiguousRunsCoveringTheTensor) {
  for (auto shape : std::vector<std::vector<int64_t>>{{1000}, {7, 300}, {3, 5, 700}, {2, 3, 1}, {5000, 1}}) {
    ckpt::ChunkLayout L = ckpt::PlanChunks(shape, 4, 4096);
    int64_t total = 4;
    for (int64_t d : shape) total *= d;
    int64_t next = 0;
    std::vector<hsize_t> off;
    for (int64_t i = 0; i < L.count; ++i) {
      int64_t b = 0, len = 0;
      ckpt::ChunkPosition(shape, L, i, &off, &b, &len);
      EXPECT_EQ(b, next) << "chunk " << i;
      EXPECT_LE(len, L.chunk_bytes);
      EXPECT_LE(L.chunk_bytes, 4096);
      next = b + len;
    }
    EXPECT_EQ(next, total);
    int k = -1;
    EXPECT_TRUE(ckpt::IsContiguousLayout(shape, L.chunk_dims, &k));
  }
}

TEST(ManifestTest, ParsesAndRejects) {
  ckpt::Manifest m;
  m.format = std::string(kCheckpointFormat);
  m.step = 7;
  m.world_size = 1;
  ckpt::ManifestShard sh;
  sh.file = "rank-00000.h5";
  sh.bytes = 10;
  sh.digest = "00000000000000ff";
  sh.compression = "zstd-3";
  sh.auto_choice = R"({"write_MBps":100.0})";
  m.shards.push_back(sh);
  auto back = ckpt::ParseManifest(ckpt::ManifestToJson(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step, 7);
  EXPECT_EQ(back->shards[0].digest, "00000000000000ff");
  EXPECT_EQ(back->shards[0].compression, "zstd-3");
  EXPECT_EQ(back->shards[0].auto_choice, R"({"write_MBps":100.0})");
  // Format 1 manifests still parse, with their whole-file xxh3.
  ckpt::Manifest v1 = m;
  v1.format = std::string(kCheckpointFormatV1);
  v1.shards[0].xxh3 = "00000000000000ee";
  auto old = ckpt::ParseManifest(ckpt::ManifestToJson(v1));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->shards[0].xxh3, "00000000000000ee");
  EXPECT_TRUE(old->shards[0].digest.empty());
  m.shards[0].compression = "gzip";
  EXPECT_EQ(ckpt::ParseManifest(ckpt::ManifestToJson(m)).status().code(), StatusCode::kDataLoss);
  m.shards[0].compression = "zstd-0";
  EXPECT_EQ(ckpt::ParseManifest(ckpt::ManifestToJson(m)).status().code(), StatusCode::kDataLoss);
  m.shards[0].compression = "none";
  EXPECT_TRUE(ckpt::ParseManifest(ckpt::ManifestToJson(m)).ok());
  EXPECT_EQ(ckpt::ParseManifest("{").status().code(), StatusCode::kDataLoss);
  m.world_size = 2;
  EXPECT_EQ(ckpt::ParseManifest(ckpt::ManifestToJson(m)).status().code(), StatusCode::kDataLoss);
  m.world_size = 1;
  m.shards[0].file = "../x.h5";
  EXPECT_EQ(ckpt::ParseManifest(ckpt::ManifestToJson(m)).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(ckpt::StepDirName(100), "step-00000100");
  EXPECT_EQ(ckpt::ParseStepDirName("step-00000100"), 100);
  EXPECT_FALSE(ckpt::ParseStepDirName("step-1x").has_value());
}

// compression = auto's rule: compress only when the measured pool
// compresses faster than the measured disk writes, by a margin.
TEST(AutoCompressionTest, ChoosesFromMeasuredThroughputs) {
  const int64_t big = int64_t{512} << 20;
  ckpt::CompressionSample fast_cpu{2e9, 0.8, 4 << 20};
  // Small states are always compressed; nothing is measured for them.
  auto small = ckpt::ChooseCompression(ckpt::kAutoMinBytes - 1, 1, std::nullopt, std::nullopt);
  EXPECT_TRUE(small.compress);
  EXPECT_NE(small.why.find("small state"), std::string::npos) << small.why;
  // Before any write throughput is known: uncompressed (which measures it).
  auto first = ckpt::ChooseCompression(big, 1, std::nullopt, fast_cpu);
  EXPECT_FALSE(first.compress);
  EXPECT_NE(first.why.find("first save"), std::string::npos) << first.why;
  // A slow disk (100 MB/s) and a pool compressing at 2 GB/s: compress.
  auto slow_disk = ckpt::ChooseCompression(big, 3, 100e6, fast_cpu);
  EXPECT_TRUE(slow_disk.compress) << slow_disk.why;
  EXPECT_NE(slow_disk.why.find("\"chose\":\"zstd-3\""), std::string::npos) << slow_disk.why;
  EXPECT_NE(slow_disk.why.find("\"write_MBps\":100.0"), std::string::npos) << slow_disk.why;
  // A disk faster than compression: none.
  auto fast_disk = ckpt::ChooseCompression(big, 1, 3e9, fast_cpu);
  EXPECT_FALSE(fast_disk.compress) << fast_disk.why;
  // Compression barely faster than the disk, or a ratio near 1: the gain is
  // under the margin, so none.
  EXPECT_FALSE(ckpt::ChooseCompression(big, 1, 1.9e9, fast_cpu).compress);
  EXPECT_FALSE(ckpt::ChooseCompression(big, 1, 100e6, ckpt::CompressionSample{2e9, 0.95, 1 << 20}).compress);
  EXPECT_FALSE(ckpt::ChooseCompression(big, 1, 100e6, std::nullopt).compress);
}

// The model assumes compression and writing overlap; calibration carries
// how much slower compression ran inside real compressed saves.
TEST(AutoCompressionTest, CalibrationFromObservedSavesOverridesTheOverlapModel) {
  const int64_t big = int64_t{512} << 20;
  const double b = static_cast<double>(big);
  const ckpt::CompressionSample sample{1.6e9, 0.835, 4 << 20};
  const double disk = 700e6;  // the model: none 767 ms, zstd max(335, 640) ms: compress
  const auto uncalibrated = ckpt::ChooseCompression(big, 1, disk, sample);
  ASSERT_TRUE(uncalibrated.compress) << uncalibrated.why;
  EXPECT_NEAR(uncalibrated.sampled_compress_seconds, b / 1.6e9, 1e-9);
  // That compressed save took 1024 ms (compression and writes taking turns
  // on two cores): k = 3.05, so the next save at this disk speed is none.
  ckpt::AutoCalibration cal;
  cal.Observe(1.024, uncalibrated.sampled_compress_seconds);
  ASSERT_TRUE(cal.compress_slowdown.has_value());
  EXPECT_NEAR(*cal.compress_slowdown, 1.024 / (b / 1.6e9), 1e-9);
  const auto calibrated = ckpt::ChooseCompression(big, 1, disk, sample, cal);
  EXPECT_FALSE(calibrated.compress) << calibrated.why;
  EXPECT_EQ(calibrated.sampled_compress_seconds, 0);
  EXPECT_NE(calibrated.why.find("\"compress_slowdown\":3.05"), std::string::npos) << calibrated.why;
  // On a slow disk the write term dominates: compressing still pays.
  const auto slow = ckpt::ChooseCompression(big, 1, 200e6, sample, cal);
  EXPECT_TRUE(slow.compress) << slow.why;
  // Each observation moves k halfway; outliers are clamped; nothing
  // measured is ignored.
  ckpt::AutoCalibration c2;
  c2.Observe(2.0, 1.0);
  c2.Observe(1.0, 1.0);
  EXPECT_NEAR(*c2.compress_slowdown, 1.5, 1e-9);
  c2.Observe(100.0, 1.0);
  EXPECT_NEAR(*c2.compress_slowdown, 0.5 * 1.5 + 0.5 * 8.0, 1e-9);
  c2.Observe(0, 1.0);
  c2.Observe(1.0, 0);
  EXPECT_NEAR(*c2.compress_slowdown, 4.75, 1e-9);
}

TEST(AutoCompressionTest, SampleMeasuresRatioAndThroughput) {
  ckpt::ThreadPool pool(2);
  const std::vector<float> w = Weights(1 << 20, 7);
  std::vector<uint8_t> zeros(1 << 20, 0);
  std::vector<ckpt::SampleSource> state = {
      {{reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4}, 4, true}, {zeros, 1, false}};
  auto s = ckpt::SampleCompression(state, 1, 64 << 10, &pool);
  EXPECT_EQ(s.sampled_bytes, 4 * (64 << 10)) << "two windows per pool thread";
  EXPECT_GT(s.bytes_per_s, 0);
  EXPECT_GT(s.ratio, 0.0);
  EXPECT_LT(s.ratio, 1.0);
  // A state smaller than one window is sampled whole, once.
  std::vector<ckpt::SampleSource> tiny = {{{zeros.data(), 1000}, 1, false}};
  EXPECT_EQ(ckpt::SampleCompression(tiny, 1, 64 << 10, &pool).sampled_bytes, 1000);
}

}  // namespace
}  // namespace oomguard
