// TrainStep (oomguard/torch.h): one owner for the guard, the checkpointer and
// the hooks of a guarded libtorch step.
#include <c10/core/CachingDeviceAllocator.h>
#include <torch/nn/utils/clip_grad.h>

#include <utility>

#include "oomguard/torch.h"

namespace oomguard::torch {

TrainStep::TrainStep(::torch::nn::Module& model, ::torch::optim::Optimizer& optimizer, TrainOptions options)
    : model_(model), optimizer_(optimizer), options_(std::move(options)) {}

TrainStep::~TrainStep() = default;

StatusOr<std::unique_ptr<TrainStep>> TrainStep::Create(::torch::nn::Module& model,
                                                       ::torch::optim::Optimizer& optimizer,
                                                       TrainOptions options) {
  if (options.guard.recovery != nullptr)
    return Status::InvalidArgument(
        "TrainOptions.guard.recovery must be null: TrainStep rolls back through its own checkpointer "
        "(TrainOptions.checkpoint)");
  if (!(options.max_grad_norm >= 0))
    return Status::InvalidArgument("TrainOptions.max_grad_norm must be >= 0 (got " +
                                   std::to_string(options.max_grad_norm) + ")");
  OOMGUARD_RETURN_IF_ERROR(ValidateGuardOptions(options.guard));
  std::unique_ptr<TrainStep> t(new TrainStep(model, optimizer, std::move(options)));
  TrainOptions& o = t->options_;
  if (Coordinator* c = o.guard.coordinator; c != nullptr) {
    o.checkpoint.rank = c->rank();
    o.checkpoint.world_size = c->size();
    t->world_size_ = c->size();
  }
  auto ckpt = Checkpointer::Create(o.checkpoint);
  if (!ckpt.ok()) return ckpt.status();
  t->checkpointer_ = std::move(ckpt).value();
  OOMGUARD_RETURN_IF_ERROR(AddModule(*t->checkpointer_, "model", model));
  OOMGUARD_RETURN_IF_ERROR(AddOptimizer(*t->checkpointer_, "optimizer", optimizer));
  if (o.scheduler != nullptr)
    OOMGUARD_RETURN_IF_ERROR(AddScheduler(*t->checkpointer_, "scheduler", *o.scheduler));
  GuardOptions go = o.guard;
  go.recovery = t->checkpointer_.get();
  auto guard = Guard::Create(go);
  if (!guard.ok()) return guard.status();
  t->guard_ = std::move(guard).value();
  // A retry after an OOM on a GPU must see the blocks torch's caching
  // allocator holds. Asked through c10, so that this library needs no CUDA.
  bool on_cuda = false;
  for (const ::torch::Tensor& p : model.parameters()) on_cuda = on_cuda || p.is_cuda();
  if (on_cuda) {
    t->guard_->AddCacheReleaser("torch.cuda.empty_cache", [] {
      c10::DeviceAllocator* a = c10::getDeviceAllocator(c10::DeviceType::CUDA);
      if (a != nullptr && a->initialized()) a->emptyCache();
    });
  }
  return t;
}

Status TrainStep::Resume() {
  StatusOr<int64_t> restored = guard_->Resume();
  if (restored.ok() || restored.status().code() == StatusCode::kNotFound) return Status::Ok();
  return restored.status();
}

Status TrainStep::Step(int64_t samples, const LossFn& loss, StepReport* report) {
  // Every step starts from zero gradients: the plain loop's zero_grad().
  optimizer_.zero_grad();
  loss_sum_ = ::torch::Tensor();
  StepRequest req;
  req.samples = samples;
  req.micro = [&](const MicroBatch& mb) {
    guard_->MarkPhase(Phase::kForward);
    ::torch::Tensor weighted = loss(mb) * mb.weight;
    guard_->MarkPhase(Phase::kBackward);
    weighted.backward();
    // Only a micro-batch whose backward completed counts.
    ::torch::Tensor done = weighted.detach();
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + done : done;
  };
  req.reset = [&] {
    optimizer_.zero_grad();
    loss_sum_ = ::torch::Tensor();
  };
  if (world_size_ > 1) {
    req.sync = [&] {
      std::vector<SumBuffer> buffers = GradientBuffers(model_);
      loss_host_ = loss_sum_.defined() ? loss_sum_.item<double>() : 0.0;
      buffers.push_back(SumBuffer::Host(&loss_host_, 1));
      return buffers;
    };
  }
  req.apply = [&] {
    if (options_.max_grad_norm > 0)
      ::torch::nn::utils::clip_grad_norm_(model_.parameters(), options_.max_grad_norm);
    optimizer_.step();
    if (options_.scheduler != nullptr) options_.scheduler->step();
  };
  Status s = guard_->Step(req, report);
  if (s.ok()) loss_ = world_size_ > 1 ? loss_host_ : loss_sum_.defined() ? loss_sum_.item<double>() : 0.0;
  return s;
}

StatusOr<int64_t> TrainStep::Finish() { return guard_->Finish(); }

int64_t TrainStep::step() const { return guard_->step(); }

}  // namespace oomguard::torch
