// The Checkpointer against damaged checkpoints: each kind of damage
// (truncation, flipped bytes in data or metadata, a missing manifest or
// shard, a manifest of another world size) is detected, never loaded, and
// the previous checkpoint is used; compression choices are recorded and
// verified. Also compiled under ThreadSanitizer (oomguard_ckpt_tsan_tests).
// The SavedRun fixture is in checkpoint_testing.h.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <span>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/checkpoint_testing.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/scratch_dir.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

using ckpt_testing::SavedRun;
using ckpt_testing::ScratchOptions;
using TempDir = ckpt::ScratchDir;

// Corruption: each kind is detected, never loaded, and the previous checkpoint is used.
TEST_F(SavedRun, TruncatedShardFallsBackToPrevious) {
  Make(ScratchOptions(d_.path()));
  SaveSteps(3);
  fs::resize_file(Shard(2), fs::file_size(Shard(2)) / 2);
  Train(77);
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 1);
  EXPECT_EQ(counter_, 1);
  EXPECT_EQ(c_->Stats().corrupt_skipped, 1);
  EXPECT_EQ(loads_, (std::vector<int64_t>{1})) << "the truncated step's object is never loaded";
  Status v = VerifyCheckpoint(d_.path(), 2);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss);
  EXPECT_NE(v.message().find("rank-00000.h5"), std::string::npos) << v;
}

TEST_F(SavedRun, FlippedByteIsDetectedByFileAndTensorChecksums) {
  auto o = ScratchOptions(d_.path());
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
    auto o = ScratchOptions(d.path());
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
  Make(ScratchOptions(d_.path()));
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
  auto o = ScratchOptions(d_.path());
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
  auto fds = [] {
    int n = 0;
    for ([[maybe_unused]] auto& e : fs::directory_iterator("/proc/self/fd")) ++n;
    return n;
  };
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
  std::ofstream(Shard(2), std::ios::binary | std::ios::trunc)
      .write(original.data(), static_cast<std::streamsize>(original.size()));
  EXPECT_EQ(fds(), fds_before) << "a refused shard left a file descriptor open";
  EXPECT_GT(flips, 50);
  // Most metadata is checksummed by HDF5 itself.
  EXPECT_GT(refused_without_file_hash, flips / 2) << refused_without_file_hash << " of " << flips;
}

TEST_F(SavedRun, MissingManifestIsIgnored) {
  Make(ScratchOptions(d_.path()));
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
  Make(ScratchOptions(d_.path()));
  SaveSteps(3);
  fs::remove(Shard(2));
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, 1);
  Status v = VerifyCheckpoint(d_.path(), 2);
  EXPECT_NE(v.message().find("missing"), std::string::npos) << v;
}

TEST_F(SavedRun, ManifestNamingAnotherWorldSizeIsRefused) {
  Make(ScratchOptions(d_.path()));
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
  Make(ScratchOptions(d_.path()));
  EXPECT_EQ(c_->LoadLatest().status().code(), StatusCode::kNotFound);
  SaveSteps(1);
  fs::resize_file(Shard(0), 100);
  EXPECT_EQ(c_->LoadLatest().status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace oomguard
