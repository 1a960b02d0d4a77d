// DeviceCopier: moves registered CUDA tensors to and from host staging
// buffers for the checkpointer.
//
// Copies run on a private non-blocking stream that first waits for the work
// already queued on the legacy default stream (an event), so a copy sees the
// parameters that the training step wrote, and training kernels queued later
// are not serialised behind checkpoint traffic. Host buffers are pinned
// (cudaHostRegister) so device-to-host copies run at full bandwidth and
// truly asynchronously; Sync() returns once every queued copy finished.
//
// Built without CUDA (OOMGUARD_WITH_CUDA off), Create returns kUnimplemented.
// Thread-safety: one thread (the training thread) uses a copier; Unpin may
// be called from any thread.
#ifndef OOMGUARD_SDK_CHECKPOINT_DEVICE_COPY_H_
#define OOMGUARD_SDK_CHECKPOINT_DEVICE_COPY_H_

#include <cstddef>
#include <memory>

#include "oomguard/status.h"

namespace oomguard::ckpt {

class DeviceCopier {
 public:
  static StatusOr<std::unique_ptr<DeviceCopier>> Create();
  virtual ~DeviceCopier() = default;
  // Queues a device-to-host copy of `n` bytes, ordered after the default stream's work.
  virtual Status ToHost(void* host_dst, const void* device_src, size_t n) = 0;
  // Queues a host-to-device copy of `n` bytes.
  virtual Status ToDevice(void* device_dst, const void* host_src, size_t n) = 0;
  // Waits for every queued copy; then the host buffers hold the data and the
  // device tensors hold what was copied in (the default stream is ordered after them).
  virtual Status Sync() = 0;
};

// Page-locks [p, p + n) for fast copies; a no-op without CUDA or on failure
// (the copy then runs from pageable memory). REQUIRES: Unpin(p) before the
// memory is freed.
void PinHost(void* p, size_t n);
void UnpinHost(void* p);

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_DEVICE_COPY_H_
