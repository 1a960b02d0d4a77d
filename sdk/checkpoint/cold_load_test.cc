// Loads of a shard that is not in the page cache (after a restart): they
// read with pread ahead of the decoding tasks, give the exact values, and
// refuse damage as the mapped path does. The setting that forces one path
// is checked where a Checkpointer is created. (The whole checkpoint suite
// runs once more with the pread path forced: ctest checkpoint_reads_pread.)
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/scratch_dir.h"
#include "sdk/checkpoint/shard_check.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.empty()) {
      ::unsetenv(name_);
    } else {
      ::setenv(name_, old_.c_str(), 1);
    }
  }

 private:
  const char* name_;
  std::string old_;
};

// Drops a file's clean pages from the page cache; returns the fraction of
// its pages still cached afterwards (1 where the filesystem keeps them).
double Evict(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 1;
  ::fdatasync(fd);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  struct stat st {};
  ::fstat(fd, &st);
  double cached = 1;
  void* map = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  if (map != MAP_FAILED) {
    const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> v((static_cast<size_t>(st.st_size) + page - 1) / page);
    if (::mincore(map, static_cast<size_t>(st.st_size), v.data()) == 0) {
      size_t n = 0;
      for (unsigned char c : v) n += c & 1;
      cached = static_cast<double>(n) / static_cast<double>(v.size());
    }
    ::munmap(map, static_cast<size_t>(st.st_size));
  }
  ::close(fd);
  return cached;
}

class ColdLoadTest : public ::testing::TestWithParam<CheckpointCompression> {
 protected:
  ckpt::ScratchDir scratch_{"oomguard-coldload"};

  // A model whose tensors end in partial chunks, saved at step 1.
  void SaveOne() {
    CheckpointOptions o;
    o.dir = dir_;
    o.fsync = true;  // the eviction drops clean pages only
    o.chunk_bytes = 64 << 10;
    o.threads = 2;
    o.compression = GetParam();
    auto c = Checkpointer::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    c_ = std::move(*c);
    for (size_t i = 0; i < w_.size(); ++i) w_[i] = static_cast<float>(std::sin(0.001 * static_cast<double>(i)) * 0.02);
    for (size_t i = 0; i < b_.size(); ++i) b_[i] = static_cast<double>(i) * 0.5;
    ASSERT_TRUE(c_->AddTensor("model/w", DType::kFloat32, {1000, 333}, w_.data()).ok());
    ASSERT_TRUE(c_->AddTensor("model/b", DType::kFloat64, {12345}, b_.data()).ok());
    ASSERT_TRUE(c_->SaveAsync(1).ok());
    ASSERT_TRUE(c_->Wait().ok());
    expect_w_ = w_;
    expect_b_ = b_;
    std::fill(w_.begin(), w_.end(), -1.f);
    std::fill(b_.begin(), b_.end(), -1.0);
  }
  std::string Shard() const { return dir_ + "/" + ckpt::StepDirName(1) + "/rank-00000.h5"; }

  const std::string dir_ = scratch_.path();
  std::vector<float> w_ = std::vector<float>(1000 * 333);
  std::vector<double> b_ = std::vector<double>(12345);
  std::vector<float> expect_w_;
  std::vector<double> expect_b_;
  std::unique_ptr<Checkpointer> c_;
};

TEST_P(ColdLoadTest, AnEvictedShardIsReadWithPreadAndLoadsExactly) {
  SaveOne();
  if (Evict(Shard()) > 0.25) GTEST_SKIP() << "this filesystem keeps the shard cached: no cold load to test";
  const uint64_t before = ckpt::ChunksReadWithPread();
  auto step = c_->LoadLatest();
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(*step, 1);
  EXPECT_GT(ckpt::ChunksReadWithPread(), before) << "a cold shard was not read with pread";
  EXPECT_EQ(w_, expect_w_);
  EXPECT_EQ(b_, expect_b_);
  // Now cached: read through the mapping.
  const uint64_t warm_before = ckpt::ChunksReadWithPread();
  std::fill(w_.begin(), w_.end(), 0.f);
  ASSERT_TRUE(c_->Load(1).ok());
  EXPECT_EQ(ckpt::ChunksReadWithPread(), warm_before) << "a cached shard was read with pread";
  EXPECT_EQ(w_, expect_w_);
}

TEST_P(ColdLoadTest, ADamagedChunkOfAnEvictedShardIsRefused) {
  SaveOne();
  // Flip a byte in the middle of the file: chunk data (the tensors are
  // nearly all of it).
  {
    const auto size = fs::file_size(Shard());
    const int fd = ::open(Shard().c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    uint8_t byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(size / 2)), 1);
    byte ^= 0x5a;
    ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(size / 2)), 1);
    ::close(fd);
  }
  if (Evict(Shard()) > 0.25) GTEST_SKIP() << "this filesystem keeps the shard cached: no cold load to test";
  const Status s = c_->Load(1).status();
  ASSERT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("rank-00000.h5"), std::string::npos) << s;
  EXPECT_EQ(VerifyCheckpoint(dir_, 1).code(), StatusCode::kDataLoss);
}

TEST_P(ColdLoadTest, AShardTruncatedUnderTheLoadIsRefused) {
  SaveOne();
  ScopedEnv pread("OOMGUARD_CKPT_READS", "pread");
  ASSERT_EQ(::truncate(Shard().c_str(), static_cast<off_t>(fs::file_size(Shard()) * 3 / 4)), 0);
  const Status s = c_->Load(1).status();
  ASSERT_EQ(s.code(), StatusCode::kDataLoss) << s;
}

INSTANTIATE_TEST_SUITE_P(Compression, ColdLoadTest,
                         ::testing::Values(CheckpointCompression::kZstd, CheckpointCompression::kNone),
                         [](const auto& info) {
                           return std::string(info.param == CheckpointCompression::kZstd ? "Zstd" : "None");
                         });

TEST(ReadsSettingTest, AnUnknownValueIsRefusedWhereACheckpointerIsCreated) {
  ScopedEnv bogus("OOMGUARD_CKPT_READS", "mmap");
  CheckpointOptions o;
  o.dir = (fs::temp_directory_path() / ("oomguard-coldload-setting-" + std::to_string(::getpid()))).string();
  auto c = Checkpointer::Create(o);
  ASSERT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("OOMGUARD_CKPT_READS='mmap'"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("auto, mapping or pread"), std::string::npos) << c.status();
  EXPECT_EQ(VerifyCheckpoint(o.dir, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(o.dir)) << "refused, yet the directory was made";
  for (const char* good : {"auto", "mapping", "pread", ""}) {
    ScopedEnv ok("OOMGUARD_CKPT_READS", good);
    EXPECT_TRUE(ckpt::CheckReadsSetting().ok()) << good;
  }
}

}  // namespace
}  // namespace oomguard
