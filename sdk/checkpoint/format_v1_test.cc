// Checkpoints written in format oomguard-ckpt/1, by the code before format 2
// (testdata/ckpt-v1, see testdata/README.md): today's loader reads them, with
// their whole-file and per-tensor checksums, and refuses them when damaged.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <vector>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/checkpoint_testing.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/scratch_dir.h"

#ifndef OOMGUARD_CKPT_TESTDATA
#error "OOMGUARD_CKPT_TESTDATA must name sdk/checkpoint/testdata"
#endif

namespace oomguard {
namespace {

namespace fs = std::filesystem;

// A writable copy of the fixture: tests never touch the checked-in files.
class FormatV1Test : public ::testing::Test {
 protected:
  FormatV1Test() {
    fs::copy(std::string(OOMGUARD_CKPT_TESTDATA) + "/ckpt-v1", dir_, fs::copy_options::recursive);
  }

  void Make(bool verify_file = true) {
    CheckpointOptions o;
    o.dir = dir_;
    o.fsync = false;
    o.threads = 2;
    o.keep = 0;
    o.verify_file_checksum = verify_file;
    c_ = Checkpointer::Create(o).value();
    state_.Register(c_.get());
  }
  // The values the fixture holds for step s (testdata/README.md).
  void ExpectStep(int s) { EXPECT_TRUE(state_.Holds(s)); }
  std::string Shard(int step) { return dir_ + "/step-0000000" + std::to_string(step) + "/rank-00000.h5"; }
  // Flips one byte in the middle of the chunk of /model/w that holds `row`.
  void FlipChunkByte(int step, hsize_t row) {
    haddr_t addr = 0;
    {
      ckpt::Hdf5Lock lock;
      ckpt::H5Handle f(H5Fopen(Shard(step).c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
      ckpt::H5Handle ds(H5Dopen2(f.get(), "/model/w", H5P_DEFAULT));
      hsize_t off[2] = {row, 0}, size = 0;
      unsigned mask = 0;
      ASSERT_GE(H5Dget_chunk_info_by_coord(ds.get(), off, &mask, &addr, &size), 0);
      addr += size / 2;
    }
    std::fstream f(Shard(step), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(addr));
    char ch = 0;
    f.read(&ch, 1);
    f.seekp(static_cast<std::streamoff>(addr));
    ch = static_cast<char>(ch ^ 0x5a);
    f.write(&ch, 1);
  }

  ckpt::ScratchDir scratch_{"oomguard-v1"};
  std::string dir_ = scratch_.path();
  ckpt_testing::MixedState state_;  // checkpoint_testing.h
  std::unique_ptr<Checkpointer> c_;
};

TEST_F(FormatV1Test, LoadsTheNewestAndAnExactStep) {
  Make();
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 7);
  ExpectStep(7);
  ASSERT_TRUE(c_->Load(3).ok());
  ExpectStep(3);
  EXPECT_EQ(state_.loads(), (std::vector<int64_t>{7, 3}));
  EXPECT_TRUE(VerifyCheckpoint(dir_, 7, 1).ok());
  auto info = InspectShard(Shard(7));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->format, "oomguard-ckpt/1");
}

TEST_F(FormatV1Test, DamagedChunkIsRefusedWithAndWithoutTheFileChecksum) {
  FlipChunkByte(7, 20);
  Make();
  auto s = c_->LoadLatest();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 3) << "the damaged step 7 is skipped";
  ExpectStep(3);
  EXPECT_EQ(state_.loads(), (std::vector<int64_t>{3})) << "step 7's objects are never loaded";
  EXPECT_EQ(VerifyCheckpoint(dir_, 7).code(), StatusCode::kDataLoss);
  Make(/*verify_file=*/false);
  auto direct = c_->Load(7);
  ASSERT_EQ(direct.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(direct.status().message().find("/model/w"), std::string::npos) << direct.status();
}

TEST_F(FormatV1Test, AByteFlippedAnywhereIsRefused) {
  std::string bytes;
  {
    std::ifstream in(Shard(7), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  int refused = 0, tried = 0;
  for (size_t off = 0; off < bytes.size(); off += 61) {
    std::string bad = bytes;
    bad[off] = static_cast<char>(bad[off] ^ 0x10);
    std::ofstream(Shard(7), std::ios::binary | std::ios::trunc)
        .write(bad.data(), static_cast<std::streamsize>(bad.size()));
    ++tried;
    const Status v = VerifyCheckpoint(dir_, 7);
    EXPECT_EQ(v.code(), StatusCode::kDataLoss) << "byte " << off << ": " << v;
    refused += v.code() == StatusCode::kDataLoss;
    // Refusing a file closes what was opened on it. (A flipped superblock byte
    // still makes libhdf5 print "infinite loop closing library" at process
    // exit: the library's own bounded leak on a failed H5Fopen of a malformed
    // file, HDFGroup/hdf5#6677, with no ID left for us to close.)
    ckpt::Hdf5Lock lock;
    EXPECT_EQ(H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL), 0) << "byte " << off << " left HDF5 objects open";
  }
  EXPECT_GT(tried, 100);
  EXPECT_EQ(refused, tried);
}

}  // namespace
}  // namespace oomguard
