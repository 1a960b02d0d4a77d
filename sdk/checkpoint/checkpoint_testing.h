// Test helpers of the checkpoint component, in one place (as the guard's are
// in sdk/guard/guard_testing.h): the scratch options, values that look like
// weights, and the registered states the tests save and load. Each state's
// object records what was done to it (every save and every load), so that a
// test can assert that a load or restore happened, and to which step, rather
// than only what the Checkpointer says about itself. Test-only: nothing in
// the library includes this.
//
//   ScratchOptions  a Checkpointer in a scratch directory: small chunks, no fsync
//   Weights         smooth, signed, small float32 values
//   SavedRun        fixture: one float32 tensor that training changes between
//                   saves, and a step counter object that records its loads
//   MixedState      every kind of entry a shard holds (the values of
//                   testdata/ckpt-v1), whose object records its loads
#ifndef OOMGUARD_SDK_CHECKPOINT_CHECKPOINT_TESTING_H_
#define OOMGUARD_SDK_CHECKPOINT_CHECKPOINT_TESTING_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/scratch_dir.h"

namespace oomguard::ckpt_testing {

// Checkpoints in a scratch directory: chunks of 4 KiB (so that the tests'
// small tensors span several), no fsync (durability is tested by the kill
// tests), two threads.
inline CheckpointOptions ScratchOptions(const std::string& dir) {
  CheckpointOptions o;
  o.dir = dir;
  o.fsync = false;
  o.chunk_bytes = 4096;
  o.threads = 2;
  return o;
}

// Values that look like trained weights: smooth, signed, small.
inline std::vector<float> Weights(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 0.02f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// One tensor ("model/w", 64 x 100 float32) that Train(step) sets, and a step
// counter object ("train/counter", 8 bytes) that records the value of every
// save (saves_) and every load (loads_): a load that never reached the
// objects, or a restore of the wrong step, shows there.
class SavedRun : public ::testing::Test {
 protected:
  void Make(CheckpointOptions o) {
    c_ = Checkpointer::Create(o).value();
    ASSERT_TRUE(c_->AddTensor("model/w", DType::kFloat32, {64, 100}, w_.data()).ok());
    ASSERT_TRUE(c_->AddObject(
                      "train/counter",
                      [this] {
                        std::vector<uint8_t> b(8);
                        std::memcpy(b.data(), &counter_, 8);
                        saves_.push_back(counter_);
                        return b;
                      },
                      [this](std::span<const uint8_t> b) {
                        if (b.size() != 8)
                          return Status::DataLoss("counter has " + std::to_string(b.size()) + " bytes");
                        std::memcpy(&counter_, b.data(), 8);
                        loads_.push_back(counter_);
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

  ckpt::ScratchDir d_;
  std::vector<float> w_ = std::vector<float>(6400);
  int64_t counter_ = 0;
  std::vector<int64_t> saves_;  // the counter at each save of the object (SaveAsync, Snapshot)
  std::vector<int64_t> loads_;  // the counter each load of the object set (Load*, Restore)
  std::unique_ptr<Checkpointer> c_;
};

// Every kind of entry a shard holds: float32 across many chunks, float64
// with a partial edge chunk, a bf16 vector, an int64 scalar (contiguous,
// unfiltered), an empty tensor, and an object. Fill(step) gives the values
// testdata/ckpt-v1 holds for its steps (testdata/README.md).
class MixedState {
 public:
  void Register(Checkpointer* c) {
    ASSERT_TRUE(c->AddTensor("model/w", DType::kFloat32, {40, 100}, w_.data()).ok());
    ASSERT_TRUE(c->AddTensor("model/b", DType::kFloat64, {700}, b_.data()).ok());
    ASSERT_TRUE(c->AddTensor("model/h", DType::kBFloat16, {33}, h_.data()).ok());
    ASSERT_TRUE(c->AddTensor("train/scalar", DType::kInt64, {}, &scalar_).ok());
    ASSERT_TRUE(c->AddTensor("train/empty", DType::kFloat32, {0, 5}, nullptr).ok());
    ASSERT_TRUE(c->AddObject(
                     "optimizer/state", [this] { return object_; },
                     [this](std::span<const uint8_t> b) {
                       object_.assign(b.begin(), b.end());
                       loads_.push_back(static_cast<int64_t>(b.size()) - kObjectBase);
                       return Status::Ok();
                     })
                    .ok());
  }
  void Fill(int64_t step) {
    for (size_t i = 0; i < w_.size(); ++i) w_[i] = static_cast<float>(step) + 0.001f * static_cast<float>(i);
    for (size_t i = 0; i < b_.size(); ++i) b_[i] = static_cast<double>(step) * 1e6 + static_cast<double>(i);
    for (size_t i = 0; i < h_.size(); ++i)
      h_[i] = static_cast<uint16_t>(step * 100 + static_cast<int64_t>(i));
    scalar_ = step * 7;
    object_.assign(static_cast<size_t>(kObjectBase + step), static_cast<uint8_t>(step));
  }
  // Values no step has.
  void Scribble() {
    std::fill(w_.begin(), w_.end(), -1.f);
    std::fill(b_.begin(), b_.end(), -1.0);
    std::fill(h_.begin(), h_.end(), uint16_t{0xffff});
    scalar_ = -1;
    object_.clear();
  }
  // Whether the registered state holds exactly what Fill(step) gives; the
  // failure names the entries that differ.
  ::testing::AssertionResult Holds(int64_t step) const {
    MixedState want;
    want.Fill(step);
    std::string differ;
    if (w_ != want.w_) differ += " /model/w";
    if (b_ != want.b_) differ += " /model/b";
    if (h_ != want.h_) differ += " /model/h";
    if (scalar_ != want.scalar_) differ += " /train/scalar";
    if (object_ != want.object_) differ += " /optimizer/state";
    if (differ.empty()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "the loaded state is not the state of step " << step << ":" << differ << " differ";
  }
  // The step of every load of the object, in order (the object of step s
  // has kObjectBase + s bytes). Objects load last, only once every byte of
  // the shard verified: a refused checkpoint never shows here.
  const std::vector<int64_t>& loads() const { return loads_; }

 private:
  static constexpr int64_t kObjectBase = 300;
  std::vector<float> w_ = std::vector<float>(4000);
  std::vector<double> b_ = std::vector<double>(700);
  std::vector<uint16_t> h_ = std::vector<uint16_t>(33);
  int64_t scalar_ = 0;
  std::vector<uint8_t> object_;
  std::vector<int64_t> loads_;
};

}  // namespace oomguard::ckpt_testing

#endif  // OOMGUARD_SDK_CHECKPOINT_CHECKPOINT_TESTING_H_
