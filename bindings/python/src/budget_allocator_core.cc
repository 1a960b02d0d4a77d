#include "budget_allocator_core.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <utility>

namespace oomguard_budget {
namespace {

std::string Mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

// The wrapped allocation and its size, owned by the DataPtr's context so that
// the deleter knows what to give back and to whom.
struct Block {
  c10::DataPtr inner;
  int64_t bytes;
  std::atomic<int64_t>* allocated;
};

}  // namespace

BudgetCpuAllocator& BudgetCpuAllocator::Instance() {
  static auto* allocator = new BudgetCpuAllocator;
  return *allocator;
}

c10::DataPtr BudgetCpuAllocator::allocate(size_t n) const {
  const int64_t bytes = static_cast<int64_t>(n);
  const int64_t budget = budget_.load(std::memory_order_relaxed);
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
    inner = inner_->allocate(n);
  } catch (...) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    throw;
  }
  void* data = inner.get();
  auto* block = new Block{std::move(inner), bytes, &allocated_};
  return c10::DataPtr(data, block, &Delete, c10::Device(c10::DeviceType::CPU));
}

void BudgetCpuAllocator::Delete(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  block->allocated->fetch_sub(block->bytes, std::memory_order_relaxed);
  delete block;  // frees through the wrapped allocator's deleter
}

void BudgetCpuAllocator::Install(int64_t budget_bytes) {
  if (inner_ == nullptr) {
    inner_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this, /*priority=*/0);
  }
  set_budget(budget_bytes);
}

void BudgetCpuAllocator::Uninstall() {
  if (inner_ == nullptr) return;
  c10::SetCPUAllocator(inner_, /*priority=*/0);
  inner_ = nullptr;
}

}  // namespace oomguard_budget
