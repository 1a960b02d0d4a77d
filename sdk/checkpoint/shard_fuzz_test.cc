// Fuzz tests of the checkpoint reader and the manifest parser (issue 15).
//
// Real shards written by the Checkpointer are damaged at random: byte flips,
// truncations, appended bytes, and HDF5 object edits made through the C API
// (datasets deleted, renamed, replaced by links, by external storage or by
// fill-value datasets of huge extent, attributes removed or changed, objects
// added; issue 28: groups nested past any state path, datasets declaring far
// more than they store, root attributes past the reader's integers). A
// second case truncates a shard while it is verified, loaded or resumed. Most cases then fix the manifest's size and hash, so that only the
// loader's own checks stand in the way. Every case asserts:
//   * no crash and no hang (every call runs under a watchdog; the external
//     files the edits point at are FIFOs, so a read outside the checkpoint
//     directory would block and fail the case);
//   * verify and load agree (one checker), and a load that succeeds loaded
//     exactly the values that were saved;
//   * LoadLatest picks the newest checkpoint that verifies, with its values;
//   * no file descriptor is leaked.
// The manifest parser gets thousands of mutated manifests: never a crash, and
// whatever it accepts is consistent.
// Also compiled under ThreadSanitizer, with fewer cases.
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
#include <limits>
#include <map>
#include <random>
#include <set>
#include <thread>

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

#ifdef OOMGUARD_TSAN_BUILD
constexpr int kShardCases = 40;
constexpr int kManifestCases = 500;
#else
constexpr int kShardCases = 400;
constexpr int kManifestCases = 5000;
#endif

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

int OpenFds() {
  int n = 0;
  for ([[maybe_unused]] auto& e : fs::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

class ShardFuzzTest : public ::testing::Test {
 protected:
  static constexpr int kSteps = 3;

  ShardFuzzTest() {
    dir_ = root_ + "/ckpt";
    outside_ = root_ + "/outside";
    fs::create_directories(dir_);
    fs::create_directories(outside_);
    // Targets of external links and external storage. FIFOs: opening one
    // for reading blocks, so a loader that reads outside its directory hangs
    // the case and the watchdog fails it.
    EXPECT_EQ(::mkfifo((outside_ + "/data.bin").c_str(), 0644), 0);
    EXPECT_EQ(::mkfifo((outside_ + "/other.h5").c_str(), 0644), 0);
  }

  // Every kind of entry (checkpoint_testing.h: MixedState).
  void Make() {
    CheckpointOptions o = ckpt_testing::ScratchOptions(dir_);
    o.keep = 0;
    c_ = Checkpointer::Create(o).value();
    state_.Register(c_.get());
  }
  void Fill(int64_t step) { state_.Fill(step); }
  void Scribble() { state_.Scribble(); }
  // Whether the registered state holds exactly what step `step` saved.
  ::testing::AssertionResult Holds(int64_t step) { return state_.Holds(step); }

  std::string StepDir(int64_t s) const { return dir_ + "/" + ckpt::StepDirName(s); }
  std::string Shard(int64_t s) const { return StepDir(s) + "/rank-00000.h5"; }
  std::string Manifest(int64_t s) const { return StepDir(s) + "/MANIFEST.json"; }
  void FixManifest(int64_t s) {
    auto m = ckpt::ParseManifest(pristine_manifest_[static_cast<size_t>(s)]).value();
    // The digest as a hostile editor would recompute it; a file whose chunks
    // cannot even be listed keeps the pristine manifest.
    auto d = ckpt::DigestShardFile(Shard(s));
    if (d.ok()) {
      m.shards[0].bytes = d->bytes;
      m.shards[0].digest = d->digest;
    } else {
      // Its size at least, so that the checks past the size check are reached.
      std::error_code ec;
      m.shards[0].bytes = static_cast<int64_t>(fs::file_size(Shard(s), ec));
    }
    WriteAll(Manifest(s), ckpt::ManifestToJson(m));
  }
  void Restore(int64_t s) {
    WriteAll(Shard(s), pristine_shard_[static_cast<size_t>(s)]);
    WriteAll(Manifest(s), pristine_manifest_[static_cast<size_t>(s)]);
  }

  // Runs fn under a watchdog: a call that does not return within 20 s fails
  // the test, and the FIFOs outside are opened for writing to free it.
  template <typename F>
  auto Watched(F fn, const std::string& what) {
    auto fut = std::async(std::launch::async, fn);
    if (fut.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      ADD_FAILURE() << what << " blocked (a read outside the checkpoint directory?)";
      for (const char* f : {"/data.bin", "/other.h5"}) {
        int fd = ::open((outside_ + f).c_str(), O_WRONLY | O_NONBLOCK);
        if (fd >= 0) ::close(fd);
      }
    }
    return fut.get();
  }

  // One HDF5 object edit, chosen by `kind`, of the shard of step `s`.
  // Returns what it did, for failure messages.
  std::string EditObjects(int64_t s, int kind, std::mt19937_64& rng) {
    static const char* kDatasets[] = {"/model/w",      "/model/b",     "/model/h",
                                      "/train/scalar", "/train/empty", "/optimizer/state"};
    const std::string ds = kDatasets[rng() % 6];
    const std::string other = kDatasets[rng() % 6];
    ckpt::Hdf5Lock lock;
    ckpt::H5Handle f(H5Fopen(Shard(s).c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    if (!f.valid()) return "open failed";
    const hid_t fid = f.get();
    auto replace_with = [&](hid_t type, const std::vector<hsize_t>& dims, hid_t dcpl) {
      H5Ldelete(fid, ds.c_str(), H5P_DEFAULT);
      ckpt::H5Handle space(dims.empty()
                               ? H5Screate(H5S_SCALAR)
                               : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
      ckpt::H5Handle d(H5Dcreate2(fid, ds.c_str(), type, space.get(), H5P_DEFAULT, dcpl, H5P_DEFAULT));
      (void)ckpt::WriteStringAttr(d.get(), "dtype", "float32");
      (void)ckpt::WriteStringAttr(d.get(), "xxh3", "0123456789abcdef");
    };
    switch (kind) {
      case 0:
        H5Ldelete(fid, ds.c_str(), H5P_DEFAULT);
        return "deleted " + ds;
      case 1: {
        ckpt::H5Handle d(H5Dopen2(fid, ds.c_str(), H5P_DEFAULT));
        H5Adelete(d.get(), rng() % 2 ? "dtype" : "xxh3");
        return "deleted an attribute of " + ds;
      }
      case 2: {
        ckpt::H5Handle d(H5Dopen2(fid, ds.c_str(), H5P_DEFAULT));
        H5Adelete(d.get(), "dtype");
        static const char* kNames[] = {"int32", "uint16", "float16", "int64", "bool", "no-such-dtype"};
        (void)ckpt::WriteStringAttr(d.get(), "dtype", kNames[rng() % 6]);
        return "changed the dtype of " + ds;
      }
      case 3:
        H5Ldelete(fid, ds.c_str(), H5P_DEFAULT);
        H5Lcreate_soft(other.c_str(), fid, ds.c_str(), H5P_DEFAULT, H5P_DEFAULT);
        return "replaced " + ds + " by a soft link to " + other;
      case 4:
        H5Ldelete(fid, ds.c_str(), H5P_DEFAULT);
        H5Lcreate_external((outside_ + "/other.h5").c_str(), "/data", fid, ds.c_str(), H5P_DEFAULT,
                           H5P_DEFAULT);
        return "replaced " + ds + " by an external link";
      case 5: {
        ckpt::H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE));
        H5Pset_external(dcpl.get(), (outside_ + "/data.bin").c_str(), 0, 1200);
        replace_with(H5T_IEEE_F32LE, {300}, dcpl.get());
        return "replaced " + ds + " by external storage";
      }
      case 6:
        H5Lmove(fid, ds.c_str(), fid, (ds + "_renamed").c_str(), H5P_DEFAULT, H5P_DEFAULT);
        return "renamed " + ds;
      case 7:
        H5Adelete(fid, "step");
        (void)ckpt::WriteInt64Attr(fid, "step", static_cast<int64_t>(rng() % 5));
        return "rewrote the root step attribute";
      case 8: {
        ckpt::H5Handle space(H5Screate(H5S_SCALAR));
        ckpt::H5Handle d(H5Dcreate2(fid, "/model/extra", H5T_STD_U8LE, space.get(), H5P_DEFAULT, H5P_DEFAULT,
                                    H5P_DEFAULT));
        return "added /model/extra";
      }
      case 9:
        replace_with(H5T_IEEE_F32LE, {40, 100}, H5P_DEFAULT);  // contiguous, never written: fill values
        return "replaced " + ds + " by an unwritten dataset";
      case 10: {
        ckpt::H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE));
        const hsize_t chunk[2] = {1, 1 << 20};
        H5Pset_chunk(dcpl.get(), 2, chunk);
        replace_with(H5T_IEEE_F32LE, {hsize_t{1} << 40, hsize_t{1} << 30}, dcpl.get());
        return "replaced " + ds + " by a huge chunked dataset";
      }
      case 11:
        H5Lcreate_hard(fid, ds.c_str(), fid, "/model/alias", H5P_DEFAULT, H5P_DEFAULT);
        return "added a second name for " + ds;
      case 12: {
        ckpt::H5Handle t(H5Tcopy(H5T_NATIVE_INT));
        H5Tcommit2(fid, "/model/type", t.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        return "added a committed datatype";
      }
      case 14: {  // issue 28, row 2: nesting past what any state path has
        const int depth = 65 + static_cast<int>(rng() % 1000);
        ckpt::H5Handle g(H5Gcreate2(fid, "/model/deep", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
        for (int i = 0; i < depth && g.valid(); ++i)
          g = ckpt::H5Handle(H5Gcreate2(g.get(), "g", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
        if (rng() % 2) H5Lcreate_hard(fid, "/model", fid, "/model/deep/g/loop", H5P_DEFAULT, H5P_DEFAULT);
        return "nested groups " + std::to_string(depth) + " deep";
      }
      case 15: {  // issue 28, row 8: sizes declared far beyond the bytes stored
        const uint64_t chunk = uint64_t{1} << (16 + rng() % 7), chunks = 1 + rng() % 16;
        ckpt::testutil::ReplaceWithZeroFrames(fid, ds, chunk, chunks);
        return "replaced " + ds + " by " + std::to_string(chunk * chunks) + " declared bytes of zstd RLE frames";
      }
      case 16: {  // issue 28, row 11: root attributes past the reader's integers
        static const char* kRoot[] = {"rank", "world_size", "step"};
        static const int64_t kValues[] = {int64_t{1} << 32, (int64_t{1} << 32) + 1, -1, int64_t{1} << 62,
                                          std::numeric_limits<int64_t>::min()};
        const char* name = kRoot[rng() % 3];
        const int64_t value = kValues[rng() % 5];
        H5Adelete(fid, name);
        (void)ckpt::WriteInt64Attr(fid, name, value);
        return std::string("set the root attribute ") + name + " to " + std::to_string(value);
      }
      default:
        H5Adelete(fid, ckpt::kInventoryAttr);
        (void)ckpt::WriteStringAttr(
            fid, ckpt::kInventoryAttr,
            rng() % 2 ? R"([{"path": "model/w", "dtype": "float32", "shape": [40, 100]}])" : "not json");
        return "rewrote the inventory";
    }
  }

  ckpt::ScratchDir scratch_{"oomguard-fuzz"};
  std::string root_ = scratch_.path(), dir_, outside_;
  ckpt_testing::MixedState state_;
  std::unique_ptr<Checkpointer> c_;
  std::vector<std::string> pristine_shard_, pristine_manifest_;
};

TEST_F(ShardFuzzTest, DamagedShardsNeverCrashHangOrLoadWrongValues) {
  Make();
  pristine_shard_.resize(kSteps + 1);
  pristine_manifest_.resize(kSteps + 1);
  for (int64_t s = 1; s <= kSteps; ++s) {
    Fill(s);
    ASSERT_TRUE(c_->SaveAsync(s).ok());
    ASSERT_TRUE(c_->Wait().ok());
  }
  for (int64_t s = 1; s <= kSteps; ++s) {
    pristine_shard_[static_cast<size_t>(s)] = ReadAll(Shard(s));
    pristine_manifest_[static_cast<size_t>(s)] = ReadAll(Manifest(s));
    ASSERT_TRUE(VerifyCheckpoint(dir_, s).ok());
  }
  std::mt19937_64 rng(20261201);
  const int fds_before = OpenFds();
  int loaded_damaged = 0, refused = 0, fixed_manifests = 0;
  std::map<std::string, int> by_kind;
  const auto t0 = std::chrono::steady_clock::now();
  for (int n = 0; n < kShardCases; ++n) {
    // Damage step 3, and in one case of four step 2 as well.
    std::vector<int64_t> damaged = {3};
    if (rng() % 4 == 0) damaged.push_back(2);
    std::string what;
    for (int64_t s : damaged) {
      std::string bytes = pristine_shard_[static_cast<size_t>(s)];
      const int kind = static_cast<int>(rng() % 6);
      if (kind <= 1) {  // byte flips
        const int flips = 1 + static_cast<int>(rng() % 4);
        for (int i = 0; i < flips; ++i) bytes[rng() % bytes.size()] ^= static_cast<char>(1 + rng() % 255);
        WriteAll(Shard(s), bytes);
        what += " flipped " + std::to_string(flips) + " byte(s) of step " + std::to_string(s) + ";";
        by_kind["byte flips"]++;
      } else if (kind == 2) {  // truncation
        bytes.resize(rng() % bytes.size());
        WriteAll(Shard(s), bytes);
        what += " truncated step " + std::to_string(s) + " to " + std::to_string(bytes.size()) + ";";
        by_kind["truncation"]++;
      } else if (kind == 3) {  // appended bytes
        for (int i = 0, k = 1 + static_cast<int>(rng() % 64); i < k; ++i)
          bytes.push_back(static_cast<char>(rng()));
        WriteAll(Shard(s), bytes);
        what += " appended to step " + std::to_string(s) + ";";
        by_kind["appended bytes"]++;
      } else {  // HDF5 object edits
        WriteAll(Shard(s), bytes);
        const int edits = 1 + static_cast<int>(rng() % 2);
        for (int i = 0; i < edits; ++i) what += " " + EditObjects(s, static_cast<int>(rng() % 17), rng) + ";";
        by_kind["HDF5 object edits"]++;
      }
      if (rng() % 10 < 7) {
        FixManifest(s);
        ++fixed_manifests;
      }
    }
    SCOPED_TRACE("case " + std::to_string(n) + ":" + what);
    Status verified = Watched([&] { return VerifyCheckpoint(dir_, 3); }, "verify");
    Scribble();
    auto loaded = Watched([&] { return c_->Load(3); }, "load");
    EXPECT_EQ(verified.ok(), loaded.ok()) << "verify: " << verified << "; load: " << loaded.status();
    if (loaded.ok()) {
      EXPECT_TRUE(Holds(3));
      ++loaded_damaged;
    } else {
      EXPECT_EQ(loaded.status().code(), StatusCode::kDataLoss) << loaded.status();
      ++refused;
    }
    // Resume takes the newest checkpoint that verifies.
    int64_t expect = 0;
    for (int64_t s = kSteps; s >= 1 && expect == 0; --s)
      if (Watched([&] { return VerifyCheckpoint(dir_, s); }, "verify").ok()) expect = s;
    Scribble();
    auto latest = Watched([&] { return c_->LoadLatest(); }, "LoadLatest");
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(*latest, expect);
    EXPECT_TRUE(Holds(*latest));
    for (int64_t s : damaged) Restore(s);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(OpenFds(), fds_before) << "a refused shard left a file descriptor open";
  std::string kinds;
  for (auto& [k, v] : by_kind) kinds += " " + k + "=" + std::to_string(v);
  std::printf("fuzz: %d cases (%s; %d manifests fixed up) in %.1f s: %d refused, %d loaded exact values\n",
              kShardCases, kinds.c_str() + 1, fixed_manifests, seconds, refused, loaded_damaged);
  EXPECT_GT(refused, kShardCases / 2);
}

// Issue 28, row 3: the newest shard is truncated at a random moment and to a
// random length while a verify, a load or a resume reads it (through the
// mapping or by pread, as the page cache decides). Every outcome is a
// status, never a signal: a load either refuses or holds exactly the values
// saved, and a resume lands on the newest checkpoint it could read whole.
TEST_F(ShardFuzzTest, TruncationDuringLoadIsRefusedOrLoadsExactValues) {
  CheckpointOptions o;
  o.dir = dir_;
  o.fsync = false;
  o.threads = 2;
  o.keep = 0;
  o.compression = CheckpointCompression::kNone;  // the file as large as the state
  std::vector<float> big(size_t{4} << 20);         // 16 MiB: a read takes long enough to be cut
  auto fill = [&](int64_t step) {
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(step) + 1e-4f * static_cast<float>(i % 4099);
  };
  auto c = Checkpointer::Create(o).value();
  ASSERT_TRUE(c->AddTensor("model/big", DType::kFloat32, {static_cast<int64_t>(big.size())}, big.data()).ok());
  for (int64_t s : {1, 2}) {
    fill(s);
    ASSERT_TRUE(c->SaveAsync(s).ok());
    ASSERT_TRUE(c->Wait().ok());
  }
  auto holds = [&](int64_t step) {
    for (size_t i = 0; i < big.size(); i += 997)
      if (big[i] != static_cast<float>(step) + 1e-4f * static_cast<float>(i % 4099)) return false;
    return true;
  };
  const std::string pristine = ReadAll(Shard(2));
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(VerifyCheckpoint(dir_, 2).ok());
  const int64_t read_us = std::max<int64_t>(
      1, std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  std::mt19937_64 rng(20261228);
  const int fds_before = OpenFds();
  int refused = 0;
  for (int n = 0; n < kShardCases / 20; ++n) {
    WriteAll(Shard(2), pristine);
    const auto cut_at = static_cast<off_t>(rng() % pristine.size());
    const auto delay = std::chrono::microseconds(static_cast<int64_t>(rng() % static_cast<uint64_t>(read_us)));
    const int op = static_cast<int>(rng() % 3);
    SCOPED_TRACE("case " + std::to_string(n) + ": op " + std::to_string(op) + ", cut to " + std::to_string(cut_at) +
                 " bytes after " + std::to_string(delay.count()) + " us");
    std::atomic<bool> go{false};
    std::thread cutter([&] {
      while (!go.load()) std::this_thread::yield();
      std::this_thread::sleep_for(delay);
      EXPECT_EQ(::truncate(Shard(2).c_str(), cut_at), 0);
    });
    std::fill(big.begin(), big.end(), -1.f);
    go = true;
    if (op == 0) {
      Status v = Watched([&] { return VerifyCheckpoint(dir_, 2); }, "verify");
      if (!v.ok()) {
        ++refused;
        EXPECT_EQ(v.code(), StatusCode::kDataLoss) << v;
      }
    } else if (op == 1) {
      auto loaded = Watched([&] { return c->Load(2); }, "load");
      if (loaded.ok()) {
        EXPECT_TRUE(holds(2));
      } else {
        ++refused;
        EXPECT_EQ(loaded.status().code(), StatusCode::kDataLoss) << loaded.status();
      }
    } else {
      auto latest = Watched([&] { return c->LoadLatest(); }, "LoadLatest");
      ASSERT_TRUE(latest.ok()) << latest.status();
      EXPECT_TRUE(holds(*latest)) << "resumed at step " << *latest;
      refused += *latest == 1;
    }
    cutter.join();
  }
  EXPECT_EQ(OpenFds(), fds_before) << "a refused shard left a file descriptor open";
  std::printf("truncation fuzz: %d cases, %d refused (a read takes %lld us)\n", kShardCases / 20, refused,
              static_cast<long long>(read_us));
  EXPECT_GT(refused, 0);
}

TEST(ManifestFuzzTest, MutatedManifestsNeverCrashAndAcceptOnlyConsistentOnes) {
  ckpt::Manifest m;
  m.format = std::string(kCheckpointFormat);
  m.step = 1234;
  m.world_size = 3;
  m.created_unix = 1700000000;
  for (int r = 0; r < 3; ++r) m.shards.push_back({r, ckpt::ShardFileName(r), 1000 + r, "0123456789abcdef"});
  const std::string valid = ckpt::ManifestToJson(m);
  static const char* kInserts[] = {"[",    "{",    "\"",   "\\", "-", "1e999",       "18446744073709551616",
                                   "0.5",  "null", "true", ",",  ":", "\"rank\": 1", "\"file\": \"../x\"",
                                   "\xff", "\x01"};
  std::mt19937_64 rng(7);
  int accepted = 0;
  for (int n = 0; n < kManifestCases; ++n) {
    std::string t = valid;
    for (int k = 0, edits = 1 + static_cast<int>(rng() % 4); k < edits && !t.empty(); ++k) {
      const size_t at = rng() % t.size();
      switch (rng() % 5) {
        case 0:
          t[at] = static_cast<char>(rng());
          break;
        case 1:
          t.erase(at, 1 + rng() % 8);
          break;
        case 2:
          t.insert(at, kInserts[rng() % 16]);
          break;
        case 3:
          t.insert(at, std::string(1 + rng() % 2000, rng() % 2 ? '[' : '{'));
          break;
        default:
          t.resize(at);
          break;
      }
    }
    auto r = ckpt::ParseManifest(t);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
      continue;
    }
    ++accepted;
    EXPECT_EQ(r->format, kCheckpointFormat);
    EXPECT_GE(r->step, 0);
    ASSERT_GE(r->world_size, 1);
    ASSERT_EQ(r->shards.size(), static_cast<size_t>(r->world_size));
    std::set<int> ranks;
    for (const auto& s : r->shards) {
      EXPECT_TRUE(s.rank >= 0 && s.rank < r->world_size);
      ranks.insert(s.rank);
      EXPECT_FALSE(s.file.empty() || s.file == "." || s.file == ".." ||
                   s.file.find('/') != std::string::npos);
      EXPECT_GE(s.bytes, 0);
      EXPECT_EQ((r->format == kCheckpointFormatV1 ? s.xxh3 : s.digest).size(), 16u);
    }
    EXPECT_EQ(ranks.size(), r->shards.size());
  }
  std::printf("manifest fuzz: %d cases, %d accepted\n", kManifestCases, accepted);
}

}  // namespace
}  // namespace oomguard
