// libtorch_quickstart: the plain libtorch training loop and the same loop
// guarded by oomguard::torch::TrainStep, the two functions that
// docs/getting-started.md shows side by side (the test libtorch_train_cpu
// checks that the page shows them as they are here, and that both end equal).
//
//   libtorch_quickstart [--budget-mib X] [--ckpt-dir DIR]
//
// Trains the same model twice, once per loop: the guarded one under a byte
// budget on torch's CPU allocator (real c10 OOMs; 0: none) and any
// OOMGUARD_FAULTS rules. Prints the largest relative difference between the
// two final parameter sets; exit 0 when it is within 1e-10, 3 when not, 1
// when the guarded run failed, 2 on bad arguments.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/utils.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "oomguard/torch.h"
#include "oomguard/torch_budget.h"

namespace {

constexpr int64_t kSamples = 256;

// Step s's batch: a pure function of s, so every split and redo sees it.
std::pair<torch::Tensor, torch::Tensor> Batch(int64_t step) {
  torch::Tensor i = torch::arange(kSamples, torch::kFloat64).unsqueeze(1);
  torch::Tensor j = torch::arange(16, torch::kFloat64).unsqueeze(0);
  torch::Tensor x = torch::sin(0.01 * i * (j + 1) + 0.1 * static_cast<double>(step));
  return {x, torch::cos(x.sum(1, /*keepdim=*/true))};
}

torch::nn::Sequential MakeModel() {
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(16, 128), torch::nn::Tanh(), torch::nn::Linear(128, 1));
  model->to(torch::kFloat64);
  return model;
}

// [plain]
void TrainPlain(torch::nn::Sequential& model, int64_t steps) {
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::StepLR scheduler(optimizer, /*step_size=*/5, /*gamma=*/0.5);
  for (int64_t step = 0; step < steps; ++step) {
    auto [x, y] = Batch(step);
    optimizer.zero_grad();
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    optimizer.step();
    scheduler.step();
  }
}
// [plain]

// [guarded]
oomguard::Status TrainGuarded(torch::nn::Sequential& model, int64_t steps, const std::string& ckpt_dir) {
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::StepLR scheduler(optimizer, /*step_size=*/5, /*gamma=*/0.5);
  oomguard::torch::TrainOptions options;
  options.scheduler = &scheduler;
  options.checkpoint.dir = ckpt_dir;  // "": rollbacks from memory, nothing on disk
  auto created = oomguard::torch::TrainStep::Create(*model, optimizer, options);
  if (!created.ok()) return created.status();
  oomguard::torch::TrainStep& train = **created;
  OOMGUARD_RETURN_IF_ERROR(train.Resume());  // continues from ckpt_dir's newest checkpoint, if any
  for (int64_t step = train.step(); step < steps; step = train.step()) {
    auto [x, y] = Batch(step);
    oomguard::Status s = train.Step(x.size(0), [&](const oomguard::MicroBatch& mb) {
      return torch::mse_loss(model->forward(x.narrow(0, mb.offset, mb.size)),
                             y.narrow(0, mb.offset, mb.size));
    });
    if (!s.ok() && s.code() != oomguard::StatusCode::kAborted) return s;  // kAborted: rolled back, go on
  }
  return train.Finish().status();
}
// [guarded]

std::vector<double> Flat(torch::nn::Module& model) {
  std::vector<double> out;
  for (const torch::Tensor& p : model.parameters()) {
    torch::Tensor c = p.detach().contiguous();
    out.insert(out.end(), c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  double budget_mib = 0;
  std::string ckpt_dir;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--budget-mib") == 0 && i + 1 < argc) {
      budget_mib = std::atof(argv[++i]);
    } else if (std::strcmp(argv[i], "--ckpt-dir") == 0 && i + 1 < argc) {
      ckpt_dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: libtorch_quickstart [--budget-mib X] [--ckpt-dir DIR]\n");
      return 2;
    }
  }
  constexpr int64_t kSteps = 12;
  torch::nn::Sequential plain = MakeModel();
  TrainPlain(plain, kSteps);

  auto& budget = oomguard::torch::BudgetCpuAllocator::Instance();
  budget.Install(static_cast<int64_t>(budget_mib * 1024 * 1024));
  torch::nn::Sequential guarded = MakeModel();
  oomguard::Status s = TrainGuarded(guarded, kSteps, ckpt_dir);
  budget.set_budget(0);
  if (!s.ok()) {
    std::fprintf(stderr, "libtorch_quickstart: %s\n", s.ToString().c_str());
    return 1;
  }
  const std::vector<double> a = Flat(*plain), b = Flat(*guarded);
  double num = 0, den = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    num = std::max(num, std::fabs(a[k] - b[k]));
    den = std::max(den, std::fabs(a[k]));
  }
  const double rel = num / den;
  std::printf("max relative difference %.3g, %lld torch OOMs under the budget\n", rel,
              static_cast<long long>(budget.ooms()));
  return rel <= 1e-10 ? 0 : 3;
}
