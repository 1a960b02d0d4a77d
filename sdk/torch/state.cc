// libtorch state with a Checkpointer, exactly (oomguard/torch.h): a module's
// tensors in place, an optimizer's state and param groups replaced (never
// merged) on restore, an LR scheduler's step count; and the gradient buffers
// of the guard's sync.
#include <c10/core/Storage.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "oomguard/torch.h"

namespace oomguard::torch {
namespace {

std::optional<DType> DTypeOf(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Half:
      return DType::kFloat16;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::Double:
      return DType::kFloat64;
    case c10::ScalarType::Char:
      return DType::kInt8;
    case c10::ScalarType::Short:
      return DType::kInt16;
    case c10::ScalarType::Int:
      return DType::kInt32;
    case c10::ScalarType::Long:
      return DType::kInt64;
    case c10::ScalarType::Byte:
      return DType::kUInt8;
    case c10::ScalarType::UInt16:
      return DType::kUInt16;
    case c10::ScalarType::UInt32:
      return DType::kUInt32;
    case c10::ScalarType::UInt64:
      return DType::kUInt64;
    case c10::ScalarType::Bool:
      return DType::kBool;
    default:
      return std::nullopt;
  }
}

std::string ShapeText(const ::torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i > 0 ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

// One tensor registered in place. `storage` keeps the memory it was
// registered with alive: module->to() after registration swaps the tensor's
// storage (the same TensorImpl, new memory), and the checkpointer must never
// write into memory that was freed.
struct Registered {
  std::string path;
  ::torch::Tensor tensor;
  c10::Storage storage;
  void* data = nullptr;
};

// The registered tensors of one module, and the check that they still hold
// the memory they were registered with.
struct ModuleRegistration {
  std::vector<Registered> tensors;
  std::string layout;  // "path dtype shape" per line, as registered

  // The first tensor that no longer holds its registered memory, or "".
  std::string Moved() const {
    for (const Registered& r : tensors)
      if (r.tensor.data_ptr() != r.data) return r.path;
    return "";
  }
  std::string MovedMessage(const std::string& path) const {
    return path +
           " no longer holds the memory it was registered with (the module was moved or converted, "
           "e.g. module->to(...), after AddModule): register after the model's final .to()";
  }
};

// LRScheduler keeps its step count protected, and it is the scheduler's
// whole state: reached through a pointer to member named through a derived
// class (which is allowed) and applied to any scheduler.
struct SchedulerState : ::torch::optim::LRScheduler {
  static unsigned& StepCount(::torch::optim::LRScheduler& s) { return s.*(&SchedulerState::step_count_); }
};

}  // namespace

Status AddModule(Checkpointer& checkpointer, const std::string& prefix, ::torch::nn::Module& module) {
  auto reg = std::make_shared<ModuleRegistration>();
  std::map<const void*, std::string> seen;  // memory registered so far -> its path
  std::vector<std::pair<std::string, ::torch::Tensor>> all;
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    all.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) all.emplace_back(item.key(), item.value());
  for (auto& [name, t] : all) {
    const std::string path = prefix + "/" + name;
    if (!t.defined()) continue;  // an optional buffer that is not there
    std::optional<DType> dtype = DTypeOf(t.scalar_type());
    if (!dtype)
      return Status::InvalidArgument("AddModule: " + path + " has dtype " +
                                     std::string(c10::toString(t.scalar_type())) +
                                     ", which checkpoints do not hold");
    if (!t.is_contiguous())
      return Status::InvalidArgument("AddModule: " + path + " is not contiguous (shape " + ShapeText(t) +
                                     "): it is checkpointed in place, so it must be one run of memory");
    if (!t.device().is_cpu() && !t.device().is_cuda())
      return Status::InvalidArgument("AddModule: " + path + " is on " + t.device().str() +
                                     " (CPU and CUDA tensors only)");
    void* data = t.numel() > 0 ? t.data_ptr() : nullptr;
    // Tied weights (one memory, two names): one registration restores both.
    if (data != nullptr && !seen.emplace(data, path).second) continue;
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    Status s = checkpointer.AddTensor(path, *dtype, shape, data,
                                      t.is_cuda() ? MemoryLocation::kCuda : MemoryLocation::kHost);
    if (!s.ok()) return Status(s.code(), "AddModule: " + s.message());
    reg->tensors.push_back({path, t, t.storage(), data});
    reg->layout += path + " " + std::string(DTypeName(*dtype)) + " " + ShapeText(t) + "\n";
  }
  return checkpointer.AddObject(
      prefix + ".layout",
      [reg] {
        // Runs before the tensors are staged: a moved tensor fails the save
        // before anything stale is copied.
        if (std::string moved = reg->Moved(); !moved.empty())
          throw std::runtime_error(reg->MovedMessage(moved));
        return std::vector<uint8_t>(reg->layout.begin(), reg->layout.end());
      },
      [reg](std::span<const uint8_t> bytes) -> Status {
        if (std::string moved = reg->Moved(); !moved.empty())
          return Status::FailedPrecondition(reg->MovedMessage(moved) +
                                            " (the restore wrote into the memory it was "
                                            "registered with, not the module's)");
        const std::string saved(bytes.begin(), bytes.end());
        if (saved != reg->layout)
          return Status::DataLoss("the checkpoint's module layout differs from this module's: saved\n" +
                                  saved + "this module\n" + reg->layout);
        return Status::Ok();
      });
}

Status AddOptimizer(Checkpointer& checkpointer, const std::string& path,
                    ::torch::optim::Optimizer& optimizer) {
  return checkpointer.AddObject(
      path,
      [&optimizer] {
        ::torch::serialize::OutputArchive archive;
        optimizer.save(archive);
        std::ostringstream os;
        archive.save_to(os);
        const std::string bytes = os.str();
        return std::vector<uint8_t>(bytes.begin(), bytes.end());
      },
      [&optimizer, path](std::span<const uint8_t> bytes) -> Status {
        try {
          // Replaced, never merged: libtorch's load keeps the live state of
          // every parameter the archive holds none for (a parameter not yet
          // stepped at the checkpoint's step), which a rollback must drop.
          // Cleared first, so that the old state's memory is free before the
          // loaded state is allocated (a rollback after an OOM has little).
          optimizer.state().clear();
          std::istringstream is(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
          ::torch::serialize::InputArchive archive;
          archive.load_from(is);
          optimizer.load(archive);  // the state, and every param group's options (lr, ...)
          return Status::Ok();
        } catch (const c10::Error& e) {
          return Status::DataLoss("optimizer state at " + path + ": " + e.what_without_backtrace());
        } catch (const std::exception& e) {
          return Status::DataLoss("optimizer state at " + path + ": " + e.what());
        }
      });
}

Status AddScheduler(Checkpointer& checkpointer, const std::string& path,
                    ::torch::optim::LRScheduler& scheduler) {
  return checkpointer.AddObject(
      path,
      [&scheduler] {
        const uint64_t count = SchedulerState::StepCount(scheduler);
        std::vector<uint8_t> b(sizeof(count));
        std::memcpy(b.data(), &count, sizeof(count));
        return b;
      },
      [&scheduler, path](std::span<const uint8_t> bytes) -> Status {
        uint64_t count = 0;
        if (bytes.size() != sizeof(count))
          return Status::DataLoss("scheduler state at " + path + " has " + std::to_string(bytes.size()) +
                                  " bytes, not " + std::to_string(sizeof(count)));
        std::memcpy(&count, bytes.data(), sizeof(count));
        SchedulerState::StepCount(scheduler) = static_cast<unsigned>(count);
        return Status::Ok();
      });
}

std::vector<SumBuffer> GradientBuffers(::torch::nn::Module& module) {
  std::vector<SumBuffer> out;
  for (::torch::Tensor& p : module.parameters(/*recurse=*/true)) {
    if (!p.requires_grad()) continue;
    ::torch::Tensor& g = p.mutable_grad();
    if (!g.defined()) {
      g = ::torch::zeros_like(p, ::torch::MemoryFormat::Contiguous);
    } else if (!g.is_contiguous()) {
      g = g.contiguous();
    }
    std::optional<DType> dtype = DTypeOf(g.scalar_type());
    if (!dtype)
      throw std::invalid_argument("GradientBuffers: a gradient of dtype " +
                                  std::string(c10::toString(g.scalar_type())) + " cannot be summed");
    SumBuffer b;
    b.data = g.data_ptr();
    b.count = g.numel();
    b.dtype = *dtype;
    b.device = g.is_cuda() ? g.get_device() : -1;
    out.push_back(b);
  }
  return out;
}

}  // namespace oomguard::torch
