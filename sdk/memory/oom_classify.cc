// Out-of-memory classification (oom.h): by exception type first, then by
// registered translators, then by message.
//
// The message rules (ClassifyMessage) live in oom_message.cc with the parser
// of the figures messages print.
//
// Thread-safety: the translator registry is guarded by a mutex; classification
// copies the registry before calling translators, so a translator may itself
// register or unregister without deadlock.

#include <cxxabi.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>
#include <vector>

#include "oomguard/device.h"
#include "oomguard/oom.h"

#ifdef OOMGUARD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace oomguard {
namespace {

// ---- type names ----

std::string Demangle(const std::type_info& type) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(type.name(), nullptr, nullptr, &status),
                                              std::free);
  return status == 0 && name != nullptr ? std::string(name.get()) : std::string(type.name());
}

// ---- translator registry ----

struct Translators {
  std::mutex mu;
  std::vector<std::pair<std::string, OomTranslator>> list;  // in registration order
};

// Leaked on purpose: classification may run during static destruction (an
// exception in another static's destructor), after a function-local static
// registry would already be gone.
Translators& Registry() {
  static Translators* registry = new Translators;
  return *registry;
}

OomInfo TypeMatch(OomKind kind, std::string type, std::string message, int64_t requested,
                  bool injected = false) {
  OomInfo info;
  info.kind = kind;
  info.exception_type = std::move(type);
  info.message = std::move(message);
  info.requested_bytes = requested;
  info.injected = injected;
  info.matched_by = "type";
  return info;
}

// The types the SDK knows. nullopt: not one of them.
std::optional<OomInfo> ClassifyKnownType(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const DeviceOomError& err) {
    return TypeMatch(OomKind::kDevice, "oomguard::DeviceOomError", err.what(), err.requested_bytes(),
                     err.injected());
  } catch (const HostOomError& err) {
    return TypeMatch(OomKind::kHost, "oomguard::HostOomError", err.what(), err.requested_bytes());
  } catch (const CudaError& err) {
    if (err.code() == kCudaErrorMemoryAllocation) {
      return TypeMatch(OomKind::kDevice, "oomguard::CudaError", err.what(),
                       ClassifyMessage(err.what()).requested_bytes);
    }
    // Not an allocation failure by its code; the message still gets a look
    // (a sticky earlier OOM may be reported under another code's call).
    OomInfo info = ClassifyMessage(err.what());
    info.exception_type = "oomguard::CudaError";
    return info;
  } catch (const WorkspaceAllocError& err) {
    return TypeMatch(OomKind::kWorkspace, "oomguard::WorkspaceAllocError", err.what(),
                     ClassifyMessage(err.what()).requested_bytes);
  } catch (const std::bad_alloc& err) {
    // Also std::bad_array_new_length: a size computation gone wrong surfaces
    // as a host allocation failure, and that is what the guard should see.
    return TypeMatch(OomKind::kHost, "std::bad_alloc", err.what(), 0);
  } catch (...) {
    return std::nullopt;
  }
}

}  // namespace

std::string_view OomKindName(OomKind kind) {
  switch (kind) {
    case OomKind::kNone:
      return "none";
    case OomKind::kDevice:
      return "device";
    case OomKind::kHost:
      return "host";
    case OomKind::kWorkspace:
      return "workspace";
  }
  return "unknown";
}

OomInfo ClassifyException(std::exception_ptr e) {
  if (e == nullptr) {
    OomInfo info;
    info.exception_type = "null";
    return info;
  }
  if (auto known = ClassifyKnownType(e)) return *std::move(known);

  // Translators run inside a catch block, as oom.h promises, so that a plain
  // `throw;` in a translator also works. A translator may also describe an
  // exception it knows is not an OOM (kind kNone with a type): that names
  // types the C++ side cannot see, such as a Python exception on its way back.
  std::optional<OomInfo> described;
  try {
    std::rethrow_exception(e);
  } catch (...) {
    std::vector<std::pair<std::string, OomTranslator>> translators;
    {
      std::lock_guard<std::mutex> lock(Registry().mu);
      translators = Registry().list;
    }
    for (const auto& [name, translate] : translators) {
      std::optional<OomInfo> result;
      try {
        result = translate(e);
      } catch (...) {
        // A translator that throws is treated as "not mine": classification
        // runs on the recovery path and must not replace the user's error.
        continue;
      }
      if (result && result->is_oom()) {
        // A translator that recognised the type says so ("type").
        if (result->matched_by.empty()) result->matched_by = "translator:" + name;
        if (result->exception_type.empty()) result->exception_type = "unknown";
        return *std::move(result);
      }
      if (result && !described && !result->exception_type.empty()) described = std::move(result);
    }
  }

  try {
    std::rethrow_exception(e);
  } catch (const std::exception& err) {
    OomInfo info = ClassifyMessage(err.what());
    info.exception_type = Demangle(typeid(err));
    return info;
  } catch (const char* text) {
    // `throw "out of memory"` happens in older C code bridged into C++.
    OomInfo info = ClassifyMessage(text != nullptr ? text : "");
    info.exception_type = "const char*";
    return info;
  } catch (const std::string& text) {
    OomInfo info = ClassifyMessage(text);
    info.exception_type = "std::string";
    return info;
  } catch (...) {
    if (described) return *std::move(described);
    OomInfo info;
    info.exception_type = "unknown";
    return info;
  }
}

void RegisterOomTranslator(std::string name, OomTranslator translator) {
  Translators& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto& entry : r.list) {
    if (entry.first == name) {
      // Replacing keeps the original position: order is by first registration.
      entry.second = std::move(translator);
      return;
    }
  }
  r.list.emplace_back(std::move(name), std::move(translator));
}

void UnregisterOomTranslator(const std::string& name) {
  Translators& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::erase_if(r.list, [&](const auto& entry) { return entry.first == name; });
}

// ---- error types and the CHECK macros' slow paths ----

CudaError::CudaError(int code, const std::string& what) : std::runtime_error(what), code_(code) {}

WorkspaceAllocError::WorkspaceAllocError(std::string library, const std::string& what)
    : std::runtime_error(what), library_(std::move(library)) {}

namespace {

std::string CudaErrorName(int code) {
#ifdef OOMGUARD_WITH_CUDA
  const auto err = static_cast<cudaError_t>(code);
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
#else
  // The runtime is not linked; these are the codes the SDK meets in practice.
  switch (code) {
    case 1:
      return "cudaErrorInvalidValue: invalid argument";
    case 2:
      return "cudaErrorMemoryAllocation: out of memory";
    case 3:
      return "cudaErrorInitializationError: initialization error";
    case 35:
      return "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA "
             "runtime version";
    case 100:
      return "cudaErrorNoDevice: no CUDA-capable device is detected";
    case 101:
      return "cudaErrorInvalidDevice: invalid device ordinal";
    case 700:
      return "cudaErrorIllegalAddress: an illegal memory access was encountered";
    case 719:
      return "cudaErrorLaunchFailure: unspecified launch failure";
    default:
      return "cudaError " + std::to_string(code);
  }
#endif
}

std::string LibraryStatusName(std::string_view library, int code) {
  if (library == "cublas") {
    switch (code) {
      case 1:
        return "CUBLAS_STATUS_NOT_INITIALIZED";
      case 3:
        return "CUBLAS_STATUS_ALLOC_FAILED";
      case 7:
        return "CUBLAS_STATUS_INVALID_VALUE";
      case 8:
        return "CUBLAS_STATUS_ARCH_MISMATCH";
      case 11:
        return "CUBLAS_STATUS_MAPPING_ERROR";
      case 13:
        return "CUBLAS_STATUS_EXECUTION_FAILED";
      case 14:
        return "CUBLAS_STATUS_INTERNAL_ERROR";
      case 15:
        return "CUBLAS_STATUS_NOT_SUPPORTED";
      default:
        break;
    }
  } else if (library == "cudnn") {
    switch (code) {
      case 1001:
        return "CUDNN_STATUS_NOT_INITIALIZED";
      case 2000:
        return "CUDNN_STATUS_BAD_PARAM";
      case 3000:
        return "CUDNN_STATUS_NOT_SUPPORTED";
      case 4000:
        return "CUDNN_STATUS_INTERNAL_ERROR";
      case 4003:
        return "CUDNN_STATUS_ALLOC_FAILED";
      case 4004:
        return "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED";
      case 5000:
        return "CUDNN_STATUS_EXECUTION_FAILED";
      default:
        break;
    }
  }
  return "status " + std::to_string(code);
}

std::string Where(const char* expr, const char* file, int line) {
  return std::string(" in `") + (expr != nullptr ? expr : "?") + "` at " + (file != nullptr ? file : "?") +
         ":" + std::to_string(line);
}

}  // namespace

void ThrowCudaError(int code, const char* expr, const char* file, int line) {
  throw CudaError(code, "CUDA error " + std::to_string(code) + " (" + CudaErrorName(code) + ")" +
                            Where(expr, file, line));
}

void ThrowLibraryError(const char* library, int code, bool alloc_failed, const char* expr, const char* file,
                       int line) {
  const std::string lib = library != nullptr ? library : "library";
  std::string upper = lib;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (alloc_failed) {
    // The caller's macro decided that this code means "could not allocate";
    // the name says so whatever the library version numbers it.
    throw WorkspaceAllocError(lib, lib + " error " + std::to_string(code) + " (" + upper +
                                       "_STATUS_ALLOC_FAILED: workspace allocation failed)" +
                                       Where(expr, file, line));
  }
  throw std::runtime_error(lib + " error " + std::to_string(code) + " (" + LibraryStatusName(lib, code) +
                           ")" + Where(expr, file, line));
}

}  // namespace oomguard
