// oomguard::torch against real libtorch: rollbacks restore a module, an
// optimizer (SGD with momentum, Adam, AdamW) and an LR scheduler exactly, so
// that guarded training with OOMs ends where the plain libtorch loop ends
// (float64, 1e-10 relative); real c10 OOMs from the budgeted allocator;
// several ranks as threads.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "oomguard/faults.h"
#include "oomguard/torch.h"
#include "oomguard/torch_budget.h"

namespace oomguard::torch {
namespace {

namespace F = ::torch::nn::functional;
using ::torch::Tensor;

constexpr int64_t kInputs = 6;
constexpr int64_t kBatch = 24;

// Step s's batch: a pure function of (s, sample), so every split, redo and
// rank sees the same data.
std::pair<Tensor, Tensor> Batch(int64_t s, int64_t begin = 0, int64_t n = kBatch) {
  Tensor x = ::torch::empty({n, kInputs}, ::torch::kFloat64);
  Tensor y = ::torch::empty({n, 1}, ::torch::kFloat64);
  auto xa = x.accessor<double, 2>();
  auto ya = y.accessor<double, 2>();
  for (int64_t i = 0; i < n; ++i) {
    double dot = 0;
    for (int64_t j = 0; j < kInputs; ++j) {
      xa[i][j] = std::sin(0.37 * static_cast<double>(s * 131 + (begin + i) * 7 + j * 3));
      dot += xa[i][j] * (0.5 - 0.1 * static_cast<double>(j));
    }
    ya[i][0] = std::cos(2.0 * dot);
  }
  return {x, y};
}

::torch::nn::Sequential MakeModel(int64_t hidden = 16) {
  ::torch::manual_seed(7);
  ::torch::nn::Sequential m(::torch::nn::Linear(kInputs, hidden), ::torch::nn::Tanh(),
                            ::torch::nn::Linear(hidden, hidden), ::torch::nn::Tanh(),
                            ::torch::nn::Linear(hidden, 1));
  m->to(::torch::kFloat64);
  return m;
}

std::unique_ptr<::torch::optim::Optimizer> MakeOptimizer(const std::string& kind, ::torch::nn::Module& m) {
  if (kind == "sgd")
    return std::make_unique<::torch::optim::SGD>(m.parameters(),
                                                 ::torch::optim::SGDOptions(0.05).momentum(0.9));
  if (kind == "adamw")
    return std::make_unique<::torch::optim::AdamW>(m.parameters(),
                                                   ::torch::optim::AdamWOptions(0.01).weight_decay(0.1));
  return std::make_unique<::torch::optim::Adam>(m.parameters(), ::torch::optim::AdamOptions(0.01));
}

std::vector<double> Flat(::torch::nn::Module& m) {
  std::vector<double> out;
  for (const Tensor& p : m.parameters()) {
    Tensor c = p.detach().contiguous();
    out.insert(out.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return out;
}

double MaxRelDiff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  return num / den;
}

double Lr(::torch::optim::Optimizer& o) { return o.param_groups()[0].options().get_lr(); }

// The mean squared error of `model` on micro-batch mb of the batch (x, y).
TrainStep::LossFn MseOf(::torch::nn::Sequential model, const Tensor& x, const Tensor& y) {
  return [model, x, y](const MicroBatch& mb) mutable {
    return F::mse_loss(model->forward(x.narrow(0, mb.offset, mb.size)), y.narrow(0, mb.offset, mb.size));
  };
}

[[noreturn]] void ThrowTorchOom(const std::string& what) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 MiB (", what, ")");
  throw std::logic_error("unreachable");
}

// A schedule of the user's own: the learning rate halves every 3 steps. It
// raises a c10 OOM inside its step on the steps asked for, once each: after
// optimizer.step() changed the parameters and the optimizer's state.
class HalvingSchedule : public ::torch::optim::LRScheduler {
 public:
  HalvingSchedule(::torch::optim::Optimizer& o, std::set<unsigned> oom_at = {})
      : LRScheduler(o), oom_at_(std::move(oom_at)) {}
  int fired = 0;

 private:
  std::vector<double> get_lrs() override {
    if (oom_at_.erase(step_count_) > 0) {
      ++fired;
      ThrowTorchOom("after the optimizer step " + std::to_string(step_count_));
    }
    std::vector<double> lrs = get_current_lrs();
    if (step_count_ > 0 && step_count_ % 3 == 0)
      for (double& lr : lrs) lr *= 0.5;
    return lrs;
  }
  std::set<unsigned> oom_at_;
};

struct Result {
  std::vector<double> params;
  double lr = 0;
  double loss = 0;
};

// The plain libtorch loop: the reference.
template <typename Schedule, typename... Args>
Result Plain(const std::string& kind, int steps, double max_grad_norm, Args... schedule_args) {
  auto model = MakeModel();
  auto opt = MakeOptimizer(kind, *model);
  Schedule schedule(*opt, schedule_args...);
  Result r;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = Batch(s);
    opt->zero_grad();
    Tensor loss = F::mse_loss(model->forward(x), y);
    loss.backward();
    if (max_grad_norm > 0) ::torch::nn::utils::clip_grad_norm_(model->parameters(), max_grad_norm);
    opt->step();
    schedule.step();
    r.loss = loss.item<double>();
  }
  r.params = Flat(*model);
  r.lr = Lr(*opt);
  return r;
}

class TorchTrainStep : public ::testing::Test {
 protected:
  void TearDown() override {
    ClearFaultRules();
    auto& budget = BudgetCpuAllocator::Instance();
    if (budget.installed()) budget.Uninstall();
  }
};

// The helpers in a loop that drives the guard itself: an OOM raised after
// optimizer.step() and scheduler.step() (parameters, optimizer state and
// schedule all moved on) at several steps rolls back from memory, and the run
// ends exactly where the plain loop ends, learning rate included.
TEST_F(TorchTrainStep, OomAfterTheOptimizerStepRollsBackExactlyForEachOptimizer) {
  constexpr int kSteps = 10;
  const std::set<int64_t> oom_steps = {0, 3, 7};
  for (const std::string kind : {"sgd", "adam", "adamw"}) {
    const Result ref = Plain<::torch::optim::StepLR>(kind, kSteps, 0, 3u, 0.5);
    auto model = MakeModel();
    auto opt = MakeOptimizer(kind, *model);
    ::torch::optim::StepLR schedule(*opt, 3, 0.5);
    CheckpointOptions co;  // no directory: rollbacks from memory
    co.every_steps = 2;
    auto ckpt = Checkpointer::Create(co).value();
    ASSERT_TRUE(AddModule(*ckpt, "model", *model).ok());
    ASSERT_TRUE(AddOptimizer(*ckpt, "optimizer", *opt).ok());
    ASSERT_TRUE(AddScheduler(*ckpt, "scheduler", schedule).ok());
    GuardOptions go;
    go.recovery = ckpt.get();
    go.initial_micro_batch = 8;
    auto guard = Guard::Create(go).value();
    std::set<int64_t> fired;
    int rollbacks = 0;
    for (int64_t s = guard->step(); s < kSteps; s = guard->step()) {
      auto [x, y] = Batch(s);
      StepRequest req;
      req.samples = kBatch;
      req.micro = [&](const MicroBatch& mb) {
        guard->MarkPhase(Phase::kForward);
        Tensor loss =
            F::mse_loss(model->forward(x.narrow(0, mb.offset, mb.size)), y.narrow(0, mb.offset, mb.size));
        guard->MarkPhase(Phase::kBackward);
        (loss * mb.weight).backward();
      };
      req.reset = [&] { opt->zero_grad(); };
      req.apply = [&] {
        opt->step();
        schedule.step();
        opt->zero_grad();
        if (oom_steps.count(s) > 0 && fired.insert(s).second) ThrowTorchOom("step " + std::to_string(s));
      };
      StepReport rep;
      Status st = guard->Step(req, &rep);
      if (st.code() == StatusCode::kAborted) {
        ++rollbacks;
        ASSERT_TRUE(rep.rolled_back_to.has_value());
        continue;
      }
      ASSERT_TRUE(st.ok()) << kind << " step " << s << ": " << st;
    }
    EXPECT_EQ(rollbacks, 3) << kind;
    EXPECT_EQ(ckpt->Stats().restores_from_memory, 3) << kind;
    EXPECT_LE(MaxRelDiff(Flat(*model), ref.params), 1e-10) << kind;
    EXPECT_DOUBLE_EQ(Lr(*opt), ref.lr) << kind << ": the learning rate of the schedule";
  }
}

// Why the helpers exist: restoring libtorch's optimizer with torch::load on
// the live optimizer merges, so the state of a step the rollback undid
// survives it, and the run ends elsewhere with no error.
TEST_F(TorchTrainStep, TorchLoadIntoTheLiveOptimizerIsNotARestore) {
  auto model = MakeModel();
  auto opt = MakeOptimizer("adam", *model);
  std::ostringstream before;
  ::torch::save(*opt, before);  // the state before the first step: none
  auto [x, y] = Batch(0);
  F::mse_loss(model->forward(x), y).backward();
  opt->step();
  std::istringstream is(before.str());
  ::torch::load(*opt, is);
  EXPECT_FALSE(opt->state().empty()) << "torch::load now replaces the state: AddOptimizer's clear could go";

  CheckpointOptions co;
  auto ckpt = Checkpointer::Create(co).value();
  auto fresh = MakeOptimizer("adam", *model);
  ASSERT_TRUE(AddOptimizer(*ckpt, "optimizer", *fresh).ok());
  ASSERT_TRUE(ckpt->Snapshot(-1).ok());
  F::mse_loss(model->forward(x), y).backward();
  fresh->step();
  ASSERT_FALSE(fresh->state().empty());
  ASSERT_TRUE(ckpt->Restore(-1).ok());
  EXPECT_TRUE(fresh->state().empty()) << "the restore kept state of a step it undid";
}

// TrainStep: an OOM after the optimizer step (here inside the user's own
// scheduler), OOMs in forward and backward that split the step, gradient
// clipping: the same result as the plain loop, and the same loss.
TEST_F(TorchTrainStep, TrainStepEqualsThePlainLoopThroughOomsEverywhere) {
  constexpr int kSteps = 9;
  for (const std::string kind : {"sgd", "adam", "adamw"}) {
    const Result ref = Plain<HalvingSchedule>(kind, kSteps, 0.5);
    auto model = MakeModel();
    auto opt = MakeOptimizer(kind, *model);
    HalvingSchedule schedule(*opt, {1, 5});
    TrainOptions o;
    o.scheduler = &schedule;
    o.max_grad_norm = 0.5;
    o.checkpoint.every_steps = 3;
    auto train = TrainStep::Create(*model, *opt, o);
    ASSERT_TRUE(train.ok()) << train.status();
    ASSERT_TRUE(SetFaultRules("oom@step=2,site=backward;oom@step=4,site=forward,micro=0").ok());
    int rollbacks = 0, ooms = 0;
    ASSERT_TRUE((*train)->Resume().ok());
    EXPECT_EQ((*train)->step(), 0) << "nothing to resume in memory";
    for (int64_t s = (*train)->step(); s < kSteps; s = (*train)->step()) {
      auto [x, y] = Batch(s);
      StepReport rep;
      Status st = (*train)->Step(kBatch, MseOf(model, x, y), &rep);
      ooms += rep.ooms;
      if (st.code() == StatusCode::kAborted) {
        ++rollbacks;
        continue;
      }
      ASSERT_TRUE(st.ok()) << kind << " step " << s << ": " << st;
    }
    ClearFaultRules();
    EXPECT_EQ(schedule.fired, 2) << kind;
    EXPECT_EQ(rollbacks, 2) << kind;
    EXPECT_GE(ooms, 4) << kind;
    EXPECT_LE(MaxRelDiff(Flat(*model), ref.params), 1e-10) << kind;
    EXPECT_DOUBLE_EQ(Lr(*opt), ref.lr) << kind;
    EXPECT_NEAR((*train)->loss(), ref.loss, 1e-10 * std::fabs(ref.loss)) << kind;
    auto last = (*train)->Finish();
    EXPECT_TRUE(last.ok()) << last.status();
  }
}

// Real c10 OOMs from a byte budget on torch's CPU allocator: the full batch
// does not fit, its halves do; and during the first attempt of step 0 the
// budget is squeezed so that AdamW's first optimizer step (its moments) does
// not fit, which rolls back to the state before it, kept in memory without
// a checkpoint directory (AdamW's first step at a small budget was fatal).
TEST_F(TorchTrainStep, RealBudgetOomsSplitAndRollBackFromMemory) {
  constexpr int kSteps = 5;
  constexpr int64_t kHidden = 64, kSamples = 256;  // activations well above the parameters
  const Result ref = [&] {
    auto model = MakeModel(kHidden);
    auto opt = MakeOptimizer("adamw", *model);
    ::torch::optim::StepLR schedule(*opt, 2, 0.5);
    Result r;
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = Batch(s, 0, kSamples);
      opt->zero_grad();
      F::mse_loss(model->forward(x), y).backward();
      opt->step();
      schedule.step();
    }
    r.params = Flat(*model);
    return r;
  }();

  auto& budget = BudgetCpuAllocator::Instance();
  budget.Install(0);  // counting only, to measure
  auto model = MakeModel(kHidden);
  auto opt = MakeOptimizer("adamw", *model);
  ::torch::optim::StepLR schedule(*opt, 2, 0.5);
  int64_t param_bytes = 0;
  for (const Tensor& p : model->parameters()) param_bytes += p.nbytes();
  int64_t base = 0, whole_step = 0;
  {
    auto [x0, y0] = Batch(0, 0, kSamples);
    base = budget.allocated();  // the parameters and a step's batch
    budget.ResetPeak();
    F::mse_loss(model->forward(x0), y0).backward();
    whole_step = budget.peak() - base;  // gradients and the whole batch's activations
    opt->zero_grad();
  }
  ASSERT_GT(whole_step, 4 * param_bytes) << "the activations must dominate for the budget to split the batch";
  // Half the batch's activations and the gradients fit, and so do AdamW's
  // moments (twice the parameters) and its temporaries afterwards. Squeezed
  // for step 0's first attempt: the gradients and 1.5x the parameters, which
  // a smaller micro-batch's activations fit in and the moments do not.
  const int64_t fits = base + param_bytes + (whole_step - param_bytes) / 2 + 5 * param_bytes;
  const int64_t tight = base + param_bytes + 3 * param_bytes / 2;

  TrainOptions o;
  o.scheduler = &schedule;
  auto train = TrainStep::Create(*model, *opt, o).value();
  int rollbacks = 0, ooms = 0;
  bool squeezed = false;
  for (int64_t s = train->step(); s < kSteps; s = train->step()) {
    auto [x, y] = Batch(s, 0, kSamples);
    budget.set_budget(s == 0 && !squeezed ? tight : fits);
    squeezed = squeezed || s == 0;
    StepReport rep;
    Status st = train->Step(kSamples, MseOf(model, x, y), &rep);
    ooms += rep.ooms;
    for (const Incident& inc : rep.incidents) EXPECT_EQ(inc.exception_type, "c10::OutOfMemoryError");
    if (st.code() == StatusCode::kAborted) {
      ++rollbacks;
      EXPECT_EQ(rep.rolled_back_to, -1) << "back to the state before the first optimizer step";
      EXPECT_EQ(rep.incidents.back().phase, Phase::kOptimizer);
      continue;
    }
    ASSERT_TRUE(st.ok()) << "step " << s << ": " << st;
  }
  budget.set_budget(0);
  EXPECT_EQ(rollbacks, 1);
  EXPECT_GE(ooms, 2) << "the budget splits the batch and stops the first optimizer step";
  EXPECT_LT(train->guard().micro_limit(), kSamples) << "the whole batch never fit";
  EXPECT_LE(MaxRelDiff(Flat(*model), ref.params), 1e-10);
  EXPECT_EQ(train->checkpointer().Stats().checkpoints_written, 0) << "nothing on disk";
}

// Two ranks as threads, each with its own replica and half of every batch;
// TrainStep sums the gradients (GradientBuffers) and the loss over the ranks
// after the vote. An OOM on rank 1 redoes its part; both end where the
// single-process plain loop ends.
TEST_F(TorchTrainStep, TwoRanksSumGradientsAndEqualThePlainLoop) {
  constexpr int kSteps = 5;
  const Result ref = Plain<::torch::optim::StepLR>("adam", kSteps, 0, 2u, 0.5);
  auto group = MakeThreadGroup(2).value();
  std::vector<::torch::nn::Sequential> models = {MakeModel(), MakeModel()};
  std::vector<std::unique_ptr<::torch::optim::Optimizer>> opts;
  std::vector<std::unique_ptr<::torch::optim::StepLR>> schedules;
  for (auto& m : models) {
    opts.push_back(MakeOptimizer("adam", *m));
    schedules.push_back(std::make_unique<::torch::optim::StepLR>(*opts.back(), 2, 0.5));
  }
  ASSERT_TRUE(SetFaultRules("oom@step=2,rank=1,site=backward").ok());
  std::vector<Status> failures(2);
  std::vector<double> losses(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      TrainOptions o;
      o.guard.coordinator = group[static_cast<size_t>(r)].get();
      o.guard.initial_micro_batch = 6;
      o.scheduler = schedules[static_cast<size_t>(r)].get();
      auto train = TrainStep::Create(*models[static_cast<size_t>(r)], *opts[static_cast<size_t>(r)], o);
      if (!train.ok()) {
        failures[static_cast<size_t>(r)] = train.status();
        return;
      }
      for (int64_t s = (*train)->step(); s < kSteps; s = (*train)->step()) {
        auto [x, y] = Batch(s, r * kBatch / 2, kBatch / 2);  // this rank's half of the global batch
        Status st = (*train)->Step(kBatch / 2, MseOf(models[static_cast<size_t>(r)], x, y));
        if (!st.ok()) {
          failures[static_cast<size_t>(r)] = st;
          return;
        }
      }
      losses[static_cast<size_t>(r)] = (*train)->loss();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(failures[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << failures[static_cast<size_t>(r)];
    EXPECT_LE(MaxRelDiff(Flat(*models[static_cast<size_t>(r)]), ref.params), 1e-10) << "rank " << r;
    EXPECT_NEAR(losses[static_cast<size_t>(r)], ref.loss, 1e-10 * std::fabs(ref.loss))
        << "the global batch's loss";
  }
}

TEST_F(TorchTrainStep, RegistrationRefusesWhatCouldNotBeRestoredInPlace) {
  struct Odd : ::torch::nn::Module {
    Odd() { w = register_parameter("w", ::torch::randn({4, 3}, ::torch::kFloat64).t()); }
    Tensor w;
  };
  Odd odd;
  auto ckpt = Checkpointer::Create(CheckpointOptions{}).value();
  Status s = AddModule(*ckpt, "m", odd);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("m/w is not contiguous"), std::string::npos) << s;

  // Registered, then moved: the next save fails naming the tensor instead of
  // copying memory the module no longer uses.
  auto model = MakeModel();
  auto ckpt2 = Checkpointer::Create(CheckpointOptions{}).value();
  ASSERT_TRUE(AddModule(*ckpt2, "model", *model).ok());
  ASSERT_TRUE(ckpt2->SaveAsync(0).ok());
  model->to(::torch::kFloat32);
  Status moved = ckpt2->SaveAsync(1);
  EXPECT_FALSE(moved.ok());
  EXPECT_NE(moved.message().find("model/0.weight no longer holds the memory"), std::string::npos) << moved;
  EXPECT_EQ(ckpt2->Restore(0).code(), StatusCode::kFailedPrecondition);

  TrainOptions bad;
  auto other = Checkpointer::Create(CheckpointOptions{}).value();
  bad.guard.recovery = other.get();
  auto opt = MakeOptimizer("sgd", *model);
  auto refused = TrainStep::Create(*model, *opt, bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("recovery"), std::string::npos) << refused.status();
  TrainOptions neg;
  neg.max_grad_norm = -1;
  EXPECT_EQ(TrainStep::Create(*model, *opt, neg).status().code(), StatusCode::kInvalidArgument);
}

// With a directory, a run stopped part-way resumes where it stopped and ends
// where the uninterrupted plain loop ends (Resume, the one resume idiom).
TEST_F(TorchTrainStep, ResumeFromDiskContinuesExactly) {
  constexpr int kSteps = 7;
  const Result ref = Plain<::torch::optim::StepLR>("adamw", kSteps, 0, 2u, 0.5);
  char dir[] = "/tmp/oomguard-torch-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  auto run = [&](int until) {
    auto model = MakeModel();
    auto opt = MakeOptimizer("adamw", *model);
    ::torch::optim::StepLR schedule(*opt, 2, 0.5);
    TrainOptions o;
    o.scheduler = &schedule;
    o.checkpoint.dir = dir;
    o.checkpoint.every_steps = 2;
    o.checkpoint.fsync = false;
    auto train = TrainStep::Create(*model, *opt, o).value();
    EXPECT_TRUE(train->Resume().ok());
    const int64_t start = train->step();
    for (int64_t s = start; s < until; s = train->step()) {
      auto [x, y] = Batch(s);
      Status st = train->Step(kBatch, MseOf(model, x, y));
      EXPECT_TRUE(st.ok()) << st;
    }
    EXPECT_TRUE(train->Finish().ok());
    return std::make_pair(start, Flat(*model));
  };
  auto [first_start, unused] = run(4);  // checkpoints after steps 1 and 3
  EXPECT_EQ(first_start, 0);
  auto [second_start, params] = run(kSteps);
  EXPECT_EQ(second_start, 4);
  EXPECT_LE(MaxRelDiff(params, ref.params), 1e-10);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace oomguard::torch
