// BudgetCpuAllocator: torch's CPU allocator with a byte budget, so that real
// tensor allocations fail with torch's own out-of-memory error
// (c10::OutOfMemoryError) on machines without a GPU: a real memory limit for
// libtorch programs in C++, for tests of a training loop under OOMs and for
// examples. Part of oomguard::torch (liboomguard_torch, CMake component
// `torch`); the Python module oomguard._budget has its own copy. Depends on
// libc10 only (no torch/torch.h).
//
//   oomguard::torch::BudgetCpuAllocator::Instance().Install(64 << 20);  // before the model is built
//   ... allocations beyond 64 MiB of live CPU tensors throw c10::OutOfMemoryError
//
// The budget counts the live bytes allocated through this allocator since it
// was installed; tensors that existed before keep their own deleters and are
// not counted. Allocation is delegated to the allocator that was installed
// before (torch's default CPU allocator), so alignment and behaviour are
// torch's own.
//
// Every DataPtr handed out has its data pointer as its context and one
// static deleter (raw_deleter()), as torch's default CPU allocator does.
// oneDNN (through ideep) allocates with Allocator::raw_allocate, which
// asserts exactly that, and frees with raw_deallocate, which needs the raw
// deleter. The size and the wrapped allocation of each live block are kept
// in a table keyed by the data pointer.
//
// Caching-device mode (Install(budget, /*caching_device=*/true)): the budget
// is also the capacity of a SimulatedDevice (include/oomguard/device.h,
// bookkeeping only) that every block is placed in, so the budget behaves as
// a GPU's caching allocator would: freed blocks stay reserved, requests are
// carved from cached segments, a request no cached block fits releases the
// free segments and retries, and free bytes stranded in partly used segments
// (fragmentation) can make a request fail below the budget. Its OOM is worded
// as PyTorch words a device OOM (capacity, free, allocated, reserved but
// unallocated). Hold() takes memory outside torch (real host memory) as
// another process sharing the device would: it comes out of the capacity
// that torch has not reserved (torch's cache is not given up for it), and
// torch's allocations then fit in the capacity less what is held, releasing
// cached segments and retrying once before they fail. The figures count it
// as neither allocated nor reserved, nor as this process's memory in use.
//
// Thread-safety: allocate and free run on any thread (autograd, data loader
// workers, intra-op pools); the table is sharded under mutexes and the
// counters are atomics. Install and Uninstall swap the process-wide allocator
// and must not race each other.
#ifndef OOMGUARD_TORCH_BUDGET_H_
#define OOMGUARD_TORCH_BUDGET_H_

#include <c10/core/Allocator.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "oomguard/device.h"

#include "oomguard/export.h"

namespace oomguard::torch {

class OOMGUARD_EXPORT BudgetCpuAllocator final : public c10::Allocator {
 public:
  // The process-wide instance. Leaked on purpose: tensors freed during
  // interpreter or static shutdown still call its deleter.
  static BudgetCpuAllocator& Instance();

  // Throws c10::OutOfMemoryError ("CPU out of memory (oomguard budget): Tried
  // to allocate ...") when the live bytes would pass a positive budget.
  // torch before 2.3 declares Allocator::allocate const, later releases do
  // not: both are defined (no `override`), and the one the base declares
  // overrides it, so one source builds against either.
  c10::DataPtr allocate(size_t n) const;
  c10::DataPtr allocate(size_t n) { return static_cast<const BudgetCpuAllocator&>(*this).allocate(n); }
  // Pure virtual from torch 2.3 on (a plain member before): blocks are host
  // memory, so a byte copy.
  void copy_data(void* dest, const void* src, std::size_t count) const;
  // Contexts equal data pointers, so the raw interface works (oneDNN uses it).
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

  // Routes torch CPU allocations through this allocator with `budget_bytes`
  // (0: unlimited, counting only). Calling it again only changes the budget.
  // caching_device: place blocks in a simulated caching device of
  // `budget_bytes` (see above; needs a positive budget). Switching the mode,
  // or a caching device's capacity, makes a new device: blocks alive stay
  // placed in the one they came from and do not count against the new one,
  // and memory held for the old one is dropped.
  void Install(int64_t budget_bytes, bool caching_device = false);
  // Restores the allocator that was installed before. Blocks still alive free
  // through this allocator's deleter, so this is safe with tensors alive.
  void Uninstall();
  bool installed() const { return installed_.load(std::memory_order_relaxed); }

  void set_budget(int64_t budget_bytes) { budget_.store(budget_bytes, std::memory_order_relaxed); }
  int64_t budget() const { return budget_.load(std::memory_order_relaxed); }
  // Live bytes allocated through the budget.
  int64_t allocated() const { return allocated_.load(std::memory_order_relaxed); }
  // High-water mark of allocated() since installation or ResetPeak.
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void ResetPeak() { peak_.store(allocated(), std::memory_order_relaxed); }
  // Allocations refused since the process started.
  int64_t ooms() const { return ooms_.load(std::memory_order_relaxed); }
  // Blocks alive that came through this allocator.
  int64_t live_blocks() const;

  // The caching device's figures (total: the budget; allocated and reserved:
  // torch's blocks; free: capacity neither reserved nor held). Zeros outside
  // caching-device mode.
  MemoryStats DeviceStats() const;
  bool caching_device() const;
  // Returns the caching device's free segments (torch.cuda.empty_cache).
  void ReleaseCaches();
  // Takes `bytes` of real host memory outside torch, counted against the
  // caching device's capacity as memory another process holds. Returns a
  // handle for Release. Throws c10::OutOfMemoryError when the capacity torch
  // has not reserved cannot hold it, std::logic_error outside caching-device
  // mode.
  int64_t Hold(int64_t bytes);
  void Release(int64_t handle);
  int64_t held() const;

 private:
  // One live block: the wrapped allocator's DataPtr (destroying it frees the
  // memory) and the bytes it counts for.
  struct Block {
    c10::DataPtr inner;
    int64_t bytes = 0;
    Device* device = nullptr;  // the caching device the block is placed in, if any
    void* placed = nullptr;    // its place there
  };
  // Allocations come from many threads at once: one lock per shard.
  struct Shard {
    std::mutex mu;
    std::unordered_map<void*, Block> blocks;
  };
  static constexpr size_t kShards = 16;

  BudgetCpuAllocator() = default;
  static void Delete(void* data);
  // Places `bytes` in the caching device; throws torch's OOM when it cannot.
  void* Place(Device* device, int64_t bytes) const;
  Device* device() const;
  Shard& ShardOf(void* data) const;
  void Free(void* data);

  // Counters are mutable: c10::Allocator::allocate is const.
  std::atomic<int64_t> budget_{0};
  mutable std::atomic<int64_t> allocated_{0};
  mutable std::atomic<int64_t> peak_{0};
  mutable std::atomic<int64_t> ooms_{0};
  mutable std::array<Shard, kShards> shards_;
  std::atomic<bool> installed_{false};
  // The allocator wrapped at the first Install, kept afterwards: a storage
  // keeps the allocator that made it and may allocate through it again
  // (resize_) after Uninstall; such blocks are counted but never refused.
  std::atomic<c10::Allocator*> inner_{nullptr};
  // Its raw deleter: frees a block that it raw-allocated before Install and
  // that is raw-deallocated through this allocator after it.
  std::atomic<c10::DeleterFnPtr> foreign_deleter_{nullptr};

  // Caching-device mode. Devices are never destroyed: a block placed in one
  // may be freed after the mode was switched off or replaced.
  mutable std::mutex device_mu_;  // guards what follows, device_ excepted
  std::atomic<Device*> device_{nullptr};  // the current one, nullptr outside the mode
  std::vector<std::unique_ptr<Device>> devices_;
  struct HeldMemory {
    std::unique_ptr<char[]> memory;
    int64_t bytes = 0;
  };
  std::unordered_map<int64_t, HeldMemory> held_;  // by handle
  std::atomic<int64_t> held_bytes_{0};
  mutable std::atomic<int64_t> retries_{0};  // retries after releasing the cache for held memory
  int64_t next_handle_ = 1;
};

}  // namespace oomguard::torch

#endif  // OOMGUARD_TORCH_BUDGET_H_
