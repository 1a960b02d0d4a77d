// The Checkpointer without a directory (saves kept in memory only, enough for
// the guard's rollbacks) and the end of registration at the first use.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/scratch_dir.h"

namespace oomguard {
namespace {

namespace fs = std::filesystem;

// One tensor and one object, as a model and its optimizer scalars.
struct State {
  std::vector<double> w = std::vector<double>(300);
  int64_t counter = 0;

  void Train(int64_t step) {
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<double>(step) * 1000.0 + static_cast<double>(i);
    counter = step;
  }
  Status Register(Checkpointer& c) {
    OOMGUARD_RETURN_IF_ERROR(
        c.AddTensor("model/w", DType::kFloat64, {static_cast<int64_t>(w.size())}, w.data()));
    return c.AddObject(
        "train/counter",
        [this] {
          std::vector<uint8_t> b(8);
          std::memcpy(b.data(), &counter, 8);
          return b;
        },
        [this](std::span<const uint8_t> b) {
          if (b.size() != 8) return Status::DataLoss("counter has " + std::to_string(b.size()) + " bytes");
          std::memcpy(&counter, b.data(), 8);
          return Status::Ok();
        });
  }
};

std::set<std::string> Listing(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

TEST(InMemoryCheckpointer, SavesRestoreFromMemoryAndNothingIsWritten) {
  const std::set<std::string> cwd_before = Listing(".");
  CheckpointOptions o;  // no dir
  o.every_steps = 2;
  auto c = Checkpointer::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  State st;
  ASSERT_TRUE(st.Register(**c).ok());
  for (int64_t s = 0; s < 5; ++s) {
    st.Train(s);
    ASSERT_TRUE((*c)->OnStepCommitted(s, /*after_recovery=*/false).ok());
  }
  ASSERT_TRUE((*c)->Wait().ok());
  // every_steps = 2 saved steps 1 and 3; the newest replaced the older.
  EXPECT_EQ((*c)->SnapshotStep(), 3);
  EXPECT_TRUE((*c)->DurableSteps().empty()) << "nothing is durable without a directory";
  st.Train(42);
  Status r = (*c)->Restore(3);
  ASSERT_TRUE(r.ok()) << r;
  EXPECT_EQ(st.counter, 3);
  EXPECT_EQ(st.w[7], 3007.0);
  // Step 1 was replaced: exactly the step asked for, or an error.
  Status gone = (*c)->Restore(1);
  EXPECT_EQ(gone.code(), StatusCode::kNotFound) << gone;
  EXPECT_EQ(st.counter, 3) << "a failed restore changes nothing";
  auto latest = (*c)->LoadLatest();
  EXPECT_EQ(latest.status().code(), StatusCode::kNotFound);
  EXPECT_NE(latest.status().message().find("memory only"), std::string::npos) << latest.status();
  EXPECT_EQ((*c)->Load(3).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE((*c)->Commit(3, 1).ok());
  const CheckpointStats stats = (*c)->Stats();
  EXPECT_EQ(stats.saves_started, 2);
  EXPECT_EQ(stats.checkpoints_written, 0);
  EXPECT_EQ(stats.restores_from_memory, 1);
  EXPECT_EQ(stats.state_bytes, 300 * 8 + 8);
  EXPECT_EQ(stats.stall_ms.size(), 2u);
  EXPECT_EQ(Listing("."), cwd_before) << "an in-memory checkpointer wrote into the working directory";
}

TEST(InMemoryCheckpointer, TheSnapshotIsAllItKeepsSoItCannotBeTurnedOff) {
  CheckpointOptions o;
  o.keep_snapshot = false;
  auto c = Checkpointer::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("keep_snapshot"), std::string::npos) << c.status();
}

TEST(InMemoryCheckpointer, AStateOverTheStagingBudgetIsAFailedSaveNotACrash) {
  CheckpointOptions o;
  o.staging_budget_bytes = 1024;  // the tensor alone is 2400 bytes
  auto c = Checkpointer::Create(o).value();
  State st;
  ASSERT_TRUE(st.Register(*c).ok());
  Status s = c->SaveAsync(0);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_FALSE(c->SnapshotStep().has_value());
  EXPECT_EQ(c->Stats().save_failures, 1);
  EXPECT_EQ(c->Wait().code(), StatusCode::kResourceExhausted);
}

// A tensor added after a save is missing from that checkpoint, and every
// later load of it would fail with kDataLoss: refused where the mistake is.
TEST(CheckpointRegistration, AddingStateAfterTheFirstSaveIsRefusedNamingThePath) {
  ckpt::ScratchDir d;
  CheckpointOptions o;
  o.dir = d.path();
  o.fsync = false;
  auto c = Checkpointer::Create(o).value();
  State st;
  ASSERT_TRUE(st.Register(*c).ok());
  st.Train(0);
  ASSERT_TRUE(c->SaveAsync(0).ok());
  std::vector<double> late(4);
  Status t = c->AddTensor("model/late", DType::kFloat64, {4}, late.data());
  EXPECT_EQ(t.code(), StatusCode::kFailedPrecondition) << t;
  EXPECT_NE(t.message().find("/model/late registered after"), std::string::npos) << t;
  Status obj = c->AddObject(
      "train/late", [] { return std::vector<uint8_t>{}; },
      [](std::span<const uint8_t>) { return Status::Ok(); });
  EXPECT_EQ(obj.code(), StatusCode::kFailedPrecondition) << obj;
  EXPECT_NE(obj.message().find("/train/late registered after"), std::string::npos) << obj;
  ASSERT_TRUE(c->Wait().ok());
  // The checkpoint holds what was registered, and loads.
  st.Train(9);
  auto loaded = c->LoadLatest();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(st.counter, 0);
}

TEST(CheckpointRegistration, AFreshDirectoryStaysOpenUntilSomethingIsLoadedOrSaved) {
  ckpt::ScratchDir d;
  CheckpointOptions o;
  o.dir = d.path();
  o.fsync = false;
  State st;
  {
    auto c = Checkpointer::Create(o).value();
    ASSERT_TRUE(st.Register(*c).ok());
    // Nothing to resume from: nothing was loaded, registration goes on.
    EXPECT_EQ(c->LoadLatest().status().code(), StatusCode::kNotFound);
    std::vector<double> more(2);
    EXPECT_TRUE(c->AddTensor("model/more", DType::kFloat64, {2}, more.data()).ok());
    st.Train(5);
    ASSERT_TRUE(c->SaveAsync(5).ok());
    ASSERT_TRUE(c->Wait().ok());
  }
  // After a successful load a new path would keep its fresh value: refused.
  auto c = Checkpointer::Create(o).value();
  ASSERT_TRUE(st.Register(*c).ok());
  std::vector<double> more(2);
  ASSERT_TRUE(c->AddTensor("model/more", DType::kFloat64, {2}, more.data()).ok());
  ASSERT_TRUE(c->LoadLatest().ok());
  std::vector<double> late(2);
  EXPECT_EQ(c->AddTensor("model/late", DType::kFloat64, {2}, late.data()).code(),
            StatusCode::kFailedPrecondition);
}

TEST(CheckpointRegistration, AnInMemorySnapshotEndsRegistrationToo) {
  auto c = Checkpointer::Create(CheckpointOptions{}).value();
  State st;
  ASSERT_TRUE(st.Register(*c).ok());
  ASSERT_TRUE(c->Snapshot(-1).ok());
  std::vector<double> late(2);
  EXPECT_EQ(c->AddTensor("model/late", DType::kFloat64, {2}, late.data()).code(),
            StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace oomguard
