// Recognising libtorch's exceptions (c10::Error and c10::OutOfMemoryError).
//
// The library oomguard::torch (liboomguard_torch, built with
// OOMGUARD_WITH_TORCH) registers it as the OOM translator "c10" when it is
// loaded, so that ClassifyException sees libtorch's types before its generic
// std::exception fallback (c10::Error's what() carries a backtrace that would
// pollute message matching). liboomguard itself never links libtorch: C++
// programs without torch do not need it, and a torch upgrade does not break it.
//
// Thread-safety: stateless; may be called from any thread.
#ifndef OOMGUARD_SDK_MEMORY_TORCH_OOM_H_
#define OOMGUARD_SDK_MEMORY_TORCH_OOM_H_

#include <exception>
#include <optional>

#include "oomguard/oom.h"

namespace oomguard::internal {

// Returns the classification of `e` when it holds a c10::Error whose type or
// message says out of memory; nullopt for any other exception (including a
// c10::Error that is not an OOM, so the caller's later stages may look at it).
// REQUIRES: e != nullptr.
std::optional<OomInfo> ClassifyTorchException(std::exception_ptr e);

}  // namespace oomguard::internal

#endif  // OOMGUARD_SDK_MEMORY_TORCH_OOM_H_
