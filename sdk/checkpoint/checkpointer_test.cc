// Unit tests of the checkpoint component: codec, layout, round trips,
// asynchronous saves, retention, corruption handling, the multi-rank seam and
// the RecoveryStore view. Also compiled under ThreadSanitizer
// (oomguard_ckpt_tsan_tests), so sizes stay small. Over 500 lines: the
// SavedRun fixture (a model, its registration and a save loop) serves every
// case; splitting the file would copy it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <thread>

#include "oomguard/checkpoint.h"
#include "oomguard/faults.h"
#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/compression.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/scratch_dir.h"
#include "sdk/checkpoint/xxh.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

using TempDir = ckpt::ScratchDir;

CheckpointOptions Opts(const std::string& dir) {
  CheckpointOptions o;
  o.dir = dir;
  o.fsync = false;  // scratch directories; durability is tested by the kill tests
  o.chunk_bytes = 4096;
  o.threads = 2;
  return o;
}

// Values that look like trained weights: smooth, signed, small.
std::vector<float> Weights(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 0.02f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

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
    for (size_t bytes : {0u, 1u, 15u, 16u, 31u, 32u, 63u, 64u, 65u, 127u, 128u, 129u, 255u, 256u, 1000u, 4099u,
                         65536u + 7u}) {
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

TEST(OptionsTest, BadOptionsNameTheField) {
  TempDir d;
  auto o = Opts(d.path());
  o.world_size = 0;
  auto c = Checkpointer::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("world_size"), std::string::npos);
  o = Opts(d.path());
  o.compression_level = 0;
  EXPECT_EQ(Checkpointer::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = Opts("");  // in memory only: valid, but only with its snapshot
  EXPECT_TRUE(Checkpointer::Create(o).ok());
  o.keep_snapshot = false;
  EXPECT_EQ(Checkpointer::Create(o).status().code(), StatusCode::kInvalidArgument);
}

// Every dtype, a scalar, an empty tensor, odd shapes, a tensor across many
// chunks with a partial edge chunk, and an object, through disk and back.
TEST(CheckpointerTest, RoundTripEveryDtypeAndShape) {
  TempDir d;
  struct T {
    std::string path;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
  };
  std::vector<T> ts;
  std::mt19937 rng(7);
  for (int i = 0; i <= static_cast<int>(DType::kBool); ++i) {
    DType dt = static_cast<DType>(i);
    T t{"all/" + std::string(DTypeName(dt)), dt, {3, 37}, {}};
    t.data.resize(3 * 37 * DTypeSize(dt));
    for (auto& b : t.data) b = static_cast<uint8_t>(rng());
    if (dt == DType::kBool)
      for (auto& b : t.data) b &= 1;
    ts.push_back(std::move(t));
  }
  ts.push_back({"odd/scalar", DType::kFloat64, {}, std::vector<uint8_t>(8, 0x3f)});
  ts.push_back({"odd/empty", DType::kFloat32, {0, 5}, {}});
  ts.push_back({"odd/one", DType::kInt32, {1, 1, 1}, {1, 2, 3, 4}});
  {
    auto w = Weights(3 * 7001, 3);  // 84 KB: ~21 chunks of 4 KiB, the last one partial
    T big{"model/big.weight", DType::kFloat32, {3, 7001}, std::vector<uint8_t>(w.size() * 4)};
    std::memcpy(big.data.data(), w.data(), big.data.size());
    ts.push_back(std::move(big));
  }
  std::vector<uint8_t> obj = {1, 2, 3, 0, 255};
  std::vector<uint8_t> obj_loaded;

  auto register_all = [&](Checkpointer* c, std::vector<std::vector<uint8_t>>* bufs) {
    for (size_t i = 0; i < ts.size(); ++i)
      ASSERT_TRUE(c->AddTensor(ts[i].path, ts[i].dtype, ts[i].shape, (*bufs)[i].data()).ok());
    ASSERT_TRUE(c->AddObject(
                     "train/position", [&] { return obj; },
                     [&](std::span<const uint8_t> b) {
                       obj_loaded.assign(b.begin(), b.end());
                       return Status::Ok();
                     })
                    .ok());
  };
  {
    std::vector<std::vector<uint8_t>> bufs;
    for (auto& t : ts) bufs.push_back(t.data);
    auto c = Checkpointer::Create(Opts(d.path())).value();
    register_all(c.get(), &bufs);
    ASSERT_TRUE(c->SaveAsync(5).ok());
    ASSERT_TRUE(c->Wait().ok());
    EXPECT_EQ(c->DurableSteps(), std::vector<int64_t>{5});
    EXPECT_EQ(c->Stats().checkpoints_written, 1);
  }
  std::vector<std::vector<uint8_t>> bufs;
  for (auto& t : ts) bufs.push_back(std::vector<uint8_t>(t.data.size(), 0xee));
  auto c = Checkpointer::Create(Opts(d.path())).value();
  EXPECT_EQ(c->DurableSteps(), std::vector<int64_t>{5});
  register_all(c.get(), &bufs);
  auto step = c->LoadLatest();
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(*step, 5);
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_EQ(bufs[i], ts[i].data) << ts[i].path;
  EXPECT_EQ(obj_loaded, obj);

  EXPECT_TRUE(VerifyCheckpoint(d.path(), 5, 1).ok());
  auto info = InspectShard(d.path() + "/step-00000005/rank-00000.h5");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->format, kCheckpointFormat);
  EXPECT_EQ(info->step, 5);
  bool saw_big = false;
  for (const auto& t : info->tensors) {
    if (t.path != "/model/big.weight") continue;
    saw_big = true;
    EXPECT_EQ(t.dtype, "float32");
    EXPECT_EQ(t.xxh3.size(), 16u);
    ASSERT_EQ(t.filters.size(), 2u);
    EXPECT_EQ(t.filters[0], "shuffle");
    EXPECT_EQ(t.filters[1], "zstd(level=1)");
    EXPECT_LT(t.stored_bytes, t.bytes);
  }
  EXPECT_TRUE(saw_big);
}

TEST(CheckpointerTest, LoadRejectsShapeOrDtypeMismatch) {
  TempDir d;
  std::vector<float> a(100, 1.f);
  {
    auto c = Checkpointer::Create(Opts(d.path())).value();
    ASSERT_TRUE(c->AddTensor("m/a", DType::kFloat32, {10, 10}, a.data()).ok());
    ASSERT_TRUE(c->SaveAsync(0).ok());
    ASSERT_TRUE(c->Wait().ok());
  }
  auto c = Checkpointer::Create(Opts(d.path())).value();
  ASSERT_TRUE(c->AddTensor("m/a", DType::kFloat32, {20, 5}, a.data()).ok());
  auto s = c->LoadLatest();
  EXPECT_EQ(s.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("/m/a"), std::string::npos) << s.status();
  EXPECT_EQ(c->AddTensor("m/a", DType::kFloat32, {1}, a.data()).code(), StatusCode::kInvalidArgument);
}

// A state large enough for the staging copy to be split across threads (in
// 4 MiB slices, with sizes that are not multiples of a slice): the snapshot
// and the shard must hold exactly the bytes of the step, although training
// changes the tensors right after SaveAsync returns.
TEST(CheckpointerTest, ParallelStagingCopiesEveryByte) {
  TempDir d;
  std::vector<std::vector<uint8_t>> t = {std::vector<uint8_t>((9 << 20) + 3), std::vector<uint8_t>(7 << 20),
                                         std::vector<uint8_t>(5), std::vector<uint8_t>((4 << 20) - 1)};
  auto fill = [&](uint8_t salt) {
    for (size_t k = 0; k < t.size(); ++k)
      for (size_t i = 0; i < t[k].size(); ++i) t[k][i] = static_cast<uint8_t>(i * 31 + k * 7 + salt);
  };
  for (int stagers : {1, 3}) {
    auto o = Opts(d.path() + "/s" + std::to_string(stagers));
    o.stage_threads = stagers;
    o.chunk_bytes = 1 << 20;
    auto c = Checkpointer::Create(o).value();
    for (size_t k = 0; k < t.size(); ++k)
      ASSERT_TRUE(c->AddTensor("m/t" + std::to_string(k), DType::kUInt8, {static_cast<int64_t>(t[k].size())},
                               t[k].data())
                      .ok());
    fill(1);
    const auto step0 = t;
    ASSERT_TRUE(c->SaveAsync(0).ok());
    fill(2);  // training goes on while the writer works
    ASSERT_TRUE(c->Wait().ok());
    auto expect_step0 = [&] {
      for (size_t k = 0; k < t.size(); ++k) ASSERT_TRUE(t[k] == step0[k]) << "tensor " << k;
    };
    ASSERT_TRUE(c->Restore(0).ok());  // from the in-memory snapshot
    expect_step0();
    EXPECT_EQ(c->Stats().restores_from_memory, 1);
    fill(3);
    ASSERT_TRUE(c->LoadLatest().ok());  // from the shard
    expect_step0();
  }
  CheckpointOptions bad = Opts(d.path());
  bad.stage_threads = -1;
  auto r = Checkpointer::Create(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("stage_threads"), std::string::npos) << r.status();
}

// A fixture with one tensor that training mutates between saves.
class SavedRun : public ::testing::Test {
 protected:
  void Make(CheckpointOptions o) {
    c_ = Checkpointer::Create(o).value();
    ASSERT_TRUE(c_->AddTensor("model/w", DType::kFloat32, {64, 100}, w_.data()).ok());
    ASSERT_TRUE(c_->AddObject(
                      "train/counter",
                      [&] {
                        std::vector<uint8_t> b(8);
                        std::memcpy(b.data(), &counter_, 8);
                        return b;
                      },
                      [&](std::span<const uint8_t> b) {
                        if (b.size() != 8)
                          return Status::DataLoss("counter has " + std::to_string(b.size()) + " bytes");
                        std::memcpy(&counter_, b.data(), 8);
                        return Status::Ok();
                      })
                    .ok());
  }
  void Train(int64_t step) {
    for (size_t i = 0; i < w_.size(); ++i) w_[i] = static_cast<float>(std::sin(0.001 * i + step));
    counter_ = step;
  }
  // Saves steps 0..n-1 and waits.
  void SaveSteps(int n) {
    for (int s = 0; s < n; ++s) {
      Train(s);
      ASSERT_TRUE(c_->SaveAsync(s).ok());
    }
    ASSERT_TRUE(c_->Wait().ok());
  }
  std::string Shard(int64_t step) { return d_.path() + "/" + ckpt::StepDirName(step) + "/rank-00000.h5"; }

  TempDir d_;
  std::vector<float> w_ = std::vector<float>(6400);
  int64_t counter_ = 0;
  std::unique_ptr<Checkpointer> c_;
};

TEST_F(SavedRun, RetentionKeepsTheLastK) {
  auto o = Opts(d_.path());
  o.keep = 2;
  Make(o);
  SaveSteps(5);
  auto list = ListCheckpoints(d_.path()).value();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].step, 3);
  EXPECT_EQ(list[1].step, 4);
  EXPECT_TRUE(list[1].committed);
  EXPECT_EQ(c_->DurableSteps(), (std::vector<int64_t>{3, 4})) << "what retention removed is no longer durable";
}

// Retention deletes in the background: what it dropped is out of sight when
// the save returns and gone from disk once the Checkpointer is; what a
// crash left half-deleted goes when the next Checkpointer starts.
TEST_F(SavedRun, RetentionDeletesInTheBackgroundAndCleansUpAfterACrash) {
  auto o = Opts(d_.path());
  o.keep = 1;
  Make(o);
  SaveSteps(3);
  auto entries = [&] {  // what the directory holds beside the rank's lock file
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(d_.path()))
      if (e.path().filename() != "LOCK.rank-00000") names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  for (const std::string& name : entries())
    EXPECT_TRUE(name == "step-00000002" || name.rfind(".removing-", 0) == 0) << name;
  c_.reset();
  EXPECT_EQ(entries(), std::vector<std::string>{"step-00000002"});
  // A crash in the middle of a deletion.
  fs::create_directories(d_.path() + "/.removing-step-00000001-0123456789abcdef/sub");
  std::ofstream(d_.path() + "/.removing-step-00000001-0123456789abcdef/sub/rank-00000.h5") << "half gone";
  Make(o);
  EXPECT_EQ(c_->DurableSteps(), std::vector<int64_t>{2});
  c_.reset();
  EXPECT_EQ(entries(), std::vector<std::string>{"step-00000002"});
}

TEST_F(SavedRun, SaveOverlapsTrainingAndEachSaveHoldsItsOwnStep) {
  Make(Opts(d_.path()));
  // Training mutates the tensor right after SaveAsync returns, while the
  // background writer compresses: the shard must still hold the staged values.
  for (int s = 0; s < 6; ++s) {
    Train(s);
    ASSERT_TRUE(c_->SaveAsync(s).ok());
    Train(1000 + s);
  }
  ASSERT_TRUE(c_->Wait().ok());
  for (int64_t s : {3, 4, 5}) {
    ASSERT_TRUE(c_->Load(s).ok());
    EXPECT_EQ(counter_, s);
    EXPECT_FLOAT_EQ(w_[10], static_cast<float>(std::sin(0.01 + s)));
  }
  EXPECT_EQ(c_->Stats().stall_ms.size(), 6u);
}

// The stall copies into buffers that exist already: the first save allocates
// one, the writer prepares the second in the background (the retained
// snapshot keeps the first), and later saves alternate between the two.
TEST_F(SavedRun, OnlyTheFirstSaveAllocatesStagingInsideItsStall) {
  for (bool keep_snapshot : {true, false}) {
    TempDir d;
    auto o = Opts(d.path());
    o.keep_snapshot = keep_snapshot;
    Make(o);
    for (int s = 0; s < 5; ++s) {
      Train(s);
      ASSERT_TRUE(c_->SaveAsync(s).ok());
      ASSERT_TRUE(c_->Wait().ok());
    }
    EXPECT_EQ(c_->Stats().stall_allocations, 1) << "keep_snapshot " << keep_snapshot;
    if (keep_snapshot) {
      ASSERT_TRUE(c_->Restore(4).ok());
      EXPECT_EQ(counter_, 4);
      EXPECT_FLOAT_EQ(w_[5], static_cast<float>(std::sin(0.005 + 4)));
    }
    ASSERT_TRUE(c_->Load(3).ok());
    EXPECT_EQ(counter_, 3);
    EXPECT_FLOAT_EQ(w_[5], static_cast<float>(std::sin(0.005 + 3)));
    c_.reset();
  }
}

TEST_F(SavedRun, SnapshotRestoresWithoutDisk) {
  Make(Opts(d_.path()));
  SaveSteps(3);
  EXPECT_EQ(c_->SnapshotStep(), 2);
  Train(99);
  fs::remove_all(d_.path() + "/step-00000002");  // prove the restore does not read disk
  Status r = c_->Restore(2);
  ASSERT_TRUE(r.ok()) << r;
  EXPECT_EQ(counter_, 2);
  EXPECT_FLOAT_EQ(w_[0], static_cast<float>(std::sin(2.0)));
  EXPECT_EQ(c_->Stats().restores_from_memory, 1);
}

TEST_F(SavedRun, RestoreFromDiskWhenNoSnapshot) {
  auto o = Opts(d_.path());
  o.keep_snapshot = false;
  Make(o);
  SaveSteps(3);
  EXPECT_FALSE(c_->SnapshotStep().has_value());
  Train(99);
  ASSERT_EQ(c_->DurableSteps().back(), 2);
  Status r = c_->Restore(2);
  ASSERT_TRUE(r.ok()) << r;
  EXPECT_EQ(counter_, 2);
}

TEST_F(SavedRun, RestoreGivesExactlyTheStepOrFails) {
  auto o = Opts(d_.path());
  o.keep_snapshot = false;
  Make(o);
  SaveSteps(3);  // steps 0, 1, 2 on disk
  Train(99);
  // Step 5 was never saved: an older step would be a different state.
  Status r = c_->Restore(5);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(counter_, 99) << "nothing was restored";
  // A step whose shard is gone is not restorable and no longer listed.
  fs::remove(Shard(1));
  EXPECT_EQ(c_->DurableSteps(), (std::vector<int64_t>{0, 2}));
  EXPECT_FALSE(c_->Restore(1).ok());
  EXPECT_EQ(counter_, 99);
  ASSERT_TRUE(c_->Restore(0).ok());
  EXPECT_EQ(counter_, 0);
}

TEST_F(SavedRun, SnapshotKeepsTheCurrentStateInMemoryWithoutWriting) {
  Make(Opts(d_.path()));
  Train(7);
  ASSERT_TRUE(c_->Snapshot(-1).ok());
  EXPECT_EQ(c_->SnapshotStep(), -1);
  EXPECT_TRUE(c_->DurableSteps().empty());
  EXPECT_TRUE(ListCheckpoints(d_.path()).value().empty()) << "a snapshot writes nothing";
  Train(8);
  ASSERT_TRUE(c_->Restore(-1).ok());
  EXPECT_EQ(counter_, 7);
  // A later save replaces the snapshot.
  ASSERT_TRUE(c_->SaveAsync(0).ok());
  ASSERT_TRUE(c_->Wait().ok());
  EXPECT_EQ(c_->SnapshotStep(), 0);
}

TEST_F(SavedRun, SnapshotRefusesAStateLargerThanTheStagingBudget) {
  auto o = Opts(d_.path());
  o.staging_budget_bytes = 3 * 4096;  // the tensor is 25.6 KB
  Make(o);
  Status s = c_->Snapshot(-1);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_FALSE(c_->SnapshotStep().has_value());
}

TEST_F(SavedRun, StateLargerThanBudgetIsStagedInPieces) {
  auto o = Opts(d_.path());
  o.staging_budget_bytes = 3 * 4096;  // the tensor is 25.6 KB
  Make(o);
  SaveSteps(2);
  EXPECT_FALSE(c_->SnapshotStep().has_value()) << "no snapshot beyond the budget";
  Train(50);
  ASSERT_TRUE(c_->LoadLatest().ok());
  EXPECT_EQ(counter_, 1);
  EXPECT_FLOAT_EQ(w_[100], static_cast<float>(std::sin(0.1 + 1)));
}

TEST_F(SavedRun, BudgetForOneSnapshotStillRetainsTheNewest) {
  auto o = Opts(d_.path());
  o.staging_budget_bytes = 6400 * 4 + 64;  // one copy (+ the counter), not two
  Make(o);
  SaveSteps(4);
  EXPECT_EQ(c_->SnapshotStep(), 3);
  ASSERT_TRUE(c_->Restore(3).ok());
  EXPECT_EQ(counter_, 3);
}

// Corruption: each kind is detected, never loaded, and the previous checkpoint is used.
TEST_F(SavedRun, TruncatedShardFallsBackToPrevious) {
  Make(Opts(d_.path()));
  SaveSteps(3);
  fs::resize_file(Shard(2), fs::file_size(Shard(2)) / 2);
  Train(77);
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 1);
  EXPECT_EQ(counter_, 1);
  EXPECT_EQ(c_->Stats().corrupt_skipped, 1);
  Status v = VerifyCheckpoint(d_.path(), 2);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss);
  EXPECT_NE(v.message().find("rank-00000.h5"), std::string::npos) << v;
}

TEST_F(SavedRun, FlippedByteIsDetectedByFileAndTensorChecksums) {
  auto o = Opts(d_.path());
  Make(o);
  SaveSteps(3);
  // One byte inside the stored bytes of the tensor's third chunk.
  haddr_t addr = 0;
  {
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(2).c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
    ckpt::H5Handle ds(H5Dopen2(f.get(), "/model/w", H5P_DEFAULT));
    hsize_t off[2] = {20, 0}, size = 0;
    unsigned mask = 0;
    ASSERT_GE(H5Dget_chunk_info_by_coord(ds.get(), off, &mask, &addr, &size), 0);
    addr += size / 2;
  }
  {
    std::fstream f(Shard(2), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(addr));
    char ch = 0;
    f.read(&ch, 1);
    f.seekp(static_cast<std::streamoff>(addr));
    ch = static_cast<char>(ch ^ 0x5a);
    f.write(&ch, 1);
  }
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 1);
  // Without the file checksum, the per-tensor checksum (or the decoder) catches it.
  c_.reset();
  o.verify_file_checksum = false;
  Make(o);
  auto direct = c_->Load(2);
  ASSERT_EQ(direct.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(direct.status().message().find("/model/w"), std::string::npos) << direct.status();
}

// Fixed choices are honoured and recorded, and an uncompressed shard is
// verified as strictly as a compressed one.
TEST_F(SavedRun, FixedCompressionIsRecordedAndVerified) {
  for (auto mode : {CheckpointCompression::kNone, CheckpointCompression::kZstd}) {
    const bool none = mode == CheckpointCompression::kNone;
    SCOPED_TRACE(none ? "none" : "zstd");
    TempDir d;
    auto o = Opts(d.path());
    o.compression = mode;
    o.compression_level = 2;
    Make(o);
    for (int s = 0; s < 3; ++s) {
      Train(s);
      ASSERT_TRUE(c_->SaveAsync(s).ok());
    }
    ASSERT_TRUE(c_->Wait().ok());
    const std::string want = none ? "none" : "zstd-2";
    EXPECT_EQ(c_->Stats().last_compression, want);
    EXPECT_TRUE(c_->Stats().last_compression_auto.empty()) << "a fixed choice has no auto record";
    const std::string step2 = d.path() + "/" + ckpt::StepDirName(2);
    auto m = ckpt::ReadManifest(step2).value();
    EXPECT_EQ(m.format, std::string(kCheckpointFormat));
    EXPECT_EQ(m.shards[0].compression, want);
    auto info = InspectShard(step2 + "/rank-00000.h5");
    ASSERT_TRUE(info.ok()) << info.status();
    for (const auto& t : info->tensors)
      if (t.path == "/model/w") EXPECT_EQ(t.filters.empty(), none);
    Train(2);
    const std::vector<float> saved = w_;
    Train(99);
    ASSERT_TRUE(c_->Load(2).ok());
    EXPECT_EQ(w_, saved);
    EXPECT_EQ(counter_, 2);
    // A flipped byte inside a stored chunk: refused with and without the
    // file check.
    haddr_t addr = 0;
    {
      ckpt::Hdf5Lock lock;
      ckpt::H5Handle f(H5Fopen((step2 + "/rank-00000.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
      ckpt::H5Handle ds(H5Dopen2(f.get(), "/model/w", H5P_DEFAULT));
      hsize_t off[2] = {20, 0}, size = 0;
      unsigned mask = 0;
      ASSERT_GE(H5Dget_chunk_info_by_coord(ds.get(), off, &mask, &addr, &size), 0);
      addr += size / 2;
    }
    {
      std::fstream f(step2 + "/rank-00000.h5", std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(static_cast<std::streamoff>(addr));
      char ch = 0;
      f.read(&ch, 1);
      f.seekp(static_cast<std::streamoff>(addr));
      ch = static_cast<char>(ch ^ 0x5a);
      f.write(&ch, 1);
    }
    auto latest = c_->LoadLatest();
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(*latest, 1);
    c_.reset();
    o.verify_file_checksum = false;
    Make(o);
    auto direct = c_->Load(2);
    ASSERT_EQ(direct.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(direct.status().message().find("/model/w"), std::string::npos) << direct.status();
    c_.reset();
  }
}

// Auto on a small state compresses and says why in the manifest.
TEST_F(SavedRun, AutoRecordsItsChoiceInTheManifest) {
  Make(Opts(d_.path()));
  SaveSteps(1);
  auto m = ckpt::ReadManifest(d_.path() + "/" + ckpt::StepDirName(0)).value();
  EXPECT_EQ(m.shards[0].compression, "zstd-1");
  EXPECT_NE(m.shards[0].auto_choice.find("small state"), std::string::npos) << m.shards[0].auto_choice;
  EXPECT_EQ(c_->Stats().last_compression, "zstd-1");
  EXPECT_NE(c_->Stats().last_compression_auto.find("small state"), std::string::npos);
}

// Loading hashes the file while HDF5 parses it, so HDF5 may meet a corrupt
// metadata block before the file checksum has failed. Shards are written with
// HDF5 1.10 structures, whose metadata carries checksums: a flipped byte
// anywhere outside the chunks never crashes the loader and never loads wrong
// values; with the file checksum on, every flip is refused.
TEST_F(SavedRun, FlippedMetadataByteNeverLoadsWrongValues) {
  auto o = Opts(d_.path());
  Make(o);
  SaveSteps(3);
  c_.reset();
  // The byte ranges that hold chunks; everything else is metadata or free space.
  std::vector<std::pair<haddr_t, hsize_t>> chunks;
  {
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(2).c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
    for (const char* name : {"/model/w", "/train/counter"}) {
      ckpt::H5Handle ds(H5Dopen2(f.get(), name, H5P_DEFAULT));
      ckpt::H5Handle space(H5Dget_space(ds.get()));
      hsize_t n = 0;
      ASSERT_GE(H5Dget_num_chunks(ds.get(), space.get(), &n), 0);
      for (hsize_t i = 0; i < n; ++i) {
        haddr_t addr = 0;
        hsize_t size = 0;
        ASSERT_GE(H5Dget_chunk_info(ds.get(), space.get(), i, nullptr, nullptr, &addr, &size), 0);
        chunks.emplace_back(addr, size);
      }
    }
  }
  std::ifstream in(Shard(2), std::ios::binary);
  const std::string original((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  auto in_chunk = [&](size_t off) {
    for (auto [a, n] : chunks)
      if (off >= a && off < a + n) return true;
    return false;
  };
  int flips = 0, refused_without_file_hash = 0;
  auto fds = [] { int n = 0; for ([[maybe_unused]] auto& e : fs::directory_iterator("/proc/self/fd")) ++n; return n; };
  const int fds_before = fds();
  for (size_t off = 0; off < original.size(); off += 13) {
    if (in_chunk(off)) continue;
    std::string bad = original;
    bad[off] = static_cast<char>(bad[off] ^ 0x41);
    {
      std::ofstream out(Shard(2), std::ios::binary | std::ios::trunc);
      out.write(bad.data(), static_cast<std::streamsize>(bad.size()));
    }
    ++flips;
    for (bool verify : {false, true}) {
      o.verify_file_checksum = verify;
      Make(o);
      Train(99);
      auto r = c_->Load(2);
      if (verify) {
        EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << "byte " << off << " was loaded";
      } else if (r.ok()) {
        // Free space or a field the reader never uses: the values must be exact.
        EXPECT_EQ(counter_, 2) << "byte " << off;
        for (size_t i = 0; i < w_.size(); i += 97)
          ASSERT_EQ(w_[i], static_cast<float>(std::sin(0.001 * i + 2))) << "byte " << off;
      } else {
        EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
        ++refused_without_file_hash;
      }
      c_.reset();
    }
  }
  std::ofstream(Shard(2), std::ios::binary | std::ios::trunc).write(original.data(),
                                                                    static_cast<std::streamsize>(original.size()));
  EXPECT_EQ(fds(), fds_before) << "a refused shard left a file descriptor open";
  EXPECT_GT(flips, 50);
  // Most metadata is checksummed by HDF5 itself.
  EXPECT_GT(refused_without_file_hash, flips / 2) << refused_without_file_hash << " of " << flips;
}

TEST_F(SavedRun, MissingManifestIsIgnored) {
  Make(Opts(d_.path()));
  SaveSteps(3);
  fs::remove(d_.path() + "/step-00000002/MANIFEST.json");
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, 1);
  EXPECT_EQ(VerifyCheckpoint(d_.path(), 2).code(), StatusCode::kDataLoss);
  auto list = ListCheckpoints(d_.path()).value();
  EXPECT_FALSE(list.back().committed);
}

TEST_F(SavedRun, MissingShardFallsBackToPrevious) {
  Make(Opts(d_.path()));
  SaveSteps(3);
  fs::remove(Shard(2));
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, 1);
  Status v = VerifyCheckpoint(d_.path(), 2);
  EXPECT_NE(v.message().find("missing"), std::string::npos) << v;
}

TEST_F(SavedRun, ManifestNamingAnotherWorldSizeIsRefused) {
  Make(Opts(d_.path()));
  SaveSteps(3);
  // Rewrite step 2's manifest as if two ranks had written it.
  auto m = ckpt::ReadManifest(d_.path() + "/step-00000002").value();
  m.world_size = 2;
  ckpt::ManifestShard other = m.shards[0];
  other.rank = 1;
  other.file = "rank-00001.h5";
  m.shards.push_back(other);
  ASSERT_TRUE(
      ckpt::WriteFileDurably(d_.path() + "/step-00000002/MANIFEST.json", ckpt::ManifestToJson(m), false)
          .ok());
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, 1);
  EXPECT_EQ(c_->Load(2).status().code(), StatusCode::kDataLoss);
  Status v = VerifyCheckpoint(d_.path(), 2, 1);
  EXPECT_NE(v.message().find("world size 2"), std::string::npos) << v;
}

TEST_F(SavedRun, NothingValidIsDataLossAndEmptyIsNotFound) {
  Make(Opts(d_.path()));
  EXPECT_EQ(c_->LoadLatest().status().code(), StatusCode::kNotFound);
  SaveSteps(1);
  fs::resize_file(Shard(0), 100);
  EXPECT_EQ(c_->LoadLatest().status().code(), StatusCode::kDataLoss);
}

TEST_F(SavedRun, CoordinatorCommitsTheManifest) {
  auto o = Opts(d_.path());
  o.manifest_commit = ManifestCommit::kCoordinated;
  Make(o);
  SaveSteps(2);
  EXPECT_EQ(c_->DurableSteps(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(ListCheckpoints(d_.path()).value().size(), 2u);
  EXPECT_FALSE(ListCheckpoints(d_.path()).value()[1].committed);
  EXPECT_EQ(c_->LoadLatest().status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(c_->Commit(1, 1).ok());
  EXPECT_TRUE(VerifyCheckpoint(d_.path(), 1, 1).ok());
  EXPECT_EQ(c_->Commit(1, 2).code(), StatusCode::kFailedPrecondition);  // rank 1's shard is absent
  Train(9);
  EXPECT_EQ(*c_->LoadLatest(), 1);
  EXPECT_EQ(counter_, 1);
}

TEST_F(SavedRun, TriggersEveryNStepsAndAfterRecovery) {
  auto o = Opts(d_.path());
  o.every_steps = 3;
  o.keep = 0;
  Make(o);
  for (int64_t s = 0; s < 7; ++s) {
    Train(s);
    ASSERT_TRUE(c_->OnStepCommitted(s, /*after_recovery=*/s == 4).ok());
  }
  ASSERT_TRUE(c_->Wait().ok());
  std::vector<int64_t> steps;
  auto list = ListCheckpoints(d_.path());
  ASSERT_TRUE(list.ok());
  for (const auto& i : *list) steps.push_back(i.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 4, 5}));
}

TEST_F(SavedRun, InjectedWriterFaultIsReportedNotFatal) {
  Make(Opts(d_.path()));
  SaveSteps(1);
  ASSERT_TRUE(SetFaultRules("oom@step=1,site=ckpt_write").ok());
  Train(1);
  ASSERT_TRUE(c_->SaveAsync(1).ok());
  Status w = c_->Wait();
  ClearFaultRules();
  EXPECT_FALSE(w.ok());
  EXPECT_EQ(c_->DurableSteps(), std::vector<int64_t>{0});
  EXPECT_FALSE(fs::exists(Shard(1)));
  EXPECT_EQ(c_->Stats().save_failures, 1);
  EXPECT_FALSE(c_->Wait().ok()) << "the newest save failed: Wait keeps saying so";
  // A later save succeeds: the failure is superseded (Wait is OK again, the
  // stats keep it) and the failed step's directory is cleaned up as litter.
  Train(2);
  ASSERT_TRUE(c_->SaveAsync(2).ok());
  EXPECT_TRUE(c_->Wait().ok());
  EXPECT_EQ(c_->Stats().save_failures, 1);
  EXPECT_FALSE(c_->Stats().last_error.ok());
  EXPECT_FALSE(fs::exists(d_.path() + "/step-00000001"));
  EXPECT_EQ(c_->DurableSteps(), (std::vector<int64_t>{0, 2}));
}

TEST_F(SavedRun, ManifestCommitFaultBecomesAStatus) {
  auto o = Opts(d_.path());
  o.manifest_commit = ManifestCommit::kCoordinated;  // the guard on rank 0 commits
  Make(o);
  SaveSteps(2);
  EXPECT_EQ(c_->DurableSteps(), (std::vector<int64_t>{0, 1})) << "shards count as durable before any manifest";
  ASSERT_TRUE(SetFaultRules("host_oom@step=1,site=ckpt_manifest").ok());
  Status s = c_->Commit(1, 1);  // must not throw
  ClearFaultRules();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_FALSE(fs::exists(d_.path() + "/step-00000001/MANIFEST.json"));
  ASSERT_TRUE(c_->Commit(1, 1).ok());
  EXPECT_TRUE(fs::exists(d_.path() + "/step-00000001/MANIFEST.json"));
}

// A multi-rank checkpointer left at its defaults never commits alone: a rank
// must not mark a step complete that the others may not have written.
TEST_F(SavedRun, SeveralRanksDefaultToCoordinatedCommit) {
  auto o = Opts(d_.path());
  o.world_size = 2;
  Make(o);
  SaveSteps(1);
  EXPECT_FALSE(fs::exists(d_.path() + "/step-00000000/MANIFEST.json"));
  EXPECT_EQ(c_->DurableSteps(), std::vector<int64_t>{0});
}

// Piece mode: a staging failure after the writer began consuming pieces must
// release the writer, so that Wait, the next save and the destructor return.
TEST_F(SavedRun, StagingFailureInPieceModeDoesNotHangTheWriter) {
  auto o = Opts(d_.path());
  o.staging_budget_bytes = 3 * 4096;  // the tensor is 25.6 KB: staged in pieces
  o.chunk_bytes = 4096;
  Make(o);
  Train(0);
  ASSERT_TRUE(SetFaultRules("oom@step=0,site=ckpt_stage,micro=2").ok());
  Status s = c_->SaveAsync(0);
  ClearFaultRules();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  auto waited = std::async(std::launch::async, [&] { return c_->Wait(); });
  ASSERT_EQ(waited.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "the writer hangs";
  EXPECT_FALSE(waited.get().ok()) << "the aborted save is the newest: Wait reports it";
  EXPECT_TRUE(c_->DurableSteps().empty());
  Train(1);
  ASSERT_TRUE(c_->SaveAsync(1).ok());
  ASSERT_TRUE(c_->Wait().ok()) << "a later save succeeds";
  EXPECT_EQ(c_->DurableSteps(), std::vector<int64_t>{1});
}

// A failure that Wait reports is not swallowed by anything that waits on the
// way: a load, a restore from disk.
TEST_F(SavedRun, LoadAndRestoreKeepTheNewestSaveFailureForWait) {
  Make(Opts(d_.path()));
  SaveSteps(1);
  ASSERT_TRUE(SetFaultRules("oom@step=1,site=ckpt_write").ok());
  Train(1);
  ASSERT_TRUE(c_->SaveAsync(1).ok());
  ASSERT_TRUE(c_->Load(0).ok());  // waits for the save in flight first
  ClearFaultRules();
  EXPECT_FALSE(c_->Wait().ok()) << "Load must not clear the error";
  ASSERT_TRUE(c_->Restore(0).ok());
  EXPECT_FALSE(c_->Wait().ok()) << "Restore must not clear the error";
  EXPECT_FALSE(c_->Wait().ok()) << "nor Wait itself";
}

// SaveAsync never throws: what a save callback, a fault point or an
// allocation throws comes back as a status.
TEST_F(SavedRun, SaveAsyncTurnsExceptionsIntoStatuses) {
  Make(Opts(d_.path()));
  ASSERT_TRUE(SetFaultRules("host_oom@step=0,site=ckpt_stage").ok());
  Status s = c_->SaveAsync(0);
  ClearFaultRules();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  ASSERT_TRUE(c_->AddObject("train/bad", [] () -> std::vector<uint8_t> { throw std::runtime_error("save failed"); },
                            [](std::span<const uint8_t>) { return Status::Ok(); })
                  .ok());
  s = c_->SaveAsync(1);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("save failed"), std::string::npos) << s;
}

// Issue 28, row 9: a save that fails while it is staged counts as a failed
// save (Stats, Wait), like one that fails in the background; an exception
// that is not a std::exception (a Python KeyboardInterrupt on its way
// through C++) is counted and passed on, never swallowed.
TEST_F(SavedRun, StagingFailuresAreCountedAndForeignExceptionsPassThrough) {
  Make(Opts(d_.path()));
  bool foreign = false;
  ASSERT_TRUE(c_->AddObject(
                    "train/flaky",
                    [&]() -> std::vector<uint8_t> {
                      if (foreign) throw 42;
                      throw std::runtime_error("ValueError: bad state");
                    },
                    [](std::span<const uint8_t>) { return Status::Ok(); })
                  .ok());
  Status s = c_->SaveAsync(0);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  EXPECT_EQ(c_->Stats().save_failures, 1);
  Status waited = c_->Wait();
  EXPECT_FALSE(waited.ok()) << "Wait hid the failed save";
  EXPECT_NE(waited.message().find("ValueError: bad state"), std::string::npos) << waited;
  foreign = true;
  EXPECT_THROW((void)c_->SaveAsync(1), int);
  EXPECT_EQ(c_->Stats().save_failures, 2);
  EXPECT_FALSE(c_->Wait().ok());
}

// Issue 28, row 10: a step no directory name can carry is refused before
// anything is staged (it is not a failed save), and nothing is written.
TEST_F(SavedRun, StepsOutsideTheNameableRangeAreInvalidArguments) {
  Make(Opts(d_.path()));
  for (int64_t bad : {int64_t{-1}, int64_t{-3}, kMaxStep + 1, std::numeric_limits<int64_t>::max()}) {
    Status s = c_->SaveAsync(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad << ": " << s;
  }
  EXPECT_TRUE(c_->Wait().ok());
  EXPECT_EQ(c_->Stats().save_failures, 0);
  for (const auto& e : fs::directory_iterator(d_.path()))
    EXPECT_EQ(e.path().filename(), "LOCK.rank-00000") << "something was written beside the rank's lock";
  EXPECT_EQ(ckpt::ParseStepDirName(ckpt::StepDirName(kMaxStep)), kMaxStep);
  EXPECT_FALSE(ckpt::ParseStepDirName("step-" + std::to_string(kMaxStep + 1)).has_value());
}

// Issue 28, row 5: thread counts are bounded options, not a crash.
TEST(OptionsTest, ThreadCountsAreBounded) {
  TempDir d;
  for (int field = 0; field < 2; ++field) {
    CheckpointOptions o = Opts(d.path());
    (field == 0 ? o.threads : o.stage_threads) = 100000;
    auto c = Checkpointer::Create(o);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(field == 0 ? "threads must be in [0, 256]" : "stage_threads"),
              std::string::npos)
        << c.status();
  }
  CheckpointOptions o = Opts(d.path());
  o.threads = kMaxCheckpointThreads;
  EXPECT_TRUE(Checkpointer::Create(o).ok());
}

// Issue 28, row 15: a state path that HDF5 would store under another name
// (cut at a NUL, "." resolved) could never be loaded: refused at registration.
TEST(OptionsTest, StatePathsThatCouldNeverLoadAreRefused) {
  TempDir d;
  auto c = Checkpointer::Create(Opts(d.path())).value();
  float x = 0;
  std::string deep = "w";
  for (int i = 0; i < 65; ++i) deep = "g/" + deep;  // 65 nested groups
  for (const std::string& path : {std::string("model/w\0x", 9), std::string("model/./w"), std::string("a/../w"), deep}) {
    Status s = c->AddTensor(path, DType::kFloat32, {}, &x);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << path;
  }
  EXPECT_TRUE(c->AddTensor(deep.substr(2), DType::kFloat32, {}, &x).ok()) << "64 groups are allowed";
  EXPECT_TRUE(c->AddTensor("model/w", DType::kFloat32, {}, &x).ok());
}

}  // namespace
}  // namespace oomguard
