#include "sdk/checkpoint/device_copy.h"

#ifdef OOMGUARD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <string>

namespace oomguard::ckpt {

#ifdef OOMGUARD_WITH_CUDA
namespace {

Status CudaStatus(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  cudaGetLastError();  // clear a sticky launch error so the next call is not blamed
  return Status::Internal(std::string("checkpoint device copy: ") + what + ": " + cudaGetErrorString(e));
}

class CudaCopier final : public DeviceCopier {
 public:
  CudaCopier(cudaStream_t stream, cudaEvent_t ready) : stream_(stream), ready_(ready) {}
  ~CudaCopier() override {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  Status ToHost(void* dst, const void* src, size_t n) override {
    OOMGUARD_RETURN_IF_ERROR(OrderAfterDefaultStream());
    return CudaStatus("cudaMemcpyAsync(D2H)", cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream_));
  }
  Status ToDevice(void* dst, const void* src, size_t n) override {
    OOMGUARD_RETURN_IF_ERROR(OrderAfterDefaultStream());
    return CudaStatus("cudaMemcpyAsync(H2D)", cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream_));
  }
  Status Sync() override {
    ordered_ = false;
    return CudaStatus("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }

 private:
  // Once per batch of copies: the side stream waits for what the training
  // step queued on the default stream before it reads or writes its tensors.
  Status OrderAfterDefaultStream() {
    if (ordered_) return Status::Ok();
    OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaEventRecord", cudaEventRecord(ready_, cudaStreamLegacy)));
    OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaStreamWaitEvent", cudaStreamWaitEvent(stream_, ready_, 0)));
    ordered_ = true;
    return Status::Ok();
  }

  cudaStream_t stream_;
  cudaEvent_t ready_;
  bool ordered_ = false;
};

}  // namespace

StatusOr<std::unique_ptr<DeviceCopier>> DeviceCopier::Create() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return Status::Unavailable(std::string("checkpoint of CUDA tensors: no GPU is visible (") +
                               (e == cudaSuccess ? "no device" : cudaGetErrorString(e)) + ")");
  }
  cudaStream_t stream;
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaStreamCreate", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  cudaEvent_t ready;
  Status s = CudaStatus("cudaEventCreate", cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  if (!s.ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  return std::unique_ptr<DeviceCopier>(new CudaCopier(stream, ready));
}

void PinHost(void* p, size_t n) {
  if (p == nullptr || n == 0) return;
  if (cudaHostRegister(p, n, cudaHostRegisterDefault) != cudaSuccess) cudaGetLastError();
}

void UnpinHost(void* p) {
  if (p == nullptr) return;
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();  // was not pinned
}

#else  // !OOMGUARD_WITH_CUDA

StatusOr<std::unique_ptr<DeviceCopier>> DeviceCopier::Create() {
  return Status::Unimplemented("checkpoint of CUDA tensors: built without CUDA (OOMGUARD_WITH_CUDA=OFF)");
}
void PinHost(void*, size_t) {}
void UnpinHost(void*) {}

#endif

}  // namespace oomguard::ckpt
