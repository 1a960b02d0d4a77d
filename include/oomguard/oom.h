// Classifying a caught exception: is it an out-of-memory error, and of which kind?
//
// Order of evidence: the exception's type first (the SDK's own errors,
// std::bad_alloc, CudaError raised by OOMGUARD_CUDA_CHECK, c10::OutOfMemoryError
// when built with torch, then registered translators), the message last.
//
// Thread-safety: ClassifyException may be called from any thread. Translators
// are registered at start-up, before training threads classify; registration
// is itself synchronised.
#ifndef OOMGUARD_OOM_H_
#define OOMGUARD_OOM_H_

#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "oomguard/export.h"
#include "oomguard/oom_error.h"

namespace oomguard {

enum class OomKind {
  kNone,       // not an out-of-memory error
  kDevice,     // device (GPU) memory
  kHost,       // host memory
  kWorkspace,  // a library's scratch space (cuBLAS, cuDNN) could not be allocated
};

OOMGUARD_EXPORT std::string_view OomKindName(OomKind kind);  // "none", "device", ...

struct OomInfo {
  OomKind kind = OomKind::kNone;
  std::string exception_type;  // "oomguard::DeviceOomError", "std::bad_alloc", ...
  std::string message;
  int64_t requested_bytes = 0;  // 0 when unknown
  bool injected = false;        // raised by fault injection
  std::string matched_by;       // "type", "translator:<name>", "message"
  FrameworkEvidence framework;  // what a binding read off the failing frames (unknown by default)

  bool is_oom() const { return kind != OomKind::kNone; }
};

// Classifies the exception held by `e`. REQUIRES: e != nullptr.
OOMGUARD_EXPORT OomInfo ClassifyException(std::exception_ptr e);

// Classifies a free-text error message (used for exceptions of unknown type and
// for incidents imported from other tools). Recognises the messages of PyTorch,
// the CUDA runtime, cuBLAS/cuDNN, TensorFlow/XLA and the C++ runtime. Parses a
// requested size such as "Tried to allocate 2.00 GiB" into requested_bytes.
OOMGUARD_EXPORT OomInfo ClassifyMessage(std::string_view message);

// A translator looks at an exception of a type the SDK does not know and
// returns an OomInfo when it recognises it (nullopt: not mine). An OomInfo of
// kind kNone with exception_type set says "not an OOM, but this is what it is"
// (used only to describe the exception when nothing else recognises it).
// It is called inside a catch block: it may rethrow the current exception
// (`std::rethrow_exception(e)`) inside its own try to inspect the type.
using OomTranslator = std::function<std::optional<OomInfo>(std::exception_ptr)>;

// Registers a translator under `name` (a later registration with the same name
// replaces it). Translators run in registration order, after the built-in types.
OOMGUARD_EXPORT void RegisterOomTranslator(std::string name, OomTranslator translator);
OOMGUARD_EXPORT void UnregisterOomTranslator(const std::string& name);

// A CUDA runtime error raised through OOMGUARD_CUDA_CHECK. `code` is the
// cudaError_t value (2 = cudaErrorMemoryAllocation).
class OOMGUARD_EXPORT CudaError : public std::runtime_error {
 public:
  CudaError(int code, const std::string& what);
  int code() const { return code_; }

 private:
  int code_;
};

// A library error (cuBLAS, cuDNN, ...) whose allocation of scratch space failed,
// raised through OOMGUARD_CUBLAS_CHECK / OOMGUARD_CUDNN_CHECK. Classified as workspace.
class OOMGUARD_EXPORT WorkspaceAllocError : public std::runtime_error {
 public:
  WorkspaceAllocError(std::string library, const std::string& what);
  const std::string& library() const { return library_; }

 private:
  std::string library_;
};

inline constexpr int kCudaErrorMemoryAllocation = 2;   // cudaErrorMemoryAllocation
inline constexpr int kCublasStatusAllocFailed = 3;     // CUBLAS_STATUS_ALLOC_FAILED
inline constexpr int kCudnnStatusAllocFailed = 4003;        // CUDNN_STATUS_ALLOC_FAILED (cuDNN 9, host)
inline constexpr int kCudnnStatusAllocFailedDevice = 4004;  // CUDNN_STATUS_ALLOC_FAILED_DEVICE (cuDNN 9)

// Throws CudaError(code) for a non-zero CUDA runtime status.
[[noreturn]] OOMGUARD_EXPORT void ThrowCudaError(int code, const char* expr, const char* file,
                                                  int line);
[[noreturn]] OOMGUARD_EXPORT void ThrowLibraryError(const char* library, int code, bool alloc_failed,
                                                     const char* expr, const char* file, int line);

}  // namespace oomguard

// Wraps a CUDA runtime call; a failure is thrown as oomguard::CudaError so that
// the guard can classify cudaErrorMemoryAllocation as a device OOM by type.
#define OOMGUARD_CUDA_CHECK(expr)                                                      \
  do {                                                                                 \
    int _og_err = static_cast<int>(expr);                                              \
    if (_og_err != 0) ::oomguard::ThrowCudaError(_og_err, #expr, __FILE__, __LINE__);  \
  } while (0)

// Wraps a cuBLAS call; CUBLAS_STATUS_ALLOC_FAILED becomes a workspace OOM.
#define OOMGUARD_CUBLAS_CHECK(expr)                                                  \
  do {                                                                               \
    int _og_st = static_cast<int>(expr);                                             \
    if (_og_st != 0)                                                                 \
      ::oomguard::ThrowLibraryError("cublas", _og_st,                                \
                                    _og_st == ::oomguard::kCublasStatusAllocFailed,  \
                                    #expr, __FILE__, __LINE__);                      \
  } while (0)

// Wraps a cuDNN call; CUDNN_STATUS_ALLOC_FAILED becomes a workspace OOM.
#define OOMGUARD_CUDNN_CHECK(expr)                                                   \
  do {                                                                               \
    int _og_st = static_cast<int>(expr);                                             \
    if (_og_st != 0)                                                                 \
      ::oomguard::ThrowLibraryError("cudnn", _og_st,                                 \
                                    _og_st == ::oomguard::kCudnnStatusAllocFailed || \
                                        _og_st == ::oomguard::kCudnnStatusAllocFailedDevice, \
                                    #expr, __FILE__, __LINE__);                      \
  } while (0)

#endif  // OOMGUARD_OOM_H_
