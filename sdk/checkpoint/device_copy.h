// DeviceCopier: moves registered CUDA tensors to and from host staging
// buffers for the checkpointer.
//
// Copies run in batches on a private non-blocking stream. Begin() starts a
// batch: the private stream first waits for the work already queued on the
// streams that write the tensors (events), so a copy sees the parameters the
// training step wrote, and training kernels queued later are not serialised
// behind checkpoint traffic. Sync() ends the batch once every queued copy
// finished. Because every batch starts with its own Begin, an error in one
// batch never leaves the next one unordered.
//
// Every call first makes the tensors' device current on the calling thread,
// so that a copier used (or a buffer unpinned) from another thread never
// creates a context on GPU 0 for a rank that runs on cuda:N.
//
// Built without CUDA (OOMGUARD_WITH_CUDA off), Create returns kUnimplemented.
// Thread-safety: one thread uses a copier at a time; PinHost and UnpinHost
// may be called from any thread.
#ifndef OOMGUARD_SDK_CHECKPOINT_DEVICE_COPY_H_
#define OOMGUARD_SDK_CHECKPOINT_DEVICE_COPY_H_

#include <cstddef>
#include <memory>
#include <span>

#include "oomguard/status.h"

namespace oomguard::ckpt {

class DeviceCopier {
 public:
  // A copier for tensors on CUDA device `device`. kUnavailable without a GPU.
  static StatusOr<std::unique_ptr<DeviceCopier>> Create(int device);
  virtual ~DeviceCopier() = default;
  virtual int device() const = 0;
  // Starts a batch: the copies that follow wait for the work queued so far on
  // `streams` (cudaStream_t values); empty: the legacy default stream.
  virtual Status Begin(std::span<void* const> streams) = 0;
  // Queues a device-to-host copy of `n` bytes. REQUIRES: Begin in this batch.
  virtual Status ToHost(void* host_dst, const void* device_src, size_t n) = 0;
  // Queues a host-to-device copy of `n` bytes. REQUIRES: Begin in this batch.
  virtual Status ToDevice(void* device_dst, const void* host_src, size_t n) = 0;
  // Waits for every queued copy and ends the batch; then the host buffers hold
  // the data and the device tensors hold what was copied in.
  virtual Status Sync() = 0;
};

// The CUDA device that holds `p` (kInvalidArgument when `p` is not device
// memory; kUnimplemented without CUDA).
StatusOr<int> DeviceOfPointer(const void* p);

// Page-locks [p, p + n) for fast, truly asynchronous copies, with `device`
// current. False when the driver refused (the buffer stays pageable: copies
// still work, synchronously and slower); the caller must then not record the
// buffer as pinned. REQUIRES: UnpinHost(p, device) before the memory is freed
// when it returned true.
bool PinHost(void* p, size_t n, int device);
void UnpinHost(void* p, int device);

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_DEVICE_COPY_H_
