// c10::OutOfMemoryError and c10::Error classification (see torch_oom.h).
//
// Only <c10/util/Exception.h> is included: the whole of torch.h would make
// this file the slowest in the build for two catch clauses.

#include "sdk/memory/torch_oom.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <string>
#include <string_view>

namespace oomguard::internal {
namespace {

bool ContainsNoCase(std::string_view haystack, std::string_view needle) {
  if (needle.size() > haystack.size()) return false;
  for (size_t i = 0; i + needle.size() <= haystack.size(); ++i) {
    size_t j = 0;
    while (j < needle.size() && std::tolower(static_cast<unsigned char>(haystack[i + j])) ==
                                    std::tolower(static_cast<unsigned char>(needle[j]))) {
      ++j;
    }
    if (j == needle.size()) return true;
  }
  return false;
}

}  // namespace

std::optional<OomInfo> ClassifyTorchException(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::OutOfMemoryError& err) {
    // The type settles that it is an OOM; the message still carries the size
    // and says whether the CPU allocator or the CUDA caching allocator failed.
    const std::string message = err.what_without_backtrace();
    OomInfo info = ClassifyMessage(message);
    const bool host = ContainsNoCase(message, "DefaultCPUAllocator") ||
                      (info.kind == OomKind::kHost && !ContainsNoCase(message, "CUDA"));
    info.kind = host ? OomKind::kHost : OomKind::kDevice;
    info.exception_type = "c10::OutOfMemoryError";
    info.message = message;
    info.matched_by = "type";
    return info;
  } catch (const c10::Error& err) {
    // Older PyTorch and many extensions raise a plain c10::Error for an OOM
    // ("CUDA out of memory", "DefaultCPUAllocator: can't allocate memory").
    const std::string message = err.what_without_backtrace();
    OomInfo info = ClassifyMessage(message);
    if (!info.is_oom()) return std::nullopt;
    info.exception_type = "c10::Error";
    info.message = message;
    return info;
  } catch (...) {
    return std::nullopt;
  }
}

namespace {

// Registered when the library holding this file is loaded.
const bool kRegistered = [] {
  RegisterOomTranslator("c10", ClassifyTorchException);
  return true;
}();

}  // namespace
}  // namespace oomguard::internal
