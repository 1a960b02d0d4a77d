// BudgetCpuAllocator (oomguard/torch_budget.h): the budget check, the
// pointer table and the swap of torch's process-wide CPU allocator.
#include "oomguard/torch_budget.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

namespace oomguard::torch {
namespace {

std::string Mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

// The caching device's segment size (SimulatedDeviceOptions::segment_bytes):
// a large request gets a segment of its own rounded to it, as on CUDA.
constexpr int64_t kSegmentBytes = int64_t{2} << 20;

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

Device* BudgetCpuAllocator::device() const {
  return installed() ? device_.load(std::memory_order_acquire) : nullptr;
}

void* BudgetCpuAllocator::Place(Device* device, int64_t bytes) const {
  // The device's own capacity is the budget; memory held outside torch
  // lowers what torch may reserve. A placement that reserved past that gives
  // the cache back and tries once more, as the device itself does at its
  // capacity.
  const int64_t limit = budget() - held_bytes_.load(std::memory_order_relaxed);
  bool retried = false;
  for (;;) {
    void* p = nullptr;
    try {
      p = device->Allocate(static_cast<size_t>(bytes));
    } catch (const DeviceOomError&) {
      break;
    }
    if (device->Stats().reserved <= limit) return p;
    // Past the limit: the segment this placement made is given back too.
    device->Free(p);
    device->ReleaseCaches();
    if (retried) break;
    retries_.fetch_add(1, std::memory_order_relaxed);
    retried = true;
  }
  ooms_.fetch_add(1, std::memory_order_relaxed);
  const MemoryStats s = DeviceStats();
  // Worded as PyTorch (2.1 and later) words a device OOM, so that tools
  // reading messages take the same figures from it. Held memory stands for
  // another process's: it is not in this process's figure.
  TORCH_CHECK_WITH(OutOfMemoryError, false, "Budget device out of memory. Tried to allocate ", Mib(bytes),
                   ". Device budget:0 has a total capacity of ", Mib(s.total), " of which ", Mib(s.free),
                   " is free. Including non-PyTorch memory, this process has ", Mib(s.reserved),
                   " memory in use. Of the allocated memory ", Mib(s.allocated), " is allocated by PyTorch, and ",
                   Mib(s.reserved - s.allocated),
                   " is reserved by PyTorch but unallocated. (oomguard budget: a simulated caching allocator)");
  return nullptr;  // not reached: TORCH_CHECK_WITH threw
}

c10::DataPtr BudgetCpuAllocator::allocate(size_t n) const {
  const int64_t bytes = static_cast<int64_t>(n);
  Device* dev = device();
  // The caching device decides what fits; the plain budget counts bytes.
  const int64_t budget = installed() && dev == nullptr ? budget_.load(std::memory_order_relaxed) : 0;
  void* placed = dev != nullptr && bytes > 0 ? Place(dev, bytes) : nullptr;
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
    if (placed != nullptr) dev->Free(placed);
    throw;
  }
  void* data = inner.get();
  if (data == nullptr) {  // a zero-byte tensor: nothing to free, nothing to count
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    if (placed != nullptr) dev->Free(placed);
    return c10::DataPtr(nullptr, nullptr, &Delete, c10::Device(c10::DeviceType::CPU));
  }
  Block stale;
  {
    Shard& shard = ShardOf(data);
    std::lock_guard<std::mutex> lock(shard.mu);
    Block& block = shard.blocks[data];
    if (block.inner.get() != nullptr) {
      // The address is live again, so the block recorded here was freed by
      // another allocator's raw deleter (raw_deallocate after Uninstall):
      // forget it without freeing it a second time.
      stale = std::move(block);
    }
    block.inner = std::move(inner);
    block.bytes = bytes;
    block.device = dev;
    block.placed = placed;
  }
  if (stale.inner.get() != nullptr) {
    stale.inner.release_context();
    allocated_.fetch_sub(stale.bytes, std::memory_order_relaxed);
    if (stale.placed != nullptr) stale.device->Free(stale.placed);
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
    if (block.placed != nullptr) block.device->Free(block.placed);
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

void BudgetCpuAllocator::Install(int64_t budget_bytes, bool caching_device) {
  if (caching_device && budget_bytes <= 0)
    throw std::invalid_argument("a caching device needs a positive budget (its capacity)");
  set_budget(budget_bytes);
  {
    std::lock_guard<std::mutex> lock(device_mu_);
    Device* current = device_.load(std::memory_order_relaxed);
    const bool same = caching_device ? current != nullptr && current->Stats().total == budget_bytes : current == nullptr;
    if (!same) {
      Device* next = nullptr;
      if (caching_device) {
        SimulatedDeviceOptions options;
        options.capacity_bytes = budget_bytes;
        options.segment_bytes = kSegmentBytes;
        options.backing = false;  // bookkeeping only: torch's allocator holds the bytes
        auto made = MakeSimulatedDevice(options);
        if (!made.ok()) throw std::runtime_error(made.status().ToString());
        devices_.push_back(std::move(made).value());
        next = devices_.back().get();
      }
      held_.clear();  // what was held belonged to the device being replaced
      held_bytes_.store(0, std::memory_order_relaxed);
      device_.store(next, std::memory_order_release);
    }
  }
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
  std::lock_guard<std::mutex> lock(device_mu_);
  held_.clear();
  held_bytes_.store(0, std::memory_order_relaxed);
  device_.store(nullptr, std::memory_order_release);
}

bool BudgetCpuAllocator::caching_device() const { return device() != nullptr; }

MemoryStats BudgetCpuAllocator::DeviceStats() const {
  Device* dev = device();
  if (dev == nullptr) return MemoryStats{};
  MemoryStats s = dev->Stats();
  s.free = std::max<int64_t>(0, s.free - held_bytes_.load(std::memory_order_relaxed));
  s.num_alloc_retries += retries_.load(std::memory_order_relaxed);
  s.peak_allocated = peak();
  s.num_ooms = ooms();
  return s;
}

void BudgetCpuAllocator::ReleaseCaches() {
  if (Device* dev = device()) dev->ReleaseCaches();
}

int64_t BudgetCpuAllocator::Hold(int64_t bytes) {
  Device* dev = device();
  if (dev == nullptr) throw std::logic_error("Hold needs the budget installed as a caching device");
  if (bytes <= 0) throw std::invalid_argument("Hold needs a positive size");
  std::lock_guard<std::mutex> lock(device_mu_);
  // Another process gets only what torch has not reserved.
  const int64_t unreserved = budget() - dev->Stats().reserved - held_bytes_.load(std::memory_order_relaxed);
  if (bytes > unreserved) {
    ooms_.fetch_add(1, std::memory_order_relaxed);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "Budget device out of memory: cannot hold ", Mib(bytes),
                     " outside torch; ", Mib(std::max<int64_t>(unreserved, 0)), " of the ", Mib(budget()),
                     " capacity is neither reserved by torch nor held");
  }
  auto memory = std::make_unique<char[]>(static_cast<size_t>(bytes));
  std::memset(memory.get(), 1, static_cast<size_t>(bytes));  // resident, as the holder's data would be
  const int64_t handle = next_handle_++;
  held_.emplace(handle, HeldMemory{std::move(memory), bytes});
  held_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return handle;
}

void BudgetCpuAllocator::Release(int64_t handle) {
  std::lock_guard<std::mutex> lock(device_mu_);
  auto it = held_.find(handle);
  if (it == held_.end()) return;  // released already, or dropped with its device
  held_bytes_.fetch_sub(it->second.bytes, std::memory_order_relaxed);
  held_.erase(it);
}

int64_t BudgetCpuAllocator::held() const { return held_bytes_.load(std::memory_order_relaxed); }

}  // namespace oomguard::torch
