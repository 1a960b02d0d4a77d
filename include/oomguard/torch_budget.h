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
#include <mutex>
#include <unordered_map>

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
  void Install(int64_t budget_bytes);
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

 private:
  // One live block: the wrapped allocator's DataPtr (destroying it frees the
  // memory) and the bytes it counts for.
  struct Block {
    c10::DataPtr inner;
    int64_t bytes = 0;
  };
  // Allocations come from many threads at once: one lock per shard.
  struct Shard {
    std::mutex mu;
    std::unordered_map<void*, Block> blocks;
  };
  static constexpr size_t kShards = 16;

  BudgetCpuAllocator() = default;
  static void Delete(void* data);
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
};

}  // namespace oomguard::torch

#endif  // OOMGUARD_TORCH_BUDGET_H_
