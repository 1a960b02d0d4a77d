#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "oomguard/device.h"
#include "oomguard/faults.h"
#include "oomguard/oom.h"

#ifdef OOMGUARD_WITH_TORCH
#include <c10/util/Exception.h>
#endif

namespace oomguard {
namespace {

constexpr int64_t kMiB = 1024 * 1024;
constexpr int64_t kGiB = 1024 * kMiB;

template <typename E>
OomInfo ClassifyThrown(E e) {
  try {
    throw e;
  } catch (...) {
    return ClassifyException(std::current_exception());
  }
}

TEST(OomKindNameTest, NamesEveryKind) {
  EXPECT_EQ(OomKindName(OomKind::kNone), "none");
  EXPECT_EQ(OomKindName(OomKind::kDevice), "device");
  EXPECT_EQ(OomKindName(OomKind::kHost), "host");
  EXPECT_EQ(OomKindName(OomKind::kWorkspace), "workspace");
}

TEST(ClassifyExceptionTest, DeviceOomErrorByType) {
  MemoryStats stats;
  stats.allocated = 7;
  // The message deliberately says nothing about memory: the type decides.
  OomInfo info = ClassifyThrown(DeviceOomError("boom", 4096, stats, /*injected=*/true));
  EXPECT_EQ(info.kind, OomKind::kDevice);
  EXPECT_TRUE(info.is_oom());
  EXPECT_EQ(info.exception_type, "oomguard::DeviceOomError");
  EXPECT_EQ(info.message, "boom");
  EXPECT_EQ(info.requested_bytes, 4096);
  EXPECT_TRUE(info.injected);
  EXPECT_EQ(info.matched_by, "type");
}

// What fault injection raises is classified as the guard needs: an injected
// OOM by type and marked injected, an injected error as no OOM at all.
TEST(ClassifyExceptionTest, InjectedFaultsByType) {
  ASSERT_TRUE(SetFaultRules("oom@site=forward,bytes=4096;error@site=sync").ok());
  FaultContext ctx;
  ctx.step = 0;
  try {
    FaultPoint(FaultSite::kForward, ctx);
    ADD_FAILURE() << "no fault at forward";
  } catch (...) {
    OomInfo info = ClassifyException(std::current_exception());
    EXPECT_EQ(info.kind, OomKind::kDevice);
    EXPECT_TRUE(info.injected);
    EXPECT_EQ(info.requested_bytes, 4096);
  }
  try {
    FaultPoint(FaultSite::kSync, ctx);
    ADD_FAILURE() << "no fault at sync";
  } catch (...) {
    EXPECT_EQ(ClassifyException(std::current_exception()).kind, OomKind::kNone);
  }
  ClearFaultRules();
}

TEST(ClassifyExceptionTest, HostOomErrorByTypeBeforeBadAlloc) {
  OomInfo info = ClassifyThrown(HostOomError("pinned staging buffer", 1234));
  EXPECT_EQ(info.kind, OomKind::kHost);
  EXPECT_EQ(info.exception_type, "oomguard::HostOomError");
  EXPECT_EQ(info.message, "pinned staging buffer");
  EXPECT_EQ(info.requested_bytes, 1234);
  EXPECT_FALSE(info.injected);
  EXPECT_EQ(info.matched_by, "type");
}

TEST(ClassifyExceptionTest, BadAllocIsHost) {
  OomInfo info = ClassifyThrown(std::bad_alloc());
  EXPECT_EQ(info.kind, OomKind::kHost);
  EXPECT_EQ(info.exception_type, "std::bad_alloc");
  EXPECT_EQ(info.matched_by, "type");

  info = ClassifyThrown(std::bad_array_new_length());
  EXPECT_EQ(info.kind, OomKind::kHost);
  EXPECT_EQ(info.exception_type, "std::bad_alloc");
}

TEST(ClassifyExceptionTest, CudaCheckOfMemoryAllocationIsDevice) {
  OomInfo info;
  try {
    OOMGUARD_CUDA_CHECK(kCudaErrorMemoryAllocation);
    FAIL() << "OOMGUARD_CUDA_CHECK(2) did not throw";
  } catch (const CudaError& e) {
    EXPECT_EQ(e.code(), 2);
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaErrorMemoryAllocation"), std::string::npos) << what;
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find("kCudaErrorMemoryAllocation"), std::string::npos) << what;  // expr
    EXPECT_NE(what.find("oom_classify_test.cc:"), std::string::npos) << what;       // file:line
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kDevice);
  EXPECT_EQ(info.exception_type, "oomguard::CudaError");
  EXPECT_EQ(info.matched_by, "type");
}

TEST(ClassifyExceptionTest, OtherCudaErrorsAreNotOom) {
  OomInfo info;
  try {
    OOMGUARD_CUDA_CHECK(700);  // cudaErrorIllegalAddress
  } catch (...) {
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kNone);
  EXPECT_EQ(info.exception_type, "oomguard::CudaError");
  EXPECT_NO_THROW(OOMGUARD_CUDA_CHECK(0));
}

TEST(ClassifyExceptionTest, CudaErrorWithOtherCodeStillChecksMessage) {
  OomInfo info = ClassifyThrown(CudaError(999, "cudaErrorUnknown after CUDA out of memory"));
  EXPECT_EQ(info.kind, OomKind::kDevice);
  EXPECT_EQ(info.matched_by, "message");
}

TEST(ClassifyExceptionTest, CublasAndCudnnAllocFailuresAreWorkspace) {
  OomInfo info;
  try {
    OOMGUARD_CUBLAS_CHECK(kCublasStatusAllocFailed);
    FAIL() << "no throw";
  } catch (const WorkspaceAllocError& e) {
    EXPECT_EQ(e.library(), "cublas");
    EXPECT_NE(std::string(e.what()).find("CUBLAS_STATUS_ALLOC_FAILED"), std::string::npos);
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kWorkspace);
  EXPECT_EQ(info.exception_type, "oomguard::WorkspaceAllocError");
  EXPECT_EQ(info.matched_by, "type");

  try {
    OOMGUARD_CUDNN_CHECK(kCudnnStatusAllocFailed);
    FAIL() << "no throw";
  } catch (const WorkspaceAllocError& e) {
    EXPECT_EQ(e.library(), "cudnn");
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kWorkspace);
}

TEST(ClassifyExceptionTest, OtherLibraryErrorsAreNotOom) {
  OomInfo info;
  try {
    OOMGUARD_CUBLAS_CHECK(7);  // CUBLAS_STATUS_INVALID_VALUE
    FAIL() << "no throw";
  } catch (const WorkspaceAllocError&) {
    FAIL() << "an invalid value is not a workspace failure";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("CUBLAS_STATUS_INVALID_VALUE"), std::string::npos);
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kNone);
  EXPECT_NO_THROW(OOMGUARD_CUDNN_CHECK(0));
}

TEST(ClassifyExceptionTest, StdExceptionFallsBackToMessage) {
  OomInfo info = ClassifyThrown(std::runtime_error(
      "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)"));
  EXPECT_EQ(info.kind, OomKind::kDevice);
  EXPECT_EQ(info.exception_type, "std::runtime_error");
  EXPECT_EQ(info.matched_by, "message");
  EXPECT_EQ(info.requested_bytes, 20 * kMiB);

  info = ClassifyThrown(std::logic_error("index out of range"));
  EXPECT_EQ(info.kind, OomKind::kNone);
  EXPECT_EQ(info.exception_type, "std::logic_error");
  EXPECT_EQ(info.matched_by, "");
}

TEST(ClassifyExceptionTest, NonStdExceptionIsUnknown) {
  OomInfo info = ClassifyThrown(42);
  EXPECT_EQ(info.kind, OomKind::kNone);
  EXPECT_EQ(info.exception_type, "unknown");
  struct Opaque {};
  info = ClassifyThrown(Opaque{});
  EXPECT_EQ(info.kind, OomKind::kNone);
  EXPECT_EQ(info.exception_type, "unknown");
}

// A type the SDK knows nothing about, as a framework's binding would throw.
struct FrameworkOom {
  int64_t bytes;
};

class TranslatorTest : public ::testing::Test {
 protected:
  void TearDown() override {
    UnregisterOomTranslator("framework");
    UnregisterOomTranslator("second");
    UnregisterOomTranslator("thrower");
  }
};

TEST_F(TranslatorTest, RegisteredTranslatorRecognisesForeignType) {
  EXPECT_EQ(ClassifyThrown(FrameworkOom{99}).kind, OomKind::kNone);
  RegisterOomTranslator("framework", [](std::exception_ptr e) -> std::optional<OomInfo> {
    try {
      std::rethrow_exception(e);
    } catch (const FrameworkOom& oom) {
      OomInfo info;
      info.kind = OomKind::kDevice;
      info.exception_type = "FrameworkOom";
      info.requested_bytes = oom.bytes;
      return info;
    } catch (...) {
      return std::nullopt;
    }
  });
  OomInfo info = ClassifyThrown(FrameworkOom{99});
  EXPECT_EQ(info.kind, OomKind::kDevice);
  EXPECT_EQ(info.exception_type, "FrameworkOom");
  EXPECT_EQ(info.requested_bytes, 99);
  EXPECT_EQ(info.matched_by, "translator:framework");

  // Built-in types still win over translators.
  info = ClassifyThrown(std::bad_alloc());
  EXPECT_EQ(info.matched_by, "type");

  UnregisterOomTranslator("framework");
  EXPECT_EQ(ClassifyThrown(FrameworkOom{99}).kind, OomKind::kNone);
}

TEST_F(TranslatorTest, SameNameReplacesAndOrderIsRegistrationOrder) {
  auto says = [](OomKind kind) {
    return [kind](std::exception_ptr) -> std::optional<OomInfo> {
      OomInfo info;
      info.kind = kind;
      return info;
    };
  };
  RegisterOomTranslator("framework", says(OomKind::kDevice));
  RegisterOomTranslator("second", says(OomKind::kHost));
  EXPECT_EQ(ClassifyThrown(FrameworkOom{1}).matched_by, "translator:framework");

  // Replacement: "framework" now declines, so "second" answers.
  RegisterOomTranslator("framework", says(OomKind::kNone));
  OomInfo info = ClassifyThrown(FrameworkOom{1});
  EXPECT_EQ(info.kind, OomKind::kHost);
  EXPECT_EQ(info.matched_by, "translator:second");
  EXPECT_EQ(info.exception_type, "unknown");  // the translator did not say
}

TEST_F(TranslatorTest, ThrowingTranslatorIsSkippedAndMayRegister) {
  RegisterOomTranslator("thrower", [](std::exception_ptr) -> std::optional<OomInfo> {
    // Registering from inside a translator must not deadlock.
    RegisterOomTranslator("second",
                          [](std::exception_ptr) -> std::optional<OomInfo> { return std::nullopt; });
    throw std::runtime_error("translator bug");
  });
  OomInfo info = ClassifyThrown(std::runtime_error("DefaultCPUAllocator: can't allocate memory"));
  EXPECT_EQ(info.kind, OomKind::kHost);
  EXPECT_EQ(info.matched_by, "message");
}

struct MessageCase {
  const char* message;
  OomKind kind;
  int64_t requested_bytes;
};

TEST(ClassifyMessageTest, RecognisesKnownMessages) {
  const MessageCase cases[] = {
      // PyTorch CUDA caching allocator (1.x and 2.x wording).
      {"CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
       "14.56 GiB already allocated; 3.44 MiB free; 14.74 GiB reserved in total by PyTorch)",
       OomKind::kDevice, 20 * kMiB},
      {"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
       "total capacity of 79.15 GiB of which 1.5 GiB is free.",
       OomKind::kDevice, 2 * kGiB},
      {"torch.cuda.OutOfMemoryError: CUDA out of memory.", OomKind::kDevice, 0},
      {"RuntimeError: CUDA error: out of memory", OomKind::kDevice, 0},
      {"HIP out of memory. Tried to allocate 1.50 GiB", OomKind::kDevice, 1536 * kMiB},
      {"cudaErrorMemoryAllocation", OomKind::kDevice, 0},
      {"OutOfMemoryError", OomKind::kDevice, 0},
      {"the GPU ran out of memory", OomKind::kDevice, 0},
      {"device out of memory", OomKind::kDevice, 0},
      // XLA on TPU (pytorch/xla#2569) and TensorFlow's cuDNN handle.
      {"(1) Resource exhausted: Attempting to allocate 180.59M. That was not possible. There are 142.58M free.; "
       "(0x3x0_HBM1)",
       OomKind::kDevice, 189362340},  // 180.59 MiB
      {"E tensorflow/stream_executor/cuda/cuda_dnn.cc:328] Could not create cudnn handle: "
       "CUDNN_STATUS_INTERNAL_ERROR",
       OomKind::kWorkspace, 0},
      // vLLM at startup.
      {"ValueError: Free memory on device cuda:0 (3.1/79.2 GiB) on startup is less than desired GPU memory "
       "utilization (0.9, 71.3 GiB).",
       OomKind::kDevice, 0},
      {"ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.",
       OomKind::kDevice, 0},
      {"sim:0 out of memory. Tried to allocate 512.00 KiB (simulated device capacity 8.00 MiB)",
       OomKind::kDevice, 512 * 1024},
      // Host.
      {"[enforce fail at alloc_cpu.cpp:75] . DefaultCPUAllocator: can't allocate memory: you "
       "tried to allocate 123456 bytes. Error code 12 (Cannot allocate memory)",
       OomKind::kHost, 123456},
      {"DefaultCPUAllocator: not enough memory: you tried to allocate 4000000000 bytes.", OomKind::kHost,
       4000000000},
      {"std::bad_alloc", OomKind::kHost, 0},
      // PyTorch 0.4's TH allocator (FenTechSolutions/CausalDiscoveryToolbox#9).
      {"not enough memory: you tried to allocate 160465GB. Buy new RAM! at /opt/conda/conda-bld/pytorch_1524584710464/"
       "work/aten/src/TH/THGeneral.c:218",
       OomKind::kHost, 160465000000000ull},
      {"mmap failed: Cannot allocate memory", OomKind::kHost, 0},
      // PyTorch's file mapping (turboderp/exllama#245): whole, and quoted without its reason.
      {"RuntimeError: unable to mmap 33484977464 bytes from file <model.safetensors>: Cannot allocate memory (12)",
       OomKind::kHost, 33484977464},
      {"RuntimeError: unable to mmap 33484977464 bytes", OomKind::kHost, 33484977464},
      // Docker Compose's line for a container the kernel killed (open-webui/open-webui#6168).
      {"server-1 exited with code 137", OomKind::kHost, 0},
      // Apple's Metal out of memory: MLX's message as jjang-ai/vmlx#58 quotes it, whole with Metal's
      // code, the code alone as llama.cpp prints it, and its older macOS name.
      {"libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command buffer "
       "execution failed: Insufficient Memory",
       OomKind::kDevice, 0},
      {"[METAL] Command buffer execution failed: Insufficient Memory "
       "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
       OomKind::kDevice, 0},
      {"error: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)", OomKind::kDevice, 0},
      {"MetalExecutionError: Error Domain=MTLCommandBufferErrorDomain Code=8 \"Insufficient Memory (IOAF code 8)\"",
       OomKind::kDevice, 0},
      // MLX's allocator refusing a buffer larger than Metal allows (ml-explore/mlx#3082): the request is the size.
      {"RuntimeError: [metal::malloc] Attempting to allocate 86587211776 bytes which is greater than the maximum "
       "allowed buffer size of 86586540032 bytes.",
       OomKind::kDevice, 86587211776},
      // ggml's allocator (llama.cpp) refusing a backend buffer, as ggml-org/llama.cpp#9352 quotes it:
      // the buffer's bytes are the request; a GPU backend's buffer is device memory, the CPU's
      // (and a GPU backend's pinned "CUDA_Host" buffer) host memory.
      {"ggml_gallocr_reserve_n: failed to allocate ROCm0 buffer of size 18035509504", OomKind::kDevice, 18035509504},
      {"ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 4294967296", OomKind::kDevice, 4294967296},
      {"ggml_gallocr_reserve_n: failed to allocate CPU buffer of size 2147483648", OomKind::kHost, 2147483648},
      {"ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 1073741824", OomKind::kHost,
       1073741824},
      {"alloc_tensor_range: failed to allocate CUDA_Host buffer of size 536870912", OomKind::kHost, 536870912},
      // ggml's CUDA backend names cudaMalloc's failure and the MiB it asked for.
      {"ggml_backend_cuda_buffer_type_alloc_buffer: allocating 17200.00 MiB on device 0: cudaMalloc failed: out of "
       "memory",
       OomKind::kDevice, 17200 * kMiB},
      // Ollama's runner dying as it loads a model (ollama/ollama#1727): the card's memory.
      {"Error: llama runner exited, you may not have enough available memory to run this model", OomKind::kDevice, 0},
      // Shared memory exhausted (tahoebio/tahoe-x1#63).
      {"DataLoader crashed with Bus error / No space left on device due to the 64 MB /dev/shm", OomKind::kHost, 0},
      // The torch budget's caching device (sdk/torch/torch_budget.cc).
      {"Budget device out of memory. Tried to allocate 2.00 MiB. Device budget:0 has a total capacity of 8.00 MiB "
       "of which 1.00 MiB is free.",
       OomKind::kDevice, 2 * kMiB},
      {"MemoryError: Unable to allocate 3.00 GiB for an array", OomKind::kHost, 3 * kGiB},
      {"out of memory", OomKind::kHost, 0},
      {"fatal: Out Of Memory, malloc failed (tried to allocate 1048576 bytes)", OomKind::kHost, 1048576},
      {"RuntimeError: [enforce fail] you are trying to allocate 123456 bytes but out of memory",
       OomKind::kHost, 123456},
      // Workspace.
      {"CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", OomKind::kWorkspace, 0},
      {"cuDNN error: CUDNN_STATUS_ALLOC_FAILED", OomKind::kWorkspace, 0},
      {"Failed to allocate 64.00 MiB for the cuDNN workspace", OomKind::kWorkspace, 64 * kMiB},
      // TensorFlow / XLA / JAX.
      {"ResourceExhaustedError: OOM when allocating tensor with shape[32,1024] and type float "
       "on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc",
       OomKind::kDevice, 32 * 1024 * 4},
      {"RESOURCE_EXHAUSTED: OOM when allocating tensor with shape[8,128,128] and type half", OomKind::kDevice,
       8 * 128 * 128 * 2},
      {"OOM when allocating tensor with shape[1000,1000] and type double on "
       "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu",
       OomKind::kHost, 8000000},
      {"OOM when allocating tensor with shape[10] and type int64", OomKind::kDevice, 80},
      {"OOM when allocating tensor with shape[2,3] and type bool", OomKind::kDevice, 6},
      {"XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 "
       "bytes.",
       OomKind::kDevice, 4294967296},
      // Units.
      {"CUDA out of memory. Tried to allocate 1.00 TiB", OomKind::kDevice, 1024 * kGiB},
      {"CUDA out of memory. Tried to allocate 3 KiB", OomKind::kDevice, 3072},
      {"CUDA out of memory. Tried to allocate 2 MB", OomKind::kDevice, 2000000},
      {"CUDA out of memory. Tried to allocate 1.5 GB", OomKind::kDevice, 1500000000},
      {"CUDA out of memory. Tried to allocate 100 B", OomKind::kDevice, 100},
      {"CUDA out of memory. Tried to allocate 1,048,576 bytes", OomKind::kDevice, 1048576},
      // Not failures.
      {"memory usage is fine", OomKind::kNone, 0},
      {"allocated 2.00 GiB of memory for the cache", OomKind::kNone, 0},
      {"Expected all tensors to be on the same device, but found cuda:0 and cpu", OomKind::kNone, 0},
      {"CUDA error: an illegal memory access was encountered", OomKind::kNone, 0},
      {"workspace size is 4 MiB", OomKind::kNone, 0},
      {"write failed: No space left on device", OomKind::kNone, 0},
      {"RuntimeError: unable to mmap 4096 bytes from file </dev/shm/torch_1>: Invalid argument (22)", OomKind::kNone,
       0},
      {"server-1 exited with code 1", OomKind::kNone, 0},
      // Metal's other command buffer failures, and MLX's limit on the number of buffers.
      {"[METAL] Command buffer execution failed: Caused GPU Timeout Error "
       "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)",
       OomKind::kNone, 0},
      {"[METAL] Command buffer execution failed: Discarded (victim of GPU error/recovery) "
       "(00000005:kIOGPUCommandBufferCallbackErrorInnocentVictim)",
       OomKind::kNone, 0},
      {"[metal::malloc] Resource limit (499000) exceeded.", OomKind::kNone, 0},
      // llama.cpp's lines for buffers it did allocate, a buffer failure with no size, Ollama's runner
      // exiting for another reason.
      {"llama_new_context_with_model:  CUDA0 compute buffer size =   164.01 MiB", OomKind::kNone, 0},
      {"llama_model_load: error loading model: failed to allocate buffer", OomKind::kNone, 0},
      {"ggml_gallocr_reserve_n: failed to allocate ROCm0 buffer of size zero", OomKind::kNone, 0},
      {"Error: llama runner exited with status 1", OomKind::kNone, 0},
      {"", OomKind::kNone, 0},
  };
  for (const MessageCase& c : cases) {
    OomInfo info = ClassifyMessage(c.message);
    EXPECT_EQ(info.kind, c.kind) << c.message << " -> " << OomKindName(info.kind);
    EXPECT_EQ(info.requested_bytes, c.requested_bytes) << c.message;
    EXPECT_EQ(info.message, c.message);
    EXPECT_EQ(info.matched_by, c.kind == OomKind::kNone ? "" : "message") << c.message;
  }
}

TEST(ClassifyMessageTest, CaseInsensitive) {
  EXPECT_EQ(ClassifyMessage("cuda OUT OF MEMORY. tried to allocate 1.00 gib").kind, OomKind::kDevice);
  EXPECT_EQ(ClassifyMessage("cuda OUT OF MEMORY. tried to allocate 1.00 gib").requested_bytes, kGiB);
  EXPECT_EQ(ClassifyMessage("cublas_status_alloc_failed").kind, OomKind::kWorkspace);
}

#ifdef OOMGUARD_WITH_TORCH
TEST(ClassifyTorchTest, C10OutOfMemoryErrorIsDevice) {
  OomInfo info;
  try {
    C10_THROW_ERROR(OutOfMemoryError,
                    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total "
                    "capacity; 14.56 GiB already allocated)");
  } catch (...) {
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kDevice);
  EXPECT_EQ(info.exception_type, "c10::OutOfMemoryError");
  EXPECT_EQ(info.matched_by, "type");
  EXPECT_EQ(info.requested_bytes, 20 * kMiB);
  // what_without_backtrace: no "Exception raised from" trailer.
  EXPECT_EQ(info.message.find("Exception raised from"), std::string::npos) << info.message;
}

TEST(ClassifyTorchTest, C10OutOfMemoryErrorWithoutWordingIsStillOom) {
  OomInfo info;
  try {
    C10_THROW_ERROR(OutOfMemoryError, "allocator said no");
  } catch (...) {
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kDevice);
  EXPECT_EQ(info.exception_type, "c10::OutOfMemoryError");
}

TEST(ClassifyTorchTest, PlainC10ErrorIsClassifiedByMessage) {
  OomInfo info;
  try {
    C10_THROW_ERROR(Error,
                    "[enforce fail at alloc_cpu.cpp:75] DefaultCPUAllocator: can't allocate "
                    "memory: you tried to allocate 1024 bytes.");
  } catch (...) {
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kHost);
  EXPECT_EQ(info.exception_type, "c10::Error");
  EXPECT_EQ(info.requested_bytes, 1024);

  try {
    C10_THROW_ERROR(ValueError, "expected a tensor on device cuda:0");
  } catch (...) {
    info = ClassifyException(std::current_exception());
  }
  EXPECT_EQ(info.kind, OomKind::kNone);
}
#endif  // OOMGUARD_WITH_TORCH

}  // namespace
}  // namespace oomguard
