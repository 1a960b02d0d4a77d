// Unit tests of the Checkpointer: options, round trips, asynchronous saves,
// retention, snapshots and restores, staging within and beyond its budget,
// the multi-rank seam, faults and failures reported for Wait(). Also
// compiled under ThreadSanitizer (oomguard_ckpt_tsan_tests), so sizes stay
// small. The SavedRun fixture and the other helpers are shared, in
// checkpoint_testing.h; damaged checkpoints are in
// checkpointer_corruption_test.cc, the codec and manifest in codec_test.cc.
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
#include "sdk/checkpoint/checkpoint_testing.h"
#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/compression.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/scratch_dir.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

using ckpt_testing::SavedRun;
using ckpt_testing::ScratchOptions;
using ckpt_testing::Weights;
using TempDir = ckpt::ScratchDir;

TEST(OptionsTest, BadOptionsNameTheField) {
  TempDir d;
  auto o = ScratchOptions(d.path());
  o.world_size = 0;
  auto c = Checkpointer::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("world_size"), std::string::npos);
  o = ScratchOptions(d.path());
  o.compression_level = 0;
  EXPECT_EQ(Checkpointer::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = ScratchOptions("");  // in memory only: valid, but only with its snapshot
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
    auto c = Checkpointer::Create(ScratchOptions(d.path())).value();
    register_all(c.get(), &bufs);
    ASSERT_TRUE(c->SaveAsync(5).ok());
    ASSERT_TRUE(c->Wait().ok());
    EXPECT_EQ(c->DurableSteps(), std::vector<int64_t>{5});
    EXPECT_EQ(c->Stats().checkpoints_written, 1);
  }
  std::vector<std::vector<uint8_t>> bufs;
  for (auto& t : ts) bufs.push_back(std::vector<uint8_t>(t.data.size(), 0xee));
  auto c = Checkpointer::Create(ScratchOptions(d.path())).value();
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
    auto c = Checkpointer::Create(ScratchOptions(d.path())).value();
    ASSERT_TRUE(c->AddTensor("m/a", DType::kFloat32, {10, 10}, a.data()).ok());
    ASSERT_TRUE(c->SaveAsync(0).ok());
    ASSERT_TRUE(c->Wait().ok());
  }
  auto c = Checkpointer::Create(ScratchOptions(d.path())).value();
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
    auto o = ScratchOptions(d.path() + "/s" + std::to_string(stagers));
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
  CheckpointOptions bad = ScratchOptions(d.path());
  bad.stage_threads = -1;
  auto r = Checkpointer::Create(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("stage_threads"), std::string::npos) << r.status();
}

TEST_F(SavedRun, RetentionKeepsTheLastK) {
  auto o = ScratchOptions(d_.path());
  o.keep = 2;
  Make(o);
  SaveSteps(5);
  EXPECT_EQ(saves_, (std::vector<int64_t>{0, 1, 2, 3, 4})) << "each save staged its own step";
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
  auto o = ScratchOptions(d_.path());
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
  Make(ScratchOptions(d_.path()));
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
    auto o = ScratchOptions(d.path());
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
  Make(ScratchOptions(d_.path()));
  SaveSteps(3);
  EXPECT_EQ(c_->SnapshotStep(), 2);
  Train(99);
  fs::remove_all(d_.path() + "/step-00000002");  // prove the restore does not read disk
  Status r = c_->Restore(2);
  ASSERT_TRUE(r.ok()) << r;
  EXPECT_EQ(counter_, 2);
  EXPECT_FLOAT_EQ(w_[0], static_cast<float>(std::sin(2.0)));
  EXPECT_EQ(c_->Stats().restores_from_memory, 1);
  EXPECT_EQ(loads_, (std::vector<int64_t>{2})) << "one restore, of step 2";
}

TEST_F(SavedRun, RestoreFromDiskWhenNoSnapshot) {
  auto o = ScratchOptions(d_.path());
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
  auto o = ScratchOptions(d_.path());
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
  EXPECT_TRUE(loads_.empty()) << "a refused restore loads no object";
  ASSERT_TRUE(c_->Restore(0).ok());
  EXPECT_EQ(counter_, 0);
  EXPECT_EQ(loads_, (std::vector<int64_t>{0}));
}

TEST_F(SavedRun, SnapshotKeepsTheCurrentStateInMemoryWithoutWriting) {
  Make(ScratchOptions(d_.path()));
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
  auto o = ScratchOptions(d_.path());
  o.staging_budget_bytes = 3 * 4096;  // the tensor is 25.6 KB
  Make(o);
  Status s = c_->Snapshot(-1);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_FALSE(c_->SnapshotStep().has_value());
}

TEST_F(SavedRun, StateLargerThanBudgetIsStagedInPieces) {
  auto o = ScratchOptions(d_.path());
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
  auto o = ScratchOptions(d_.path());
  o.staging_budget_bytes = 6400 * 4 + 64;  // one copy (+ the counter), not two
  Make(o);
  SaveSteps(4);
  EXPECT_EQ(c_->SnapshotStep(), 3);
  ASSERT_TRUE(c_->Restore(3).ok());
  EXPECT_EQ(counter_, 3);
}

TEST_F(SavedRun, CoordinatorCommitsTheManifest) {
  auto o = ScratchOptions(d_.path());
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
  auto o = ScratchOptions(d_.path());
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
  Make(ScratchOptions(d_.path()));
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
  auto o = ScratchOptions(d_.path());
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
  auto o = ScratchOptions(d_.path());
  o.world_size = 2;
  Make(o);
  SaveSteps(1);
  EXPECT_FALSE(fs::exists(d_.path() + "/step-00000000/MANIFEST.json"));
  EXPECT_EQ(c_->DurableSteps(), std::vector<int64_t>{0});
}

// Piece mode: a staging failure after the writer began consuming pieces must
// release the writer, so that Wait, the next save and the destructor return.
TEST_F(SavedRun, StagingFailureInPieceModeDoesNotHangTheWriter) {
  auto o = ScratchOptions(d_.path());
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
  Make(ScratchOptions(d_.path()));
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
  Make(ScratchOptions(d_.path()));
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
  Make(ScratchOptions(d_.path()));
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
  Make(ScratchOptions(d_.path()));
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
    CheckpointOptions o = ScratchOptions(d.path());
    (field == 0 ? o.threads : o.stage_threads) = 100000;
    auto c = Checkpointer::Create(o);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(field == 0 ? "threads must be in [0, 256]" : "stage_threads"),
              std::string::npos)
        << c.status();
  }
  CheckpointOptions o = ScratchOptions(d.path());
  o.threads = kMaxCheckpointThreads;
  EXPECT_TRUE(Checkpointer::Create(o).ok());
}

// Issue 28, row 15: a state path that HDF5 would store under another name
// (cut at a NUL, "." resolved) could never be loaded: refused at registration.
TEST(OptionsTest, StatePathsThatCouldNeverLoadAreRefused) {
  TempDir d;
  auto c = Checkpointer::Create(ScratchOptions(d.path())).value();
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
