// Checkpoints that come from elsewhere (issue 15): MANIFEST.json that is not
// a regular file or is far too large, manifests with hostile fields, a shard
// with a tensor deleted, and the inventory that lets verify see it. Verify
// and load share one checker (shard_check.h), so each case asserts that both
// refuse. Also compiled under ThreadSanitizer: sizes stay small.
#include "sdk/checkpoint/shard_check.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/checkpoint_testing.h"
#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/hostile_shard_testutil.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/scratch_dir.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/shard_digest.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

// How much the peak resident memory grew while `fn` ran (the peak is reset
// first through /proc/self/clear_refs).
template <typename F>
int64_t PeakGrowth(F fn) {
  auto kib = [](const char* key) {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind(key, 0) == 0) return static_cast<int64_t>(std::stoll(line.substr(std::strlen(key))));
    return int64_t{-1};
  };
  std::ofstream("/proc/self/clear_refs") << "5";
  const int64_t before = kib("VmRSS:");
  fn();
  return (kib("VmHWM:") - before) * 1024;
}

class ShardCheckTest : public ::testing::Test {
 protected:
  ckpt::ScratchDir scratch_{"oomguard-shardcheck"};

  // Scratch checkpoints in `dir`: small chunks, no fsync (checkpoint_testing.h).
  static CheckpointOptions Options(const std::string& dir) { return ckpt_testing::ScratchOptions(dir); }
  // A checkpointer with `tensors` float32 tensors of 300 elements, named
  // <prefix>0, <prefix>1, ..., and one object.
  std::unique_ptr<Checkpointer> Make(int tensors = 2, const std::string& prefix = "model/t") {
    auto c = Checkpointer::Create(Options(dir_)).value();
    values_.assign(static_cast<size_t>(tensors), std::vector<float>(300));
    for (int t = 0; t < tensors; ++t)
      EXPECT_TRUE(c->AddTensor(prefix + std::to_string(t), DType::kFloat32, {300},
                               values_[static_cast<size_t>(t)].data())
                      .ok());
    EXPECT_TRUE(c->AddObject(
                     "train/counter",
                     [this] { return std::vector<uint8_t>(8, static_cast<uint8_t>(counter_)); },
                     [this](std::span<const uint8_t> b) {
                       counter_ = b.empty() ? -1 : b[0];
                       return Status::Ok();
                     })
                    .ok());
    return c;
  }
  void Fill(int64_t step) {
    for (auto& v : values_)
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(step * 1000 + static_cast<int64_t>(i));
    counter_ = step;
  }
  void Save(Checkpointer* c, int64_t step) {
    Fill(step);
    ASSERT_TRUE(c->SaveAsync(step).ok());
    ASSERT_TRUE(c->Wait().ok());
  }
  std::string StepDir(int64_t step) const { return dir_ + "/" + ckpt::StepDirName(step); }
  std::string Shard(int64_t step) const { return StepDir(step) + "/rank-00000.h5"; }
  // Rewrites the manifest's size and hash to match the shard as it is now,
  // as someone who edited the shard by hand would.
  void FixManifest(int64_t step) {
    auto m = ckpt::ReadManifest(StepDir(step)).value();
    auto d = ckpt::DigestShardFile(Shard(step));
    ASSERT_TRUE(d.ok()) << d.status();
    m.shards[0].bytes = d->bytes;
    m.shards[0].digest = d->digest;
    ASSERT_TRUE(
        ckpt::WriteFileDurably(StepDir(step) + "/MANIFEST.json", ckpt::ManifestToJson(m), false).ok());
  }
  // Rewrites the manifest's size (not its digest) to match the shard: the
  // size check passes and only the deeper checks stand in the way.
  void FixSize(int64_t step) {
    auto m = ckpt::ReadManifest(StepDir(step)).value();
    m.shards[0].bytes = static_cast<int64_t>(fs::file_size(Shard(step)));
    ASSERT_TRUE(
        ckpt::WriteFileDurably(StepDir(step) + "/MANIFEST.json", ckpt::ManifestToJson(m), false).ok());
  }
  // Runs `fn` on a thread and fails the test (instead of hanging it) when it
  // does not return within 10 s; `unblock` then frees it.
  template <typename F>
  auto WithinSeconds(F fn, const std::function<void()>& unblock) {
    auto fut = std::async(std::launch::async, fn);
    if (fut.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << "blocked for 10 s";
      unblock();
    }
    return fut.get();
  }

  const std::string dir_ = scratch_.path();
  std::vector<std::vector<float>> values_;
  int64_t counter_ = 0;
};

// Item 3: a FIFO as MANIFEST.json must neither hang a load nor a verify.
TEST_F(ShardCheckTest, FifoManifestIsRefusedWithoutBlocking) {
  auto c = Make();
  Save(c.get(), 1);
  Save(c.get(), 2);
  const std::string manifest = StepDir(2) + "/MANIFEST.json";
  fs::remove(manifest);
  ASSERT_EQ(::mkfifo(manifest.c_str(), 0644), 0);
  auto unblock = [&] {
    int fd = ::open(manifest.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
  };
  auto m = WithinSeconds([&] { return ckpt::ReadManifest(StepDir(2)); }, unblock);
  ASSERT_EQ(m.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(m.status().message().find("not a regular file"), std::string::npos) << m.status();
  auto loaded = WithinSeconds([&] { return c->LoadLatest(); }, unblock);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 1);
  Status v = WithinSeconds([&] { return VerifyCheckpoint(dir_, 2); }, unblock);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss) << v;
  auto list = WithinSeconds([&] { return ListCheckpoints(dir_); }, unblock);
  ASSERT_TRUE(list.ok());
  EXPECT_NE(list->back().problem.find("not a regular file"), std::string::npos);
}

// Item 3: a link to /dev/zero (endless) and a 3 GB sparse file are refused
// by their size or kind, without reading them.
TEST_F(ShardCheckTest, EndlessOrHugeManifestIsRefusedUnread) {
  auto c = Make();
  Save(c.get(), 1);
  Save(c.get(), 2);
  Save(c.get(), 3);
  const std::string m2 = StepDir(2) + "/MANIFEST.json", m3 = StepDir(3) + "/MANIFEST.json";
  fs::remove(m2);
  fs::create_symlink("/dev/zero", m2);
  fs::remove(m3);
  {
    int fd = ::open(m3.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, int64_t{3} << 30), 0);  // sparse: no disk space
    ::close(fd);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto r2 = ckpt::ReadManifest(StepDir(2));
  EXPECT_EQ(r2.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r2.status().message().find("symbolic link"), std::string::npos) << r2.status();
  auto r3 = ckpt::ReadManifest(StepDir(3));
  EXPECT_EQ(r3.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r3.status().message().find("3221225472 bytes"), std::string::npos) << r3.status();
  auto loaded = c->LoadLatest();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 1);
  EXPECT_EQ(VerifyCheckpoint(dir_, 2).code(), StatusCode::kDataLoss);
  EXPECT_EQ(VerifyCheckpoint(dir_, 3).code(), StatusCode::kDataLoss);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "the files were read";
}

// A shard that is a FIFO (with a manifest that says 0 bytes) or a symlink to
// a shard elsewhere is refused before anything opens it.
TEST_F(ShardCheckTest, ShardThatIsNotARegularFileIsRefused) {
  auto c = Make();
  Save(c.get(), 1);
  Save(c.get(), 2);
  Save(c.get(), 3);
  fs::rename(Shard(2), dir_ + "/elsewhere.h5");
  fs::create_symlink(dir_ + "/elsewhere.h5", Shard(2));  // same bytes, hash still matches
  fs::remove(Shard(3));
  ASSERT_EQ(::mkfifo(Shard(3).c_str(), 0644), 0);
  auto m = ckpt::ReadManifest(StepDir(3)).value();
  m.shards[0].bytes = 0;
  ASSERT_TRUE(ckpt::WriteFileDurably(StepDir(3) + "/MANIFEST.json", ckpt::ManifestToJson(m), false).ok());
  auto unblock = [&] {
    int fd = ::open(Shard(3).c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
  };
  Status v3 = WithinSeconds([&] { return VerifyCheckpoint(dir_, 3); }, unblock);
  EXPECT_NE(v3.message().find("not a regular file"), std::string::npos) << v3;
  Status v2 = VerifyCheckpoint(dir_, 2);
  EXPECT_NE(v2.message().find("symbolic link"), std::string::npos) << v2;
  auto loaded = WithinSeconds([&] { return c->LoadLatest(); }, unblock);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 1);
}

// Issue 28, row 1: a step directory that is a symbolic link to another
// run's step is refused as a linked shard is: resume skips it with a
// warning, verify and list name it, a save of that step fails instead of
// writing through it, and retention never deletes through it. The other
// run's checkpoints stay exactly as they were.
TEST_F(ShardCheckTest, SymlinkedStepDirectoryIsNeverReadWrittenOrDeletedThrough) {
  const std::string other = scratch_.path() + "-other";
  fs::create_directories(other);
  struct RemoveOther {
    std::string path;
    ~RemoveOther() { fs::remove_all(path); }
  } remove_other{other};
  {
    auto theirs = Checkpointer::Create(Options(other)).value();
    std::vector<float> v(300);
    ASSERT_TRUE(theirs->AddTensor("model/t0", DType::kFloat32, {300}, v.data()).ok());
    for (int64_t step : {0, 3}) {
      std::fill(v.begin(), v.end(), static_cast<float>(step + 500));
      ASSERT_TRUE(theirs->SaveAsync(step).ok());
      ASSERT_TRUE(theirs->Wait().ok());
    }
  }
  auto bytes_of = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const std::string theirs0 = other + "/" + ckpt::StepDirName(0), theirs3 = other + "/" + ckpt::StepDirName(3);
  const std::string shard0 = bytes_of(theirs0 + "/rank-00000.h5"), shard3 = bytes_of(theirs3 + "/rank-00000.h5");
  const std::string manifest0 = bytes_of(theirs0 + "/MANIFEST.json");

  CheckpointOptions o = Options(dir_);
  o.keep = 2;
  auto c = Checkpointer::Create(o).value();
  values_.assign(1, std::vector<float>(300));
  ASSERT_TRUE(c->AddTensor("model/t0", DType::kFloat32, {300}, values_[0].data()).ok());
  Save(c.get(), 1);
  Save(c.get(), 2);
  fs::create_directory_symlink(theirs0, StepDir(0));
  fs::create_directory_symlink(theirs3, StepDir(3));

  // Resume: the newest is the link; it is refused and step 2 loads.
  Fill(99);
  auto loaded = c->LoadLatest();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 2);
  EXPECT_EQ(values_[0][5], 2005.f);
  EXPECT_GE(c->Stats().corrupt_skipped, 1);
  Status v = VerifyCheckpoint(dir_, 3);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss);
  EXPECT_NE(v.message().find("symbolic link"), std::string::npos) << v;
  auto list = ListCheckpoints(dir_).value();
  ASSERT_EQ(list.size(), 4u);
  EXPECT_FALSE(list[3].committed);
  EXPECT_NE(list[3].problem.find("symbolic link"), std::string::npos) << list[3].problem;
  EXPECT_TRUE(list[3].shards.empty()) << "listed through the link";

  // A save of the linked step fails instead of writing through it.
  Fill(3);
  ASSERT_TRUE(c->SaveAsync(3).ok());
  Status saved = c->Wait();
  EXPECT_EQ(saved.code(), StatusCode::kFailedPrecondition) << saved;
  EXPECT_NE(saved.message().find("symbolic link"), std::string::npos) << saved;
  // Retention (keep 2) after steps 4 and 5 removes step 1 and 2, and leaves
  // the linked step 0 alone.
  Save(c.get(), 4);
  Save(c.get(), 5);
  EXPECT_FALSE(fs::exists(StepDir(1)));
  EXPECT_TRUE(fs::is_symlink(StepDir(0)));
  EXPECT_EQ(bytes_of(theirs0 + "/MANIFEST.json"), manifest0) << "retention deleted through the link";
  EXPECT_EQ(bytes_of(theirs0 + "/rank-00000.h5"), shard0);
  EXPECT_EQ(bytes_of(theirs3 + "/rank-00000.h5"), shard3) << "the save wrote through the link";
  EXPECT_TRUE(VerifyCheckpoint(other, 0).ok());
  EXPECT_TRUE(VerifyCheckpoint(other, 3).ok());
  EXPECT_EQ(c->DurableSteps(), (std::vector<int64_t>{4, 5}));
}

// Issue 28, row 2: groups nested 20,000 deep (3 MB; HDF5's own visitors
// took 53 s at 2,000 levels and overflowed the stack at 20,000) and a group
// linked into itself are refused in milliseconds by verify, load, resume and
// inspect, before anything deeper is opened.
TEST_F(ShardCheckTest, DeeplyNestedOrCyclicGroupsAreRefusedAtOnce) {
  auto c = Make();
  Save(c.get(), 1);
  Save(c.get(), 2);
  Save(c.get(), 3);
  {
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(2).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_TRUE(f.valid());
    ckpt::H5Handle g(H5Gcreate2(f.get(), "deep", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    for (int i = 0; i < 20000 && g.valid(); ++i)
      g = ckpt::H5Handle(H5Gcreate2(g.get(), "g", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    ASSERT_TRUE(g.valid());
    ckpt::H5Handle f3(H5Fopen(Shard(3).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_GE(H5Lcreate_hard(f3.get(), "/model", f3.get(), "/model/again", H5P_DEFAULT, H5P_DEFAULT), 0);
  }
  FixSize(2);
  FixSize(3);
  const auto t0 = std::chrono::steady_clock::now();
  Status v2 = VerifyCheckpoint(dir_, 2);
  EXPECT_EQ(v2.code(), StatusCode::kDataLoss);
  EXPECT_NE(v2.message().find("nests groups deeper than 64 levels"), std::string::npos) << v2;
  Status v3 = VerifyCheckpoint(dir_, 3);
  EXPECT_EQ(v3.code(), StatusCode::kDataLoss);
  EXPECT_NE(v3.message().find("/model/again is a second link"), std::string::npos) << v3;
  EXPECT_EQ(c->Load(2).status().code(), StatusCode::kDataLoss);
  auto inspected = InspectShard(Shard(2));
  EXPECT_EQ(inspected.status().code(), StatusCode::kDataLoss);
  Fill(99);
  auto loaded = c->LoadLatest();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 1);
  EXPECT_EQ(values_[0][5], 1005.f);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(ms, 2000) << "refusing the nested shards took " << ms << " ms";
}

// Issue 28, row 11: root attributes that do not fit the reader's integers
// (rank 2^32, world_size 2^32 + 1, with the digest recomputed) are refused,
// never narrowed into rank 0 of 1.
TEST_F(ShardCheckTest, RootAttributesOutOfRangeAreRefused) {
  auto c = Make();
  Save(c.get(), 1);
  Save(c.get(), 2);
  Save(c.get(), 3);
  auto set_root = [&](int64_t step, const char* name, int64_t value) {
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(step).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_TRUE(f.valid());
    ASSERT_GE(H5Adelete(f.get(), name), 0);
    ASSERT_TRUE(ckpt::WriteInt64Attr(f.get(), name, value).ok());
  };
  set_root(2, "rank", int64_t{1} << 32);
  set_root(3, "world_size", (int64_t{1} << 32) + 1);
  FixManifest(2);
  FixManifest(3);
  for (int64_t step : {2, 3}) {
    Status v = VerifyCheckpoint(dir_, step);
    EXPECT_EQ(v.code(), StatusCode::kDataLoss);
    EXPECT_NE(v.message().find("out of range"), std::string::npos) << v;
    EXPECT_EQ(c->Load(step).status().code(), StatusCode::kDataLoss);
    auto inspected = InspectShard(Shard(step));
    EXPECT_EQ(inspected.status().code(), StatusCode::kDataLoss) << "inspect: rank " << inspected->rank;
  }
  EXPECT_NE(VerifyCheckpoint(dir_, 2).message().find("rank 4294967296"), std::string::npos);
  Fill(99);
  auto loaded = c->LoadLatest();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, 1);
}

// Issue 28, row 8: an object that declares 1 GiB, stored as 32 KiB of zstd
// RLE frames in a shard with a wrong digest (within the 65536x a filter can
// expand) is refused before a buffer of its size is allocated or a byte
// decoded: memory stays bounded by what the file backs. A shard of zeros
// whose digest is right still loads.
TEST_F(ShardCheckTest, DeclaredSizeAmplificationIsRefusedBeforeAllocating) {
  auto c = Make();
  Save(c.get(), 1);
  Save(c.get(), 2);
  constexpr uint64_t kChunk = uint64_t{256} << 20, kChunks = 4;
  {
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(2).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_TRUE(f.valid());
    ASSERT_TRUE(ckpt::testutil::ReplaceWithZeroFrames(f.get(), "/train/counter", kChunk, kChunks));
  }
  FixSize(2);  // the digest stays wrong
  ASSERT_LT(fs::file_size(Shard(2)), uint64_t{1} << 20);
  Status verified, loaded;
  StatusOr<int64_t> latest = int64_t{-1};
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t growth = PeakGrowth([&] {
    verified = VerifyCheckpoint(dir_, 2);
    loaded = c->Load(2).status();
    Fill(99);
    latest = c->LoadLatest();
  });
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(verified.code(), StatusCode::kDataLoss);
  EXPECT_NE(verified.message().find("digest"), std::string::npos) << verified;
  EXPECT_EQ(loaded.code(), StatusCode::kDataLoss) << loaded;
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 1);
  EXPECT_LT(growth, int64_t{64} << 20) << "the peak resident memory grew by " << (growth >> 20) << " MiB";
  EXPECT_LT(ms, 1000) << "refusing took " << ms << " ms";
  std::printf("1 GiB declared in %ju bytes: refused in %.1f ms, peak memory +%lld KiB\n",
              static_cast<uintmax_t>(fs::file_size(Shard(2))), ms, static_cast<long long>(growth >> 10));

  // Zeros compress far beyond the ratio too: with the right digest they load.
  ckpt::ScratchDir zeros_dir("oomguard-zeros");
  CheckpointOptions o = Options(zeros_dir.path());
  o.compression = CheckpointCompression::kZstd;
  std::vector<float> z(size_t{4} << 20, 0.f);
  auto zc = Checkpointer::Create(o).value();
  ASSERT_TRUE(zc->AddTensor("model/zeros", DType::kFloat32, {static_cast<int64_t>(z.size())}, z.data()).ok());
  ASSERT_TRUE(zc->SaveAsync(0).ok());
  ASSERT_TRUE(zc->Wait().ok());
  ASSERT_LT(fs::file_size(zeros_dir.path() + "/" + ckpt::StepDirName(0) + "/rank-00000.h5") * ckpt::kDigestFirstRatio,
            z.size() * sizeof(float));
  z[7] = 1.f;
  EXPECT_TRUE(VerifyCheckpoint(zeros_dir.path(), 0).ok());
  ASSERT_TRUE(zc->Load(0).ok());
  EXPECT_EQ(z[7], 0.f);
}

TEST(ManifestParseTest, RefusesHostileFields) {
  ckpt::Manifest m;
  m.format = std::string(kCheckpointFormat);
  m.step = 7;
  m.world_size = 2;
  for (int r = 0; r < 2; ++r) {
    ckpt::ManifestShard sh;
    sh.rank = r;
    sh.file = ckpt::ShardFileName(r);
    sh.bytes = 10;
    sh.digest = "00000000000000ff";
    sh.compression = "none";
    m.shards.push_back(sh);
  }
  ASSERT_TRUE(ckpt::ParseManifest(ckpt::ManifestToJson(m)).ok());
  auto refused = [&](ckpt::Manifest bad, const char* needle) {
    auto r = ckpt::ParseManifest(ckpt::ManifestToJson(bad));
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  };
  for (const char* name : {"", ".", "..", "a/b.h5", "/etc/passwd"}) {
    auto bad = m;
    bad.shards[1].file = name;
    refused(bad, "outside its directory");
  }
  auto bad = m;
  bad.shards[1].rank = 0;
  refused(bad, "rank 0 twice");
  bad = m;
  bad.shards[1].rank = 5;
  refused(bad, "rank");
  bad = m;
  bad.shards[0].digest = "xyz";
  refused(bad, "16 lowercase hex");
  bad = m;
  bad.shards[0].compression = "zstd-99";
  refused(bad, "compression");
  bad = m;
  bad.shards[0].bytes = -1;
  refused(bad, "bytes");
  bad = m;
  bad.step = -3;
  refused(bad, "step");
  auto text = [&](const std::string& s) { return ckpt::ParseManifest(s).status(); };
  const std::string ok = ckpt::ManifestToJson(m);
  EXPECT_NE(text(std::string(ok).replace(ok.find("\"step\": 7"), 9, "\"step\": 7.5"))
                .message()
                .find("not an integer"),
            std::string::npos);
  EXPECT_NE(
      text(std::string(ok).replace(ok.find("\"step\": 7"), 9, "\"step\": 1e300")).message().find("integer"),
      std::string::npos);
  EXPECT_NE(text(std::string(ok).replace(ok.find("\"world_size\": 2"), 15, "\"world_size\": 99999999"))
                .message()
                .find("larger"),
            std::string::npos);
  EXPECT_NE(text(std::string(100000, '[')).message().find("nests deeper"), std::string::npos);
  EXPECT_EQ(text("[]").code(), StatusCode::kDataLoss);
  EXPECT_EQ(text("").code(), StatusCode::kDataLoss);
}

// Item 5: a tensor deleted from a shard (and the manifest fixed up) is
// refused by verify as it is by a load, naming the tensor.
TEST_F(ShardCheckTest, DeletedTensorIsRefusedByVerifyAndLoad) {
  auto c = Make();
  Save(c.get(), 1);
  Save(c.get(), 2);
  {
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(2).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_TRUE(f.valid());
    ASSERT_GE(H5Ldelete(f.get(), "/model/t1", H5P_DEFAULT), 0);
  }
  FixManifest(2);
  Status v = VerifyCheckpoint(dir_, 2);
  EXPECT_EQ(v.code(), StatusCode::kDataLoss);
  EXPECT_NE(v.message().find("/model/t1 is missing"), std::string::npos) << v;
  Fill(99);
  EXPECT_EQ(c->Load(2).status().code(), StatusCode::kDataLoss);
  auto loaded = c->LoadLatest();
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(*loaded, 1);
  EXPECT_EQ(values_[1][5], 1005.f);
  EXPECT_EQ(counter_, 1);
}

// A dataset added beside the inventory is refused too: the shard is not the
// one that was written.
TEST_F(ShardCheckTest, DatasetTheInventoryDoesNotListIsRefused) {
  auto c = Make();
  Save(c.get(), 1);
  {
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(1).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ckpt::H5Handle space(H5Screate(H5S_SCALAR));
    ckpt::H5Handle d(
        H5Dcreate2(f.get(), "/extra", H5T_STD_U8LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    ASSERT_TRUE(d.valid());
  }
  FixManifest(1);
  Status v = VerifyCheckpoint(dir_, 1);
  EXPECT_NE(v.message().find("/extra, which its tensor inventory does not list"), std::string::npos) << v;
  EXPECT_EQ(c->Load(1).status().code(), StatusCode::kDataLoss);
}

// Shards written before the inventory existed still load and verify: the
// datasets present are their inventory.
TEST_F(ShardCheckTest, ShardWithoutInventoryStillLoads) {
  auto c = Make();
  Save(c.get(), 1);
  {
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(1).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_GE(H5Adelete(f.get(), ckpt::kInventoryAttr), 0);
  }
  FixManifest(1);
  EXPECT_TRUE(VerifyCheckpoint(dir_, 1).ok());
  Fill(99);
  ASSERT_TRUE(c->Load(1).ok());
  EXPECT_EQ(values_[0][7], 1007.f);
}

// Many tensors with long names: the inventory (about 90 KB) outgrows HDF5's
// 64 KiB compact attributes and must still be written and read back.
TEST_F(ShardCheckTest, LargeInventoryRoundTrips) {
  auto c = Make(1500, "model/a_rather_long_module_name_for_the_inventory/weight_");
  Save(c.get(), 4);
  Status v = VerifyCheckpoint(dir_, 4);
  EXPECT_TRUE(v.ok()) << v;
  Fill(99);
  Status s = c->Load(4).status();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(values_[1499][3], 4003.f);
}

}  // namespace
}  // namespace oomguard
