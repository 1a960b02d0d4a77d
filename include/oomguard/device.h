// Device: where a training step's memory lives, and how the SDK sees it.
//
// The guard reads memory figures from a Device when it records an incident and
// calls ReleaseCaches before it retries, so that the retry sees the memory.
// Figures (MemoryStats) and the OOM error types come from oom_error.h.
//
// Implementations:
//   SimulatedDevice  a capacity-limited model of a caching allocator (host memory);
//                    what the demo and the tests run on.
//   CudaDevice       the CUDA runtime (compiled when the toolkit is found).
//   your own         Device is a public extension point: subclass it to give
//                    the guard your framework's allocator (its figures and its
//                    cache release), and pass it as GuardOptions::device. The
//                    Python binding's TorchDevice is one such subclass.
//
// Writing your own. What the guard calls, and when:
//   Stats()          at the start of each step, before and after each
//                    micro-batch, and at an OOM. Fill what you know; 0 means
//                    unknown. total > 0 turns on the predictive size controller
//                    (it needs allocated, reserved, free and peak_allocated
//                    too; num_alloc_retries, when the allocator counts its
//                    flush-and-retry, tells it about fragmentation). With total
//                    0 the guard sizes by search, from OOMs alone.
//   ResetPeak()      before each micro-batch: peak_allocated from then on is
//                    that micro-batch's peak.
//   ReleaseCaches()  after an OOM, before the retry (after the user's cache
//                    releasers): give cached, unused memory back.
//   Name()           in log lines and incidents.
//   Allocate/Free    only through DeviceBuffer (the demo's own buffers); the
//                    guard never allocates. A device whose framework allocates
//                    by itself may throw std::logic_error from Allocate.
// Methods must not throw, but Allocate with DeviceOomError when full. The
// out-of-memory errors of your framework reach the guard from your micro
// callback: std::bad_alloc, DeviceOomError/HostOomError, c10 errors (with
// oomguard::torch) and messages that say "out of memory" are recognised;
// another exception type can be taught with RegisterOomTranslator (oom.h).
//
// Thread-safety: every Device method may be called from any thread.
#ifndef OOMGUARD_DEVICE_H_
#define OOMGUARD_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "oomguard/export.h"
#include "oomguard/oom_error.h"  // MemoryStats, DeviceOomError, HostOomError
#include "oomguard/status.h"

namespace oomguard {

class OOMGUARD_EXPORT Device {
 public:
  virtual ~Device();
  // "sim:0", "cuda:0", ...
  virtual std::string Name() const = 0;
  virtual MemoryStats Stats() const = 0;
  // Returns cached, unused memory to the device (torch.cuda.empty_cache).
  // Synchronises outstanding work first where the device is asynchronous.
  virtual void ReleaseCaches() = 0;
  // Restarts the peak_allocated high-water mark from the current allocation.
  virtual void ResetPeak() = 0;
  // Allocates `bytes` of device memory. Throws DeviceOomError when it cannot.
  // The pointer is host-addressable for SimulatedDevice, device memory for CUDA.
  virtual void* Allocate(size_t bytes) = 0;
  // REQUIRES: p came from Allocate on this device and was not freed yet.
  virtual void Free(void* p) = 0;
};

struct SimulatedDeviceOptions {
  int64_t capacity_bytes = 0;            // 0: unlimited
  int64_t segment_bytes = 2 << 20;       // large requests get a segment of their own rounded to this
  int64_t small_request_bytes = 1 << 20; // requests up to this share segments of segment_bytes
  int64_t round_bytes = 512;             // every request is rounded up to a multiple of this
  bool backing = true;                   // back allocations with real host memory
  int index = 0;                         // the N in "sim:N"
};

// Creates a simulated caching-allocator device. Freed blocks stay reserved
// (cached) until ReleaseCaches; a request that no cached block fits and that
// would pass the capacity first releases fully free segments and retries (as
// PyTorch does, counted in num_alloc_retries), then throws DeviceOomError.
// Blocks are split and coalesced, so fragmentation arises as on a real
// caching allocator.
OOMGUARD_EXPORT StatusOr<std::unique_ptr<Device>> MakeSimulatedDevice(
    const SimulatedDeviceOptions& options);

// True when the library was built with CUDA support.
OOMGUARD_EXPORT bool CudaCompiled();

// Creates a device on the CUDA runtime. Returns kUnavailable with the reason
// when no GPU is visible (no driver: cudaErrorInsufficientDriver, or no
// device: cudaErrorNoDevice), kUnimplemented when built without CUDA.
OOMGUARD_EXPORT StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int device_index);

// RAII owner of one Device allocation.
class OOMGUARD_EXPORT DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Throws DeviceOomError when the device cannot allocate.
  DeviceBuffer(Device* device, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  void reset();

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace oomguard

#endif  // OOMGUARD_DEVICE_H_
