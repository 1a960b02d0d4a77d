// CudaDevice: a Device on the CUDA runtime API.
//
// Allocations come from a private stream-ordered memory pool (cudaMallocFrom
// PoolAsync on the legacy default stream, so that work on other blocking
// streams is ordered with them), or from cudaMalloc where the device has no
// memory-pool support. The pool's release threshold is set to "never", so
// freed memory stays cached as in PyTorch's allocator until ReleaseCaches
// trims it; a private pool means trimming touches only our own cache.
//
// allocated/peak_allocated are the device's own accounting of live
// allocations; total/free come from cudaMemGetInfo (so memory held by other
// processes shows up as missing free memory); reserved is the pool's
// reserved-memory attribute.
//
// Thread-safety: mu_ guards the accounting. CUDA calls are made with this
// device current on the calling thread and the caller's device restored after.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "oomguard/device.h"
#include "oomguard/oom.h"
#include "oomguard/status.h"

#include "sdk/core/format.h"

namespace oomguard {
namespace {

using internal::FormatBytesFixed2;


std::string ErrorText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

// Makes `device` current for the scope of a call and restores the caller's
// device afterwards: the current device is per host thread, and the caller
// may be driving another GPU.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ == device) {
      previous_ = -1;
    } else {
      OOMGUARD_CUDA_CHECK(cudaSetDevice(device));
    }
  }
  ~ScopedDevice() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

// ScopedDevice for paths that must not throw (destructor, Stats).
class ScopedDeviceNoThrow {
 public:
  explicit ScopedDeviceNoThrow(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    } else if (previous_ == device) {
      previous_ = -1;
    } else if (cudaSetDevice(device) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
  }
  ~ScopedDeviceNoThrow() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  ScopedDeviceNoThrow(const ScopedDeviceNoThrow&) = delete;
  ScopedDeviceNoThrow& operator=(const ScopedDeviceNoThrow&) = delete;

 private:
  int previous_ = -1;
};

class CudaDevice final : public Device {
 public:
  // REQUIRES: `index` names a visible device. Throws CudaError on failure.
  explicit CudaDevice(int index) : index_(index), name_("cuda:" + std::to_string(index)) {
    ScopedDevice scoped(index_);
    int pools_supported = 0;
    OOMGUARD_CUDA_CHECK(cudaDeviceGetAttribute(&pools_supported, cudaDevAttrMemoryPoolsSupported, index_));
    if (pools_supported != 0) {
      cudaMemPoolProps props = {};
      props.allocType = cudaMemAllocationTypePinned;
      props.handleTypes = cudaMemHandleTypeNone;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = index_;
      OOMGUARD_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
      uint64_t never = std::numeric_limits<uint64_t>::max();
      OOMGUARD_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &never));
    }
  }

  ~CudaDevice() override {
    // Errors are ignored: a destructor cannot report them, and a pool with
    // outstanding allocations is released by CUDA once they are freed.
    if (pool_ != nullptr) {
      ScopedDeviceNoThrow scoped(index_);
      (void)cudaDeviceSynchronize();
      (void)cudaMemPoolDestroy(pool_);
      (void)cudaGetLastError();
    }
  }

  std::string Name() const override { return name_; }

  MemoryStats Stats() const override {
    MemoryStats s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      s.allocated = allocated_;
      s.peak_allocated = peak_allocated_;
      s.num_alloc_retries = num_alloc_retries_;
      s.num_ooms = num_ooms_;
    }
    s.active = s.allocated;
    s.reserved = s.allocated;
    // Stats feeds incident reports on the error path; a failing query leaves
    // its figure at 0 rather than replacing the error being reported.
    ScopedDeviceNoThrow scoped(index_);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      s.total = static_cast<int64_t>(total_bytes);
      s.free = static_cast<int64_t>(free_bytes);
    } else {
      (void)cudaGetLastError();
    }
    if (pool_ != nullptr) {
      uint64_t reserved = 0;
      if (cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess) {
        s.reserved = static_cast<int64_t>(reserved);
      } else {
        (void)cudaGetLastError();
      }
    }
    return s;
  }

  void ReleaseCaches() override {
    ScopedDevice scoped(index_);
    // Frees issued with cudaFreeAsync return to the pool only once the stream
    // reaches them; synchronise so that the trim sees all of them.
    OOMGUARD_CUDA_CHECK(cudaDeviceSynchronize());
    if (pool_ != nullptr) OOMGUARD_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
  }

  void ResetPeak() override {
    std::lock_guard<std::mutex> lock(mu_);
    peak_allocated_ = allocated_;
  }

  void* Allocate(size_t bytes) override {
    ScopedDevice scoped(index_);
    void* p = nullptr;
    cudaError_t err = RawAllocate(&p, bytes);
    if (err == cudaErrorMemoryAllocation) {
      // As PyTorch: give the cache back to the driver and try once more.
      (void)cudaGetLastError();
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++num_alloc_retries_;
      }
      ReleaseCaches();
      err = RawAllocate(&p, bytes);
    }
    if (err == cudaErrorMemoryAllocation) {
      // cudaErrorMemoryAllocation is not sticky, but it stays as the "last
      // error" and would be reported by an unrelated later check; clear it.
      (void)cudaGetLastError();
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++num_ooms_;
      }
      MemoryStats s = Stats();
      throw DeviceOomError(name_ + " CUDA out of memory. Tried to allocate " +
                               FormatBytesFixed2(static_cast<int64_t>(bytes)) + " (GPU " + std::to_string(index_) +
                               "; " + FormatBytesFixed2(s.total) + " total capacity; " + FormatBytesFixed2(s.allocated) +
                               " already allocated by oomguard; " + FormatBytesFixed2(s.free) + " free; " +
                               FormatBytesFixed2(s.reserved) + " reserved in total by oomguard)",
                           static_cast<int64_t>(bytes), s);
    }
    OOMGUARD_CUDA_CHECK(err);
    if (p == nullptr) return nullptr;  // a zero-byte request
    std::lock_guard<std::mutex> lock(mu_);
    sizes_.emplace(p, bytes);
    allocated_ += static_cast<int64_t>(bytes);
    peak_allocated_ = std::max(peak_allocated_, allocated_);
    return p;
  }

  void Free(void* p) override {
    if (p == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sizes_.find(p);
      if (it == sizes_.end()) {
        std::fprintf(stderr,
                     "oomguard: %s: Free(%p) of a pointer that this device did not allocate "
                     "or that was already freed\n",
                     name_.c_str(), p);
        std::abort();
      }
      allocated_ -= static_cast<int64_t>(it->second);
      sizes_.erase(it);
    }
    ScopedDevice scoped(index_);
    if (pool_ != nullptr) {
      OOMGUARD_CUDA_CHECK(cudaFreeAsync(p, cudaStreamLegacy));
    } else {
      OOMGUARD_CUDA_CHECK(cudaFree(p));
    }
  }

 private:
  cudaError_t RawAllocate(void** p, size_t bytes) {
    if (pool_ != nullptr) return cudaMallocFromPoolAsync(p, bytes, pool_, cudaStreamLegacy);
    return cudaMalloc(p, bytes);
  }

  const int index_;
  const std::string name_;
  cudaMemPool_t pool_ = nullptr;  // null: no pool support, plain cudaMalloc

  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;  // live allocations
  int64_t allocated_ = 0;
  int64_t peak_allocated_ = 0;
  int64_t num_alloc_retries_ = 0;
  int64_t num_ooms_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int device_index) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::string why;
    if (err == cudaErrorInsufficientDriver) {
      why = ": no NVIDIA driver is loaded, or it is older than this CUDA runtime";
    } else if (err == cudaErrorNoDevice) {
      why = ": no CUDA-capable device is installed or visible (check CUDA_VISIBLE_DEVICES)";
    }
    return Status::Unavailable("no GPU is visible: cudaGetDeviceCount failed with " + ErrorText(err) + why);
  }
  if (count == 0) {
    return Status::Unavailable("no GPU is visible: cudaGetDeviceCount returned 0 devices");
  }
  if (device_index < 0 || device_index >= count) {
    return Status::InvalidArgument("CUDA device index must be in [0, " + std::to_string(count) + ") (got " +
                                   std::to_string(device_index) + ")");
  }
  try {
    return std::unique_ptr<Device>(std::make_unique<CudaDevice>(device_index));
  } catch (const CudaError& e) {
    return Status::Unavailable(std::string("cannot set up cuda:") + std::to_string(device_index) + ": " +
                               e.what());
  }
}

}  // namespace oomguard
