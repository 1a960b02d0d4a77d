// Out-of-memory classification (oom.h): by exception type first, then by
// registered translators, then by message.
//
// The message rules recognise the failure wording of PyTorch, the CUDA
// runtime, cuBLAS/cuDNN, TensorFlow/XLA/JAX, Python and the C++ runtime. They
// look for phrases that only appear in failures ("out of memory", "can't
// allocate memory", "OOM when allocating"), never for the word "memory"
// alone, so that a message such as "memory usage is fine" stays kNone.
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

#ifdef OOMGUARD_WITH_TORCH
#include "sdk/memory/torch_oom.h"
#endif
#ifdef OOMGUARD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace oomguard {
namespace {

// ---- text helpers ----

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool Has(std::string_view lower_haystack, std::string_view lower_needle) {
  return lower_haystack.find(lower_needle) != std::string_view::npos;
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// Saturating conversion: a parsed size never overflows int64.
int64_t ToBytes(double value) {
  if (!(value > 0)) return 0;
  if (value >= 9.2e18) return INT64_MAX;
  return static_cast<int64_t>(std::llround(value));
}

// Parses "<number>[ ]<unit>" at `pos` of a lower-cased string. Units: b, byte(s),
// kib/mib/gib/tib (binary) and kb/mb/gb/tb (decimal, as SI defines them), and
// the bare k/m/g/t that XLA prints ("1.20G"), taken as binary. A number with
// no unit is not a size (it could be a count or an index).
std::optional<int64_t> ParseSizeAt(std::string_view s, size_t pos) {
  while (pos < s.size() && IsSpace(s[pos])) ++pos;
  size_t start = pos;
  while (pos < s.size() && (IsDigit(s[pos]) || s[pos] == '.' || s[pos] == ',')) ++pos;
  if (pos == start || !IsDigit(s[start])) return std::nullopt;
  std::string number;
  for (size_t i = start; i < pos; ++i) {
    if (s[i] != ',') number.push_back(s[i]);  // "1,073,741,824 bytes"
  }
  const double value = std::strtod(number.c_str(), nullptr);
  while (pos < s.size() && IsSpace(s[pos])) ++pos;
  size_t unit_start = pos;
  while (pos < s.size() && IsAlpha(s[pos])) ++pos;
  const std::string_view unit = s.substr(unit_start, pos - unit_start);
  struct UnitScale {
    std::string_view name;
    double scale;
  };
  static constexpr UnitScale kUnits[] = {
      {"b", 1.0},
      {"byte", 1.0},
      {"bytes", 1.0},
      {"kib", 1024.0},
      {"mib", 1048576.0},
      {"gib", 1073741824.0},
      {"tib", 1099511627776.0},
      {"kb", 1e3},
      {"mb", 1e6},
      {"gb", 1e9},
      {"tb", 1e12},
      {"k", 1024.0},
      {"m", 1048576.0},
      {"g", 1073741824.0},
      {"t", 1099511627776.0},
  };
  for (const UnitScale& u : kUnits) {
    if (unit == u.name) return ToBytes(value * u.scale);
  }
  return std::nullopt;
}

// "Tried to allocate 20.00 MiB", "you tried to allocate 123 bytes", "you are
// trying to allocate 123456 bytes", "Failed to allocate 1.00GiB (...)",
// "trying to allocate 4294967296 bytes": a size right after "allocate".
std::optional<int64_t> ParseAllocateSize(std::string_view lower) {
  static constexpr std::string_view kKey = "allocate";
  for (size_t at = lower.find(kKey); at != std::string_view::npos; at = lower.find(kKey, at + 1)) {
    if (auto bytes = ParseSizeAt(lower, at + kKey.size())) return bytes;
  }
  return std::nullopt;
}

int64_t DtypeBytes(std::string_view dtype) {
  struct Dtype {
    std::string_view name;
    int64_t bytes;
  };
  static constexpr Dtype kDtypes[] = {
      {"float", 4},    {"float32", 4}, {"double", 8}, {"float64", 8}, {"half", 2},      {"float16", 2},
      {"bfloat16", 2}, {"int64", 8},   {"uint64", 8}, {"int32", 4},   {"uint32", 4},    {"int16", 2},
      {"uint16", 2},   {"int8", 1},    {"uint8", 1},  {"bool", 1},    {"complex64", 8}, {"complex128", 16},
  };
  for (const Dtype& d : kDtypes) {
    if (dtype == d.name) return d.bytes;
  }
  return 0;
}

// TensorFlow: "OOM when allocating tensor with shape[32,1024] and type float".
std::optional<int64_t> ParseTensorFlowShape(std::string_view lower) {
  size_t at = lower.find("shape[");
  if (at == std::string_view::npos) return std::nullopt;
  size_t pos = at + 6;
  const size_t close = lower.find(']', pos);
  if (close == std::string_view::npos) return std::nullopt;
  double elements = 1;
  bool any = false;
  while (pos < close) {
    while (pos < close && (IsSpace(lower[pos]) || lower[pos] == ',')) ++pos;
    size_t start = pos;
    while (pos < close && IsDigit(lower[pos])) ++pos;
    if (pos == start) {
      if (pos < close) return std::nullopt;  // "?" or a symbolic dimension
      break;
    }
    elements *= std::strtod(std::string(lower.substr(start, pos - start)).c_str(), nullptr);
    any = true;
  }
  if (!any) elements = 1;  // shape[] is a scalar
  static constexpr std::string_view kType = "type ";
  size_t type_at = lower.find(kType, close);
  if (type_at == std::string_view::npos) return std::nullopt;
  size_t tpos = type_at + kType.size();
  size_t tend = tpos;
  while (tend < lower.size() && (IsAlpha(lower[tend]) || IsDigit(lower[tend]))) ++tend;
  const int64_t dtype_bytes = DtypeBytes(lower.substr(tpos, tend - tpos));
  if (dtype_bytes == 0) return std::nullopt;
  return ToBytes(elements * static_cast<double>(dtype_bytes));
}

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

OomInfo ClassifyMessage(std::string_view message) {
  OomInfo info;
  info.message = std::string(message);
  const std::string m = Lower(message);

  OomKind kind = OomKind::kNone;
  const bool out_of_memory = Has(m, "out of memory") || Has(m, "out-of-memory");
  const bool alloc_failed = out_of_memory || Has(m, "alloc_failed") || Has(m, "failed to allocate") ||
                            Has(m, "allocation failed") || Has(m, "could not allocate") ||
                            Has(m, "cannot allocate") || Has(m, "can't allocate") ||
                            Has(m, "unable to allocate") || Has(m, "not enough memory");

  if (Has(m, "cublas_status_alloc_failed") || Has(m, "cudnn_status_alloc_failed") ||
      Has(m, "cudnn_status_internal_error_device_allocation_failed") ||
      (Has(m, "workspace") && alloc_failed)) {
    kind = OomKind::kWorkspace;
  } else if (Has(m, "oom when allocating") ||
             (Has(m, "resource_exhausted") && (out_of_memory || Has(m, "oom")))) {
    // TensorFlow/XLA/JAX. TF names the allocator; a CPU one is host memory.
    kind = (Has(m, "device:cpu") || Has(m, "allocator cpu")) ? OomKind::kHost : OomKind::kDevice;
  } else if (Has(m, "cudaerrormemoryallocation") || Has(m, "outofmemoryerror")) {
    kind = (Has(m, "defaultcpuallocator")) ? OomKind::kHost : OomKind::kDevice;
  } else if ((Has(m, "defaultcpuallocator") && alloc_failed) || Has(m, "std::bad_alloc") ||
             Has(m, "cannot allocate memory") || Has(m, "memoryerror") || Has(m, "bad_alloc")) {
    kind = OomKind::kHost;
  } else if (out_of_memory) {
    kind = (Has(m, "cuda") || Has(m, "gpu") || Has(m, "device") || Has(m, "hip") || Has(m, "xpu") ||
            Has(m, "mps"))
               ? OomKind::kDevice
               : OomKind::kHost;
  }
  if (kind == OomKind::kNone) return info;

  info.kind = kind;
  info.matched_by = "message";
  if (auto bytes = ParseAllocateSize(m)) {
    info.requested_bytes = *bytes;
  } else if (auto tensor = ParseTensorFlowShape(m)) {
    info.requested_bytes = *tensor;
  }
  return info;
}

OomInfo ClassifyException(std::exception_ptr e) {
  if (e == nullptr) {
    OomInfo info;
    info.exception_type = "null";
    return info;
  }
  if (auto known = ClassifyKnownType(e)) return *std::move(known);
#ifdef OOMGUARD_WITH_TORCH
  if (auto torch = internal::ClassifyTorchException(e)) return *std::move(torch);
#endif

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
        result->matched_by = "translator:" + name;
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
