// The SDK's out-of-memory exception types and the memory figures they carry.
//
// These belong to the core, below every component that raises, records or
// catches them: fault injection throws them, devices throw DeviceOomError,
// incidents and the checkpointer's staging record MemoryStats, and the guard
// and the classifier catch them by type. device.h includes this header, so
// code that uses devices sees them there too.
//
// Thread-safety: values; the exception types are immutable after construction.
#ifndef OOMGUARD_OOM_ERROR_H_
#define OOMGUARD_OOM_ERROR_H_

#include <cstdint>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>

#include "oomguard/export.h"

namespace oomguard {

// A snapshot of a device's memory, in bytes (counts where noted). Names
// follow torch.cuda.memory_stats where they overlap.
struct MemoryStats {
  int64_t total = 0;              // capacity of the device (0: unknown/unlimited)
  int64_t free = 0;               // what the device could still hand out (capacity - reserved)
  int64_t allocated = 0;          // bytes in live allocations
  int64_t reserved = 0;           // bytes held by the allocator (live + cached)
  int64_t peak_allocated = 0;     // high-water mark of `allocated` since the last ResetPeak
  int64_t active = 0;             // bytes in active blocks (live allocations, rounded)
  int64_t inactive_split = 0;     // free bytes stranded in partly used segments (fragmentation)
  int64_t num_alloc_retries = 0;  // allocations that had to release caches and retry (count)
  int64_t num_ooms = 0;           // allocations that failed (count)
};

// What the training framework showed at an OOM beyond the memory figures:
// read off the failing frames and the live objects by a binding (the Python
// package, for torch) while the exception is still alive, and recorded with
// the incident for the classifier. Unknown unless a binding filled it.
struct FrameworkEvidence {
  // Tensors of the failing frames were recording autograd graphs (some carry
  // a grad_fn); nullopt: not known (no tensor of the frames could tell).
  std::optional<bool> grad_recording;
  // Bytes of live tensors outside the model that copy its state (same names
  // and shapes as its parameters and buffers, other storage): a loaded
  // checkpoint still alive beside the model. 0: none seen, or not looked for.
  int64_t state_copy_bytes = 0;

  bool known() const { return grad_recording.has_value() || state_copy_bytes > 0; }
};

// The SDK's own device out-of-memory error. Thrown by SimulatedDevice, by
// CudaDevice::Allocate and by fault injection; classified as kind "device" by
// type. Exported, so that catching it by type works across the library boundary.
class OOMGUARD_EXPORT DeviceOomError : public std::runtime_error {
 public:
  DeviceOomError(const std::string& what, int64_t requested_bytes, MemoryStats stats,
                 bool injected = false);
  int64_t requested_bytes() const { return requested_bytes_; }
  // The device's figures at the moment of failure.
  const MemoryStats& stats() const { return stats_; }
  // True when raised by fault injection rather than by a real allocation.
  bool injected() const { return injected_; }

 private:
  int64_t requested_bytes_;
  MemoryStats stats_;
  bool injected_;
};

// A host out-of-memory error that carries a message (std::bad_alloc cannot).
class OOMGUARD_EXPORT HostOomError : public std::bad_alloc {
 public:
  explicit HostOomError(std::string what, int64_t requested_bytes = 0);
  const char* what() const noexcept override { return what_.c_str(); }
  int64_t requested_bytes() const { return requested_bytes_; }

 private:
  std::string what_;
  int64_t requested_bytes_;
};

}  // namespace oomguard

#endif  // OOMGUARD_OOM_ERROR_H_
