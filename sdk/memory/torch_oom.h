// Recognising libtorch's exceptions (c10::Error and c10::OutOfMemoryError).
//
// Private to sdk/memory: oom_classify.cc calls this before its generic
// std::exception fallback, because c10::Error derives from std::exception and
// its what() carries a backtrace that would pollute message matching.
// Compiled only when OOMGUARD_WITH_TORCH is defined (libc10 is linked).
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
