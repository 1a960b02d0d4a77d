// A shard truncated in place while it is read (issue 28, row 3): reads
// through the mapping must end in a refusal, never in SIGBUS.
#include "sdk/checkpoint/mapped_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/scratch_dir.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

void WriteFile(const std::string& path, size_t bytes, char fill) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const std::string block(1 << 16, fill);
  for (size_t done = 0; done < bytes; done += block.size())
    out.write(block.data(), static_cast<std::streamsize>(std::min(block.size(), bytes - done)));
}

TEST(MappedFileTest, ReadsPastATruncationSeeZerosAndAreReported) {
  ckpt::ScratchDir d("oomguard-mapped");
  const std::string path = d.path() + "/f";
  WriteFile(path, size_t{1} << 20, 'x');
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  auto map = ckpt::MappedFile::Map(fd, path);
  ::close(fd);
  ASSERT_TRUE(map.ok()) << map.status();
  const auto bytes = (*map)->bytes();
  ASSERT_EQ(bytes.size(), size_t{1} << 20);
  EXPECT_EQ(bytes[1000], 'x');
  EXPECT_FALSE((*map)->truncated());
  ASSERT_EQ(::truncate(path.c_str(), 100000), 0);
  size_t xs = 0, zeros = 0;
  for (uint8_t b : bytes) (b == 'x' ? xs : zeros) += 1;  // SIGBUS here without the handler
  EXPECT_TRUE((*map)->truncated());
  EXPECT_EQ(xs, 100000u);
  EXPECT_EQ(zeros, bytes.size() - 100000u);
}

#ifndef OOMGUARD_TSAN_BUILD
// A SIGBUS from a mapping the handler does not own still kills the process,
// as it would without the handler.
TEST(MappedFileDeathTest, ForeignSigbusStillTakesTheDefaultAction) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ckpt::ScratchDir d("oomguard-mapped");
  const std::string path = d.path() + "/f";
  WriteFile(path, size_t{1} << 20, 'y');
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  {
    auto ours = ckpt::MappedFile::Map(fd, path);  // installs the handler
    ASSERT_TRUE(ours.ok());
  }
  EXPECT_EXIT(
      {
        void* p = ::mmap(nullptr, size_t{1} << 20, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) std::_Exit(3);
        if (::truncate(path.c_str(), 4096) != 0) std::_Exit(4);
        volatile const char* c = static_cast<const char*>(p);
        std::_Exit(c[size_t{1} << 19] == 'y' ? 0 : 5);
      },
      ::testing::KilledBySignal(SIGBUS), "");
  ::close(fd);
}
#endif

// The whole load and verify paths: a 32 MiB shard truncated at a random
// moment while it is verified or loaded. Every outcome is a status: OK when
// the truncation came after the read, kDataLoss otherwise, never a signal.
TEST(MappedFileTest, ShardTruncatedWhileReadIsRefusedNotFatal) {
  ckpt::ScratchDir d("oomguard-mapped");
  CheckpointOptions o;
  o.dir = d.path();
  o.fsync = false;
  o.compression = CheckpointCompression::kNone;
  o.threads = 2;
  std::vector<float> w(size_t{8} << 20);  // 32 MiB
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 1000);
  auto c = Checkpointer::Create(o).value();
  ASSERT_TRUE(c->AddTensor("model/w", DType::kFloat32, {static_cast<int64_t>(w.size())}, w.data()).ok());
  ASSERT_TRUE(c->SaveAsync(0).ok());
  ASSERT_TRUE(c->Wait().ok());
  const std::string shard = d.path() + "/" + ckpt::StepDirName(0) + "/rank-00000.h5";
  const std::string pristine = d.path() + "/pristine.h5";
  fs::copy_file(shard, pristine);
  // How long a read takes here, so that the cuts land inside one.
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(VerifyCheckpoint(d.path(), 0).ok());
  const auto read_us = std::max<int64_t>(
      1,
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  std::mt19937 rng(28);
  int refused = 0, read_whole = 0;
  for (int i = 0; i < 16; ++i) {
    fs::copy_file(pristine, shard, fs::copy_options::overwrite_existing);
    std::atomic<bool> started{false};
    std::thread cut([&] {
      while (!started.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % read_us));
      ASSERT_EQ(::truncate(shard.c_str(), static_cast<off_t>(fs::file_size(pristine) / (2 + i % 3))), 0);
    });
    started = true;
    Status s = i % 2 == 0 ? VerifyCheckpoint(d.path(), 0) : c->Load(0).status();
    cut.join();
    if (s.ok()) {
      ++read_whole;
    } else {
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
      if (refused == 0) std::printf("first refusal: %s\n", s.ToString().c_str());
      ++refused;
    }
  }
  std::printf("truncated while read (%lld us): %d refused, %d read before the cut\n",
              static_cast<long long>(read_us), refused, read_whole);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace oomguard
