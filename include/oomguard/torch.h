// oomguard::torch: libtorch training through the guard, exactly.
//
// Part of liboomguard_torch (CMake: find_package(oomguard COMPONENTS torch),
// target oomguard::torch), built against the libtorch of the build; a program
// that includes this header links the same libtorch. Not in the umbrella
// oomguard.h, which stays free of torch.
//
// TrainStep owns what a guarded libtorch loop otherwise wires by hand: the
// guard, a checkpointer (on disk, or in memory only, which is enough to roll
// back an OOM in the optimizer step), the registration of the model, the
// optimizer and the LR scheduler, the phases, the loss weighting, the reset
// and apply hooks and, with several ranks, the gradient buffers of the sync:
//
//   oomguard::torch::TrainOptions options;
//   options.scheduler = &scheduler;
//   auto train = oomguard::torch::TrainStep::Create(*model, optimizer, options);
//   if (!train.ok()) { std::cerr << train.status() << "\n"; return 1; }
//   if (auto s = (*train)->Resume(); !s.ok()) { ... }          // a checkpoint dir: continue where it stopped
//   for (int64_t step = (*train)->step(); step < steps; step = (*train)->step()) {
//     auto [x, y] = Batch(step);
//     oomguard::Status s = (*train)->Step(x.size(0), [&](const oomguard::MicroBatch& mb) {
//       return mse_loss(model->forward(x.narrow(0, mb.offset, mb.size)), y.narrow(0, mb.offset, mb.size));
//     });
//     if (!s.ok() && s.code() != oomguard::StatusCode::kAborted) { ... }   // kAborted: rolled back
//   }
//
// The helpers below it (AddModule, AddOptimizer, AddScheduler,
// GradientBuffers) are for loops that drive a Guard themselves.
//
// Exactness: a rollback restores the parameters and buffers byte for byte,
// and replaces the optimizer's state (cleared, then loaded: no state of a
// later step survives) and its param-group options (the learning rate among
// them) and the scheduler's step count. Training with OOMs, splits and
// rollbacks then ends with the parameters of the same loop without them
// (float64: within 1e-10 relative), except for what depends on the split
// itself (dropout masks drawn per micro-batch, BatchNorm batch statistics).
//
// Thread-safety: a TrainStep, and the tensors and objects registered, are used
// from the one training thread.
#ifndef OOMGUARD_TORCH_H_
#define OOMGUARD_TORCH_H_

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "oomguard/coordinator.h"
#include "oomguard/export.h"
#include "oomguard/guard.h"
#include "oomguard/options.h"
#include "oomguard/status.h"

namespace oomguard::torch {

// ---- registration with a Checkpointer (before its first save or load) ----

// Registers every parameter and buffer of `module` (recursively) in place,
// as "<prefix>/<name>" with PyTorch's dotted names ("model/fc1.weight"):
// saves copy them, restores write into them. CPU or CUDA tensors (all of one
// checkpointer's CUDA tensors on one device), contiguous, of a dtype the
// checkpoint format knows. A tensor that shares its memory with one already
// registered (tied weights) is registered once. Also registers
// "<prefix>.layout", which fails a save or restore, naming the tensor, when
// a registered tensor no longer holds the memory it was registered with
// (module->to(...) after registration: register after the final .to()).
// kInvalidArgument (non-contiguous, an unknown dtype, on another device) or
// the Checkpointer's error, naming the tensor.
OOMGUARD_EXPORT Status AddModule(Checkpointer& checkpointer, const std::string& prefix,
                                 ::torch::nn::Module& module);

// Registers the optimizer's state and param groups as one object at `path`
// (libtorch's own serialisation of them). A restore clears the state first and
// then loads it: state of a parameter that the checkpoint does not hold (the
// optimizer had not stepped it yet) is gone, as it was at that step, and
// every param group's options (lr, betas, momentum, weight decay, ...) are
// those of the checkpoint. REQUIRES: the optimizer's parameters are the ones
// AddModule registered (the same tensors), and it outlives the checkpointer.
OOMGUARD_EXPORT Status AddOptimizer(Checkpointer& checkpointer, const std::string& path,
                                    ::torch::optim::Optimizer& optimizer);

// Registers an LR scheduler's step count at `path` (the learning rates
// themselves live in the optimizer's param groups, which AddOptimizer saves).
// For the schedulers derived from torch::optim::LRScheduler (StepLR and
// users' own whose state is the step count). REQUIRES: it outlives the
// checkpointer.
OOMGUARD_EXPORT Status AddScheduler(Checkpointer& checkpointer, const std::string& path,
                                    ::torch::optim::LRScheduler& scheduler);

// The gradients of `module`'s parameters that require them, as buffers for
// StepRequest::sync (the guard sums them over ranks after its vote). A
// gradient that is not defined yet (zero_grad(set_to_none) or a parameter
// this step did not reach) is allocated as zeros, since every rank must sum
// the same buffers; a non-contiguous one is made contiguous in place. With
// one rank nothing needs summing: StepRequest::sync may stay unset.
// Throws what libtorch throws when an allocation fails (inside sync the guard
// handles the OOM).
OOMGUARD_EXPORT std::vector<SumBuffer> GradientBuffers(::torch::nn::Module& module);

// ---- the guarded training step ----

struct TrainOptions {
  // The guard's options: initial_micro_batch, device, coordinator, incidents,
  // priors, workload, ... `recovery` is TrainStep's own checkpointer (a value
  // here is refused).
  GuardOptions guard;
  // The checkpointer's options. dir empty (the default): in memory only,
  // which keeps the state before the first optimizer step and after every
  // `every_steps` steps (and after a recovered OOM) for rollbacks, and
  // writes nothing. rank and world_size are taken from guard.coordinator.
  CheckpointOptions checkpoint;
  // Stepped after every optimizer step and checkpointed with it; not owned.
  ::torch::optim::LRScheduler* scheduler = nullptr;
  // Clips the global gradient norm to this before every optimizer step
  // (torch::nn::utils::clip_grad_norm_; after the sum over ranks). 0: no clipping.
  double max_grad_norm = 0;
};

class OOMGUARD_EXPORT TrainStep {
 public:
  // The mean loss of micro-batch [mb.offset, mb.offset + mb.size) of the
  // step's batch, as a scalar tensor: TrainStep weighs it by mb.weight, runs
  // its backward and sums the weighted losses into loss(). Run the forward
  // pass inside; select the micro-batch's samples with narrow(0, mb.offset,
  // mb.size) (a view: no copy).
  using LossFn = std::function<::torch::Tensor(const MicroBatch&)>;

  // Creates the checkpointer (options.checkpoint), registers `model` at
  // "model", `optimizer` at "optimizer" and the scheduler at "scheduler", and
  // creates the guard. Register after the model's final .to(): its tensors
  // are checkpointed in place. `model` and `optimizer` (and the scheduler)
  // must outlive the TrainStep. Errors: the options' (kInvalidArgument,
  // naming the field), the registration's (AddModule).
  static StatusOr<std::unique_ptr<TrainStep>> Create(::torch::nn::Module& model,
                                                     ::torch::optim::Optimizer& optimizer,
                                                     TrainOptions options = {});
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // Continues a run from its checkpoints: every rank restores the newest
  // checkpoint that every rank holds, and step() is the step after it. OK
  // also when there is none (step() stays where it was: a fresh start).
  // Errors: kDataLoss (checkpoints exist, none loads), a coordination error.
  // Collective. The one resume idiom: call it once before the loop.
  Status Resume();

  // One optimizer step over this rank's `samples` samples: the gradients are
  // zeroed, each micro-batch's loss is weighed and backpropagated, the
  // gradients (and the loss) are summed over ranks when there are several,
  // clipped when asked, and the optimizer and the scheduler step. Returns
  // OK, kAborted (rolled back: continue from step(), which moved back;
  // report->rolled_back_to says where), or the guard's errors (Guard::Step).
  // An exception of `loss` that is not an OOM passes through unchanged.
  Status Step(int64_t samples, const LossFn& loss, StepReport* report = nullptr);

  // Ends the run: waits for the checkpoint saves in flight and agrees with
  // every rank on the newest complete one (Guard::Finish). Collective.
  StatusOr<int64_t> Finish();

  // The next step to run.
  int64_t step() const;
  // The mean loss over the global batch of the last step that committed (NaN before one did).
  double loss() const { return loss_; }
  Guard& guard() { return *guard_; }
  Checkpointer& checkpointer() { return *checkpointer_; }

 private:
  TrainStep(::torch::nn::Module& model, ::torch::optim::Optimizer& optimizer, TrainOptions options);

  ::torch::nn::Module& model_;
  ::torch::optim::Optimizer& optimizer_;
  TrainOptions options_;
  int world_size_ = 1;
  // Declared before guard_: the guard rolls back through it, so it goes last.
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<Guard> guard_;
  ::torch::Tensor loss_sum_;  // the step's weighted losses so far (undefined: none)
  double loss_host_ = 0;      // what the sync sums (several ranks)
  double loss_ = std::numeric_limits<double>::quiet_NaN();
};

}  // namespace oomguard::torch

#endif  // OOMGUARD_TORCH_H_
