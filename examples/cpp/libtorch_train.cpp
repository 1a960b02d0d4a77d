// libtorch_train: a real libtorch model trained through oomguard::torch's
// TrainStep (oomguard/torch.h), which owns the guard, the checkpoints and the
// exact rollback of the model, the optimizer and the LR scheduler.
//
//   libtorch_train --steps 20 --global-batch 512 --budget-mib 8 --json
//   libtorch_train --device cuda --budget-mib 256 --hidden 2048
//   libtorch_train --ckpt-dir /tmp/ck --ckpt-every 5 [--resume]
//   libtorch_train --optimizer adamw --budget-mib 4 --squeeze-mib 1 --squeeze-step 3
//
// Model: x (32) -> tanh(Linear) (H) -> tanh(Linear) (H) -> Linear (1), float64,
// mean squared error, Adam (or AdamW, or SGD with momentum) with a StepLR
// schedule. Data: sample i of step s is a pure function of (seed, s, i), so
// any split of a step into micro-batches, a rollback or a resumed run sees
// the same batch. --plain trains the same model with the plain libtorch loop
// (no guard), the reference the guarded runs must equal.
//
// On CPU, torch's CPU allocator is wrapped by a byte budget (--budget-mib,
// BudgetCpuAllocator), so a micro-batch whose activations do not fit fails
// inside a real tensor allocation with c10::OutOfMemoryError. On CUDA
// (--device cuda, a libtorch built with CUDA) the budget is a memory fraction
// of torch's CUDA caching allocator, so the OOMs are torch's own CUDA OOMs.
// Either way the guard splits the step into smaller micro-batches with the
// same global batch, and the final parameters equal those of a run without
// OOMs (float64: within 1e-10 relative; compare with --dump-params and
// --check-against). --squeeze-mib holds that much more memory during the
// first attempt of step --squeeze-step (a neighbour's allocation that comes
// and goes): when the optimizer step no longer fits beside it, the run rolls
// back (from memory without --ckpt-dir) and redoes the steps, exactly.
//
// Exit codes: 0 done, 1 training failed, 2 bad arguments or device not
// available, 3 --check-against mismatch.
#include <CLI/CLI.hpp>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#ifdef OOMGUARD_EXAMPLE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "mlp.h"  // SplitMix64, DumpAndCheckParameters
#include "oomguard/oomguard.h"
#include "oomguard/torch.h"
#include "oomguard/torch_budget.h"

namespace {

constexpr int64_t kInputs = 32;

// Uniform in [-1, 1) from (seed, step, sample, feature).
double Uniform(uint64_t seed, int64_t step, int64_t sample, int64_t feature) {
  uint64_t h = mlp::SplitMix64(seed);
  h = mlp::SplitMix64(h ^ static_cast<uint64_t>(step));
  h = mlp::SplitMix64(h ^ static_cast<uint64_t>(sample));
  h = mlp::SplitMix64(h ^ static_cast<uint64_t>(feature));
  return static_cast<double>(h >> 11) * 0x1.0p-52 - 1.0;
}

// Inputs [n x kInputs] and targets [n x 1] of step `step`, in float64 on the
// CPU. Target: a smooth nonlinear function of the inputs plus small noise.
void MakeBatch(uint64_t seed, int64_t step, int64_t n, torch::Tensor* x, torch::Tensor* y) {
  *x = torch::empty({n, kInputs}, torch::kFloat64);
  *y = torch::empty({n, 1}, torch::kFloat64);
  double* xd = x->data_ptr<double>();
  double* yd = y->data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    double dot = 0;
    for (int64_t j = 0; j < kInputs; ++j) {
      const double v = Uniform(seed, step, i, j);
      xd[i * kInputs + j] = v;
      dot += Uniform(seed, -1, 0, j) * v;  // fixed projection (step -1 is never a real step)
    }
    yd[i] = std::sin(2.0 * dot) + 0.05 * Uniform(seed, step, i, kInputs);
  }
}

std::string Json(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

double Mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

std::string MibText(int64_t bytes) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", Mib(bytes));
  return buf;
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const std::string& name, torch::nn::Module& model, double lr) {
  if (name == "sgd")
    return std::make_unique<torch::optim::SGD>(model.parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
  if (name == "adamw")
    return std::make_unique<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(lr).weight_decay(0.01));
  return std::make_unique<torch::optim::Adam>(model.parameters(), torch::optim::AdamOptions(lr));
}

std::vector<double> FlatParameters(torch::nn::Module& model) {
  std::vector<double> out;
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    torch::Tensor p = item.value().detach().to(torch::kCPU, torch::kFloat64).contiguous();
    const double* d = p.data_ptr<double>();
    out.insert(out.end(), d, d + p.numel());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 20, global_batch = 512, micro_batch = 0, ckpt_every = 0, squeeze_step = -1, lr_step = 5;
  int hidden = 256, grow_after = 10, keep = 3;
  uint64_t seed = 1;
  double budget_mib = 0, lr = 1e-3, squeeze_mib = 0;
  std::string device_name = "cpu", optimizer_name = "adam", dump_params, check_against, ckpt_dir;
  bool resume = false, json = false, quiet = false, plain = false;

  CLI::App app{"Train a small libtorch MLP (float64) through oomguard::torch::TrainStep."};
  app.add_option("--steps", steps, "optimizer steps")->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--global-batch", global_batch, "samples per optimizer step")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  app.add_option("--micro-batch", micro_batch, "starting micro-batch size (0: the whole batch)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  app.add_option("--grow-after", grow_after, "clean steps before probing a larger micro-batch (0: never)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--hidden", hidden, "hidden units per layer")->check(CLI::Range(1, 1 << 16));
  app.add_option("--seed", seed, "data and initialisation seed");
  app.add_option("--optimizer", optimizer_name, "adam, adamw (weight decay 0.01) or sgd (momentum 0.9)")
      ->check(CLI::IsMember({"adam", "adamw", "sgd"}));
  app.add_option("--lr", lr, "learning rate")->check(CLI::PositiveNumber);
  app.add_option("--lr-step", lr_step, "StepLR: the learning rate halves every N steps")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--device", device_name, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--budget-mib", budget_mib,
                 "memory budget in MiB (0: none). CPU: a byte budget on torch's CPU allocator; CUDA: a "
                 "memory fraction of torch's caching allocator")
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--squeeze-mib", squeeze_mib,
                 "memory held beside training during the first attempt of --squeeze-step (a neighbour's)")
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--squeeze-step", squeeze_step, "the step whose first attempt --squeeze-mib squeezes")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--ckpt-dir", ckpt_dir, "write checkpoints to this directory (none: rollbacks from memory)");
  app.add_option("--ckpt-every", ckpt_every, "save after every N steps (0: only after a recovered OOM)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--keep", keep, "complete checkpoints kept (0: all)")->check(CLI::Range(0, 1 << 20));
  app.add_flag("--resume", resume, "continue from the newest complete checkpoint in --ckpt-dir");
  app.add_flag("--plain", plain, "the plain libtorch loop, without oomguard (the reference)");
  app.add_option("--dump-params", dump_params,
                 "write the final parameters (named_parameters order, little-endian float64)");
  app.add_option("--check-against", check_against,
                 "compare the final parameters with a --dump-params file (1e-10 relative)");
  app.add_flag("--json", json, "end with one JSON line of results");
  app.add_flag("--quiet", quiet, "no progress lines");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  if (resume && ckpt_dir.empty()) {
    std::fprintf(stderr, "libtorch_train: --resume needs --ckpt-dir\n");
    return 2;
  }
  if (plain && (resume || !ckpt_dir.empty() || squeeze_mib > 0)) {
    std::fprintf(stderr, "libtorch_train: --plain takes no --ckpt-dir, --resume or --squeeze-mib\n");
    return 2;
  }

  // ---- the device and its memory limit ----
  const bool cuda = device_name == "cuda";
  const int64_t budget_bytes = static_cast<int64_t>(budget_mib * 1024.0 * 1024.0);
  std::unique_ptr<oomguard::Device> sdk_device;  // memory figures for incidents (CUDA only)
  auto& cpu_budget = oomguard::torch::BudgetCpuAllocator::Instance();
  if (cuda) {
#ifdef OOMGUARD_EXAMPLE_TORCH_CUDA
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "libtorch_train: --device cuda: no GPU is visible to libtorch\n");
      return 2;
    }
    // The SDK's CudaDevice gives incidents the device's figures and the total
    // memory for the fraction below. It is asked rather than the CUDA runtime
    // directly: a pip libtorch brings its own libcudart, and this file should
    // not bind to one of two runtimes by link order.
    auto d = oomguard::MakeCudaDevice(0);
    if (d.ok()) sdk_device = std::move(d).value();
    if (budget_bytes > 0) {
      if (sdk_device == nullptr) {
        std::fprintf(stderr, "libtorch_train: --budget-mib on CUDA needs oomguard built with CUDA: %s\n",
                     d.status().ToString().c_str());
        return 2;
      }
      const int64_t total = sdk_device->Stats().total;
      // torch's caching allocator refuses to reserve beyond this fraction and
      // raises its own OutOfMemoryError: real CUDA OOMs at a chosen size.
      const double fraction = std::min(1.0, static_cast<double>(budget_bytes) / static_cast<double>(total));
      c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, /*device=*/0);
    }
#else
    std::fprintf(stderr, "libtorch_train: --device cuda: this libtorch was built without CUDA\n");
    return 2;
#endif
  } else {
    // Before the model is built, so parameters, gradients, optimizer state and
    // activations all count against the budget. 0 only counts (for the peak).
    cpu_budget.Install(budget_bytes);
  }
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);

  // ---- model, optimizer, schedule ----
  torch::manual_seed(seed);
  torch::nn::Sequential model(torch::nn::Linear(kInputs, hidden), torch::nn::Tanh(), torch::nn::Linear(hidden, hidden),
                              torch::nn::Tanh(), torch::nn::Linear(hidden, 1));
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  try {
    // Initialised on the CPU in float32 from the seed, then converted, so a CPU
    // and a CUDA run start from the same parameters.
    model->to(device, torch::kFloat64);
    optimizer = MakeOptimizer(optimizer_name, *model, lr);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "libtorch_train: the model does not fit: %s\n", e.what_without_backtrace());
    return 1;
  }
  torch::optim::StepLR scheduler(*optimizer, lr_step, /*gamma=*/0.5);
  auto batch = [&](int64_t s) {
    torch::Tensor x_cpu, y_cpu;
    MakeBatch(seed, s, global_batch, &x_cpu, &y_cpu);
    return std::make_pair(x_cpu.to(device), y_cpu.to(device));
  };

  const bool talk = !quiet && !json;
  double loss_first = NAN, loss_last = NAN;
  int64_t ooms = 0, rollbacks = 0, initial_micro = global_batch, final_micro = global_batch, ckpt_written = 0;
  int64_t resumed_from = -1;
  int rc = 0;
  const auto t0 = std::chrono::steady_clock::now();
  if (plain) {
    // ---- the plain loop: what the guarded one must equal ----
    try {
      for (int64_t s = 0; s < steps; ++s) {
        auto [x, y] = batch(s);
        optimizer->zero_grad();
        torch::Tensor loss = torch::nn::functional::mse_loss(model->forward(x), y);
        loss.backward();
        optimizer->step();
        scheduler.step();
        loss_last = loss.item<double>();
        if (s == 0) loss_first = loss_last;
      }
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "libtorch_train: %s\n", e.what_without_backtrace());
      rc = 1;
    }
  } else {
    // ---- the guarded loop ----
    oomguard::torch::TrainOptions options;
    options.scheduler = &scheduler;
    options.guard.initial_micro_batch = micro_batch;
    options.guard.grow_after = grow_after;
    options.guard.device = sdk_device.get();
    options.guard.workload = "libtorch_train-mlp" + std::to_string(kInputs) + "x" + std::to_string(hidden) + "-" +
                             optimizer_name + "-float64-" + device_name + "-b" + std::to_string(global_batch);
    options.checkpoint.dir = ckpt_dir;  // empty: in memory only, enough to roll back
    options.checkpoint.every_steps = ckpt_every;
    options.checkpoint.keep = keep;
    auto train_or = oomguard::torch::TrainStep::Create(*model, *optimizer, options);
    if (!train_or.ok()) {
      std::fprintf(stderr, "libtorch_train: %s\n", train_or.status().ToString().c_str());
      return 2;
    }
    oomguard::torch::TrainStep& train = **train_or;
    if (resume) {
      if (oomguard::Status s = train.Resume(); !s.ok()) {
        std::fprintf(stderr, "libtorch_train: --resume: %s\n", s.ToString().c_str());
        return 1;
      }
      if (train.step() > 0) resumed_from = train.step() - 1;
    }
    if (!quiet) {
      std::fprintf(stderr, "libtorch_train: %" PRId64 " steps, global batch %" PRId64 ", hidden %d, %s, %s, %s\n",
                   steps, global_batch, hidden, optimizer_name.c_str(), device_name.c_str(),
                   budget_bytes > 0 ? ("budget " + MibText(budget_bytes)).c_str() : "no budget");
      if (resumed_from >= 0)
        std::fprintf(stderr, "resumed from the checkpoint of step %" PRId64 " in %s\n", resumed_from,
                     ckpt_dir.c_str());
    }
    initial_micro = std::min(train.guard().micro_limit(), global_batch);
    final_micro = initial_micro;
    bool squeezed = false;
    try {
      for (int64_t s = train.step(); s < steps; s = train.step()) {
        auto [x, y] = batch(s);
        torch::Tensor neighbour;  // memory held beside training during this attempt
        if (s == squeeze_step && !squeezed && squeeze_mib > 0) {
          squeezed = true;
          neighbour = torch::empty({static_cast<int64_t>(squeeze_mib * 1024 * 1024)}, torch::dtype(torch::kUInt8).device(device));
        }
        oomguard::StepReport report;
        oomguard::Status st = train.Step(global_batch, [&](const oomguard::MicroBatch& mb) {
          return torch::nn::functional::mse_loss(model->forward(x.narrow(0, mb.offset, mb.size)),
                                                 y.narrow(0, mb.offset, mb.size));
        }, &report);
        neighbour = torch::Tensor();
        ooms += report.ooms;
        if (!quiet) {
          for (const auto& inc : report.incidents) {
            std::fprintf(stderr,
                         "  step %" PRId64 ": OOM in %s (%s, %s) -> micro-batch %" PRId64 " -> %" PRId64
                         " [%s], %s\n",
                         inc.step, oomguard::PhaseName(inc.phase).data(), inc.exception_type.c_str(),
                         oomguard::IncidentKindName(inc.kind).data(), inc.micro_before, inc.micro_after,
                         oomguard::LadderActionName(inc.action).data(),
                         oomguard::IncidentOutcomeName(inc.outcome).data());
          }
        }
        if (st.code() == oomguard::StatusCode::kAborted) {  // rolled back: continue from train.step()
          ++rollbacks;
          continue;
        }
        if (!st.ok()) {
          std::fprintf(stderr, "libtorch_train: training stopped at step %" PRId64 ": %s\n", s, st.ToString().c_str());
          rc = 1;
          break;
        }
        if (s == 0 || std::isnan(loss_first)) loss_first = train.loss();
        loss_last = train.loss();
        final_micro = report.largest_micro;
        if (talk && ((s + 1) % std::max<int64_t>(1, steps / 10) == 0 || s + 1 == steps))
          std::printf("step %" PRId64 "/%" PRId64 "  loss %.6f  micro-batch %" PRId64 " x %d\n", s + 1, steps,
                      train.loss(), report.largest_micro, report.micro_batches);
      }
    } catch (const c10::Error& e) {
      // Not an OOM (the guard passes other errors through unchanged), or an OOM
      // outside the guarded step (building the step's batch).
      std::fprintf(stderr, "libtorch_train: %s\n", e.what_without_backtrace());
      rc = 1;
    }
    // The last save must be durable before success is reported.
    oomguard::StatusOr<int64_t> last = train.Finish();
    if (!last.ok()) {
      std::fprintf(stderr, "libtorch_train: checkpoint: %s\n", last.status().ToString().c_str());
      if (rc == 0) rc = 1;
    }
    ckpt_written = train.checkpointer().Stats().checkpoints_written;
  }
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rc != 0) return rc;

  // Reading back parameters allocates (conversions): lift the budget first.
  const int64_t peak_bytes = cpu_budget.peak();
  if (!cuda) cpu_budget.set_budget(0);
  const std::vector<double> params = FlatParameters(*model);
  double rel = -1;
  if (int rc = mlp::DumpAndCheckParameters("libtorch_train", params, dump_params, check_against,
                                           quiet ? nullptr : stderr, &rel);
      rc != 0)
    return rc;

  if (!quiet)
    std::fprintf(stderr,
                 "done: %" PRId64 " OOMs recovered, %" PRId64 " rollbacks, micro-batch %" PRId64 " -> %" PRId64
                 ", loss %.6f -> %.6f, %.2f s%s\n",
                 ooms, rollbacks, initial_micro, final_micro, loss_first, loss_last, wall_s,
                 cuda ? "" : (", CPU peak " + MibText(peak_bytes)).c_str());
  if (json) {
    std::printf("{\"steps\":%" PRId64 ",\"global_batch\":%" PRId64 ",\"initial_micro_batch\":%" PRId64
                ",\"final_micro_batch\":%" PRId64 ",\"ooms\":%" PRId64
                ",\"loss_first\":%s,\"loss_last\":%s,\"wall_s\":%s,\"device\":\"%s\",\"budget_mib\":%s,"
                "\"cpu_peak_mib\":%s,\"hidden\":%d,\"parameters\":%zu,\"max_rel_diff\":%s,"
                "\"checkpoints_written\":%" PRId64 ",\"resumed_from_step\":%s,\"rollbacks\":%" PRId64
                ",\"optimizer\":\"%s\",\"lr\":%s,\"plain\":%s}\n",
                steps, global_batch, initial_micro, final_micro, ooms, Json(loss_first).c_str(),
                Json(loss_last).c_str(), Json(wall_s).c_str(), device_name.c_str(), Json(budget_mib).c_str(),
                cuda ? "null" : Json(Mib(peak_bytes)).c_str(), hidden, params.size(),
                rel < 0 ? "null" : Json(rel).c_str(), ckpt_written,
                resumed_from < 0 ? "null" : std::to_string(resumed_from).c_str(), rollbacks,
                optimizer_name.c_str(), Json(optimizer->param_groups()[0].options().get_lr()).c_str(),
                plain ? "true" : "false");
  }
  std::fflush(stdout);
  return rel > 1e-10 ? 3 : 0;
}
