#include "sdk/checkpoint/device_copy.h"

#ifdef OOMGUARD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <string>
#include <vector>

namespace oomguard::ckpt {

#ifdef OOMGUARD_WITH_CUDA
namespace {

Status CudaStatus(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear a sticky launch error so the next call is not blamed
  return Status::Internal(std::string("checkpoint device copy: ") + what + ": " + cudaGetErrorString(e));
}

// Makes `device` current on this thread for the object's life, then puts the
// thread's previous device back.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device && cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
    device_ = device;
  }
  ~DeviceScope() {
    if (previous_ >= 0 && previous_ != device_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
  int device_ = -1;
};

class CudaCopier final : public DeviceCopier {
 public:
  CudaCopier(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaCopier() override {
    DeviceScope on(device_);
    cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
    cudaGetLastError();
  }

  int device() const override { return device_; }

  Status Begin(std::span<void* const> streams) override {
    DeviceScope on(device_);
    const size_t n = streams.empty() ? 1 : streams.size();
    while (events_.size() < n) {
      cudaEvent_t e;
      OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaEventCreate", cudaEventCreateWithFlags(&e, cudaEventDisableTiming)));
      events_.push_back(e);
    }
    for (size_t i = 0; i < n; ++i) {
      cudaStream_t s = streams.empty() ? cudaStreamLegacy : static_cast<cudaStream_t>(streams[i]);
      OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(events_[i], s)));
      OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaStreamWaitEvent", cudaStreamWaitEvent(stream_, events_[i], 0)));
    }
    return Status::Ok();
  }
  Status ToHost(void* dst, const void* src, size_t n) override {
    DeviceScope on(device_);
    return CudaStatus("cudaMemcpyAsync(D2H)", cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream_));
  }
  Status ToDevice(void* dst, const void* src, size_t n) override {
    DeviceScope on(device_);
    return CudaStatus("cudaMemcpyAsync(H2D)", cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream_));
  }
  Status Sync() override {
    DeviceScope on(device_);
    return CudaStatus("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }

 private:
  const int device_;
  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;  // one per stream ordered after, reused
};

}  // namespace

StatusOr<std::unique_ptr<DeviceCopier>> DeviceCopier::Create(int device) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return Status::Unavailable(std::string("checkpoint of CUDA tensors: no GPU is visible (") +
                               (e == cudaSuccess ? "no device" : cudaGetErrorString(e)) + ")");
  }
  if (device < 0 || device >= n)
    return Status::InvalidArgument("checkpoint of CUDA tensors: device " + std::to_string(device) + " of " +
                                   std::to_string(n));
  DeviceScope on(device);
  cudaStream_t stream;
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaStreamCreate", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  return std::unique_ptr<DeviceCopier>(new CudaCopier(device, stream));
}

StatusOr<int> DeviceOfPointer(const void* p) {
  cudaPointerAttributes attr{};
  cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Status::InvalidArgument(std::string("not CUDA memory (") + cudaGetErrorString(e) + ")");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return Status::InvalidArgument("not device memory");
  return attr.device;
}

bool PinHost(void* p, size_t n, int device) {
  if (p == nullptr || n == 0) return false;
  DeviceScope on(device);
  if (cudaHostRegister(p, n, cudaHostRegisterDefault) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

void UnpinHost(void* p, int device) {
  if (p == nullptr) return;
  DeviceScope on(device);
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

#else  // !OOMGUARD_WITH_CUDA

StatusOr<std::unique_ptr<DeviceCopier>> DeviceCopier::Create(int) {
  return Status::Unimplemented("checkpoint of CUDA tensors: built without CUDA (OOMGUARD_WITH_CUDA=OFF)");
}
StatusOr<int> DeviceOfPointer(const void*) {
  return Status::Unimplemented("checkpoint of CUDA tensors: built without CUDA (OOMGUARD_WITH_CUDA=OFF)");
}
bool PinHost(void*, size_t, int) { return false; }
void UnpinHost(void*, int) {}

#endif

}  // namespace oomguard::ckpt
