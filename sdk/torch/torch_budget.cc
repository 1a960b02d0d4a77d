// BudgetCpuAllocator (oomguard/torch_budget.h): the budget check, the
// pointer table and the swap of torch's process-wide CPU allocator.
#include "oomguard/torch_budget.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

namespace oomguard::torch {
namespace {

std::string Mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

BudgetCpuAllocator& BudgetCpuAllocator::Instance() {
  static auto* allocator = new BudgetCpuAllocator;
  return *allocator;
}

BudgetCpuAllocator::Shard& BudgetCpuAllocator::ShardOf(void* data) const {
  // Allocations are at least 16-byte aligned: the low bits carry no information.
  return shards_[(std::hash<void*>{}(data) >> 6) % kShards];
}

void BudgetCpuAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  if (count > 0) std::memcpy(dest, src, count);
}

c10::DataPtr BudgetCpuAllocator::allocate(size_t n) const {
  const int64_t bytes = static_cast<int64_t>(n);
  const int64_t budget = installed() ? budget_.load(std::memory_order_relaxed) : 0;
  // Reserve first, then check: concurrent allocations cannot overshoot together.
  const int64_t now = allocated_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (budget > 0 && now > budget) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    ooms_.fetch_add(1, std::memory_order_relaxed);
    // Worded as torch words CPU OOMs, so message-based tools agree: "CPU" and
    // "Tried to allocate <size>", never "device".
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory (oomguard budget): Tried to allocate ",
                     Mib(bytes), " (", bytes, " bytes); ", Mib(now - bytes), " already allocated of a ",
                     Mib(budget), " budget");
  }
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  c10::DataPtr inner;
  try {
    inner = inner_.load(std::memory_order_relaxed)->allocate(n);
  } catch (...) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    throw;
  }
  void* data = inner.get();
  if (data == nullptr) {  // a zero-byte tensor: nothing to free, nothing to count
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    return c10::DataPtr(nullptr, nullptr, &Delete, c10::Device(c10::DeviceType::CPU));
  }
  c10::DataPtr stale;
  int64_t stale_bytes = 0;
  {
    Shard& shard = ShardOf(data);
    std::lock_guard<std::mutex> lock(shard.mu);
    Block& block = shard.blocks[data];
    if (block.inner.get() != nullptr) {
      // The address is live again, so the block recorded here was freed by
      // another allocator's raw deleter (raw_deallocate after Uninstall):
      // forget it without freeing it a second time.
      stale = std::move(block.inner);
      stale_bytes = block.bytes;
    }
    block.inner = std::move(inner);
    block.bytes = bytes;
  }
  if (stale.get() != nullptr) {
    stale.release_context();
    allocated_.fetch_sub(stale_bytes, std::memory_order_relaxed);
  }
  return c10::DataPtr(data, data, &Delete, c10::Device(c10::DeviceType::CPU));
}

void BudgetCpuAllocator::Delete(void* data) { Instance().Free(data); }

void BudgetCpuAllocator::Free(void* data) {
  if (data == nullptr) return;
  Block block;
  bool found = false;
  {
    Shard& shard = ShardOf(data);
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.blocks.find(data);
    if (it != shard.blocks.end()) {
      block = std::move(it->second);
      shard.blocks.erase(it);
      found = true;
    }
  }
  if (found) {
    allocated_.fetch_sub(block.bytes, std::memory_order_relaxed);
    return;  // `block.inner` frees through the wrapped allocator, outside the lock
  }
  // Not ours: raw-allocated by the wrapped allocator before Install and
  // raw-deallocated through this one after it.
  if (c10::DeleterFnPtr foreign = foreign_deleter_.load(std::memory_order_relaxed)) foreign(data);
}

int64_t BudgetCpuAllocator::live_blocks() const {
  int64_t n = 0;
  for (Shard& shard : shards_) {
    std::lock_guard<std::mutex> lock(shard.mu);
    n += static_cast<int64_t>(shard.blocks.size());
  }
  return n;
}

void BudgetCpuAllocator::Install(int64_t budget_bytes) {
  set_budget(budget_bytes);
  if (installed()) return;
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != this) {
    inner_.store(current, std::memory_order_relaxed);
    foreign_deleter_.store(current->raw_deleter(), std::memory_order_relaxed);
  }
  installed_.store(true, std::memory_order_relaxed);
  c10::SetCPUAllocator(this, /*priority=*/0);
}

void BudgetCpuAllocator::Uninstall() {
  if (!installed()) return;
  installed_.store(false, std::memory_order_relaxed);
  c10::SetCPUAllocator(inner_.load(std::memory_order_relaxed), /*priority=*/0);
}

}  // namespace oomguard::torch
