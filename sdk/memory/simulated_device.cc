// SimulatedDevice: a capacity-limited model of a caching GPU allocator.
//
// The model follows PyTorch's CUDA caching allocator closely enough that the
// failure modes the guard must survive arise on their own:
//   - Requests are rounded up to round_bytes. Small requests (<= small_request
//     _bytes) are carved out of shared segments of segment_bytes; a larger
//     request gets a segment of its own, rounded up to segment_bytes. Small and
//     large segments form separate pools, as in PyTorch.
//   - Freed blocks stay reserved (cached) and coalesce with free neighbours of
//     the same segment. Allocation takes the best-fitting cached free block
//     (smallest that fits) of its pool and splits off the rest.
//   - When no cached block fits and a new segment would pass capacity, the
//     fully free segments are released and the allocation retried (counted in
//     num_alloc_retries); if it still does not fit, DeviceOomError.
// So freeing every other small block leaves free bytes stranded in segments
// that cannot be released (inactive_split), and a large request can fail
// although capacity - allocated would be enough: fragmentation.
//
// Thread-safety: one mutex guards all state; every public method takes it.
// Allocate and Free are O(log n) in the number of blocks.

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <unordered_map>

#include "oomguard/device.h"
#include "oomguard/status.h"
#include "sdk/core/format.h"

namespace oomguard {
namespace {

using internal::FormatBytesFixed2;

// Alignment of backing memory and of fake segment bases: what cudaMalloc gives.
constexpr size_t kSegmentAlignment = 256;
// Fake addresses (backing=false) start well above any real heap pointer a test
// could confuse them with, and segments are separated by a guard gap so that a
// pointer one past a segment never names a block of the next one.
constexpr uintptr_t kFakeAddressBase = uintptr_t{1} << 44;
constexpr uintptr_t kFakeAddressGap = uintptr_t{1} << 20;
constexpr uintptr_t kFakeAddressLimit = uintptr_t{1} << 62;


struct Segment;

// A contiguous range of one segment, either live (handed out) or free
// (cached). Blocks of a segment form a doubly linked list in address order
// that covers the whole segment; two free blocks are never adjacent.
struct Block {
  Segment* segment;
  int64_t offset;
  int64_t size;
  bool live = false;
  Block* prev = nullptr;
  Block* next = nullptr;
};

struct Segment {
  uint64_t id;  // creation order; breaks best-fit ties deterministically
  bool small;   // which pool it belongs to
  int64_t size;
  uintptr_t base;  // address of offset 0 (real or fake)
  void* memory;    // backing memory, or nullptr when backing=false
  int64_t live_blocks = 0;
  int64_t free_bytes = 0;
  Block* first = nullptr;
};

// Orders free blocks for best fit: smallest size first, then lowest address.
struct BySizeThenAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->size != b->size) return a->size < b->size;
    if (a->segment->id != b->segment->id) return a->segment->id < b->segment->id;
    return a->offset < b->offset;
  }
};

class SimulatedDevice final : public Device {
 public:
  explicit SimulatedDevice(const SimulatedDeviceOptions& options)
      : options_(options), name_("sim:" + std::to_string(options.index)) {}

  ~SimulatedDevice() override {
    // Blocks still live are the caller's leak; their memory goes with the device.
    for (auto& [id, segment] : segments_) DestroySegment(segment.get());
  }

  std::string Name() const override { return name_; }

  MemoryStats Stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return StatsLocked();
  }

  void ReleaseCaches() override {
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseFreeSegmentsLocked();
  }

  void ResetPeak() override {
    std::lock_guard<std::mutex> lock(mu_);
    peak_allocated_ = allocated_;
  }

  void* Allocate(size_t bytes) override;
  void Free(void* p) override;

 private:
  using FreeSet = std::set<Block*, BySizeThenAddress>;

  MemoryStats StatsLocked() const {
    MemoryStats s;
    if (options_.capacity_bytes > 0) {
      s.total = options_.capacity_bytes;
      s.free = options_.capacity_bytes - reserved_;
    }
    s.allocated = allocated_;
    s.reserved = reserved_;
    s.peak_allocated = peak_allocated_;
    s.active = allocated_;
    s.inactive_split = inactive_split_;
    s.num_alloc_retries = num_alloc_retries_;
    s.num_ooms = num_ooms_;
    return s;
  }

  FreeSet& PoolOf(bool small) { return small ? small_free_ : large_free_; }

  // inactive_split counts the free bytes of segments with a live block; these
  // two bracket every change to a segment so the sum stays exact in O(1).
  void Unaccount(const Segment* s) {
    if (s->live_blocks > 0) inactive_split_ -= s->free_bytes;
  }
  void Account(const Segment* s) {
    if (s->live_blocks > 0) inactive_split_ += s->free_bytes;
  }

  Block* TakeBestFitLocked(bool small, int64_t size);
  // `requested` is only for the error raised when no memory can back it.
  Segment* NewSegmentLocked(bool small, int64_t segment_size, int64_t requested);
  int64_t ReleaseFreeSegmentsLocked();
  void DestroySegment(Segment* s);
  // Counts the OOM and throws DeviceOomError; `reason` is for failures other
  // than the capacity (empty: the capacity).
  [[noreturn]] void ThrowOomLocked(int64_t requested, int64_t rounded, const std::string& reason = "");

  const SimulatedDeviceOptions options_;
  const std::string name_;

  mutable std::mutex mu_;
  // Segments by id, owned here. Blocks are owned by their segment's list.
  std::unordered_map<uint64_t, std::unique_ptr<Segment>> segments_;
  FreeSet small_free_;
  FreeSet large_free_;
  std::unordered_map<uintptr_t, Block*> live_;  // live blocks by address
  uint64_t next_segment_id_ = 0;
  uintptr_t next_fake_address_ = kFakeAddressBase;
  int64_t allocated_ = 0;
  int64_t reserved_ = 0;
  int64_t peak_allocated_ = 0;
  int64_t inactive_split_ = 0;
  int64_t num_alloc_retries_ = 0;
  int64_t num_ooms_ = 0;
};

Block* SimulatedDevice::TakeBestFitLocked(bool small, int64_t size) {
  FreeSet& pool = PoolOf(small);
  Segment key_segment{};
  key_segment.id = 0;
  Block key{&key_segment, 0, size};
  auto it = pool.lower_bound(&key);
  if (it == pool.end()) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

Segment* SimulatedDevice::NewSegmentLocked(bool small, int64_t segment_size, int64_t requested) {
  auto s = std::make_unique<Segment>();
  s->id = next_segment_id_++;
  s->small = small;
  s->size = segment_size;
  if (options_.backing) {
    s->memory =
        ::operator new (static_cast<size_t>(segment_size), std::align_val_t{kSegmentAlignment}, std::nothrow);
    if (s->memory == nullptr) {
      // device.h promises DeviceOomError from Allocate; the reason says that
      // the host, not the simulated capacity, ran out.
      ThrowOomLocked(requested, requested,
                     "the host memory backing the simulated device "
                     "ran out");
    }
    s->base = reinterpret_cast<uintptr_t>(s->memory);
  } else {
    s->memory = nullptr;
    uintptr_t span = static_cast<uintptr_t>(segment_size) + kFakeAddressGap;
    span = (span + kSegmentAlignment - 1) / kSegmentAlignment * kSegmentAlignment;
    if (span > kFakeAddressLimit - next_fake_address_) {
      // Only reachable with unlimited capacity and absurd sizes; fake
      // addresses must stay unique, so this is an OOM rather than a wrap.
      ThrowOomLocked(requested, requested, "the simulated address space is exhausted");
    }
    s->base = next_fake_address_;
    next_fake_address_ += span;
  }
  s->free_bytes = segment_size;
  s->first = new Block{s.get(), 0, segment_size};
  reserved_ += segment_size;
  Segment* raw = s.get();
  segments_.emplace(raw->id, std::move(s));
  return raw;
}

void SimulatedDevice::DestroySegment(Segment* s) {
  for (Block* b = s->first; b != nullptr;) {
    Block* next = b->next;
    delete b;
    b = next;
  }
  s->first = nullptr;
  if (s->memory != nullptr) {
    ::operator delete (s->memory, std::align_val_t{kSegmentAlignment});
    s->memory = nullptr;
  }
}

int64_t SimulatedDevice::ReleaseFreeSegmentsLocked() {
  int64_t released = 0;
  for (auto it = segments_.begin(); it != segments_.end();) {
    Segment* s = it->second.get();
    // Fully free: no live block, so (blocks never being adjacent free) exactly
    // one free block spans the segment.
    if (s->live_blocks == 0) {
      PoolOf(s->small).erase(s->first);
      reserved_ -= s->size;
      released += s->size;
      DestroySegment(s);
      it = segments_.erase(it);
    } else {
      ++it;
    }
  }
  return released;
}

void SimulatedDevice::ThrowOomLocked(int64_t requested, int64_t rounded, const std::string& reason) {
  ++num_ooms_;
  MemoryStats s = StatsLocked();
  std::string capacity = options_.capacity_bytes > 0 ? FormatBytesFixed2(options_.capacity_bytes) : "unlimited";
  std::string msg = name_ + " out of memory. Tried to allocate " + FormatBytesFixed2(rounded) +
                    " (simulated device capacity " + capacity + "; " + FormatBytesFixed2(s.allocated) +
                    " already allocated; " + FormatBytesFixed2(s.free) + " free; " + FormatBytesFixed2(s.reserved) +
                    " reserved in total; " + FormatBytesFixed2(s.reserved - s.allocated) +
                    " reserved but unallocated). If reserved but unallocated memory is large, "
                    "the memory is fragmented: release caches or use smaller requests.";
  if (!reason.empty()) msg += " Cause: " + reason + ".";
  throw DeviceOomError(msg, requested, s);
}

void* SimulatedDevice::Allocate(size_t bytes) {
  const int64_t round = options_.round_bytes;
  // Zero-byte requests still get a distinct address, as malloc(0) may.
  const uint64_t want = std::max<uint64_t>(bytes, 1);
  const uint64_t max_rounded = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / 2;
  std::lock_guard<std::mutex> lock(mu_);
  if (want > max_rounded) {
    ThrowOomLocked(static_cast<int64_t>(std::min<uint64_t>(bytes, INT64_MAX)),
                   static_cast<int64_t>(std::min<uint64_t>(bytes, INT64_MAX)));
  }
  const int64_t size = static_cast<int64_t>((want + round - 1) / round * round);
  const bool small = size <= options_.small_request_bytes;

  Block* block = TakeBestFitLocked(small, size);
  if (block == nullptr) {
    const int64_t seg_bytes = options_.segment_bytes;
    const int64_t segment_size = small ? seg_bytes : (size + seg_bytes - 1) / seg_bytes * seg_bytes;
    const int64_t cap = options_.capacity_bytes;
    if (cap > 0 && reserved_ + segment_size > cap) {
      // As PyTorch: give the cache back and try once more before failing.
      ++num_alloc_retries_;
      ReleaseFreeSegmentsLocked();
      if (reserved_ + segment_size > cap) ThrowOomLocked(static_cast<int64_t>(bytes), size);
    }
    block = NewSegmentLocked(small, segment_size, static_cast<int64_t>(bytes))->first;
  }

  Segment* seg = block->segment;
  Unaccount(seg);
  if (block->size > size) {
    // Split: the tail stays cached in the same pool.
    Block* rest = new Block{seg, block->offset + size, block->size - size};
    rest->prev = block;
    rest->next = block->next;
    if (block->next != nullptr) block->next->prev = rest;
    block->next = rest;
    block->size = size;
    PoolOf(seg->small).insert(rest);
  }
  block->live = true;
  ++seg->live_blocks;
  seg->free_bytes -= size;
  Account(seg);

  allocated_ += size;
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  const uintptr_t addr = seg->base + static_cast<uintptr_t>(block->offset);
  live_.emplace(addr, block);
  return reinterpret_cast<void*>(addr);
}

void SimulatedDevice::Free(void* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(p));
  if (it == live_.end()) {
    // A double free or a foreign pointer is a bug in the caller; carrying on
    // would corrupt the accounting the guard's decisions rest on.
    std::fprintf(stderr,
                 "oomguard: %s: Free(%p) of a pointer that this device did not allocate or "
                 "that was already freed\n",
                 name_.c_str(), p);
    std::abort();
  }
  Block* b = it->second;
  live_.erase(it);
  Segment* seg = b->segment;
  FreeSet& pool = PoolOf(seg->small);

  Unaccount(seg);
  b->live = false;
  --seg->live_blocks;
  seg->free_bytes += b->size;
  allocated_ -= b->size;

  if (Block* prev = b->prev; prev != nullptr && !prev->live) {
    pool.erase(prev);
    prev->size += b->size;
    prev->next = b->next;
    if (b->next != nullptr) b->next->prev = prev;
    delete b;
    b = prev;
  }
  if (Block* next = b->next; next != nullptr && !next->live) {
    pool.erase(next);
    b->size += next->size;
    b->next = next->next;
    if (next->next != nullptr) next->next->prev = b;
    delete next;
  }
  pool.insert(b);
  Account(seg);
}

std::string FieldError(const char* field, const char* requirement, int64_t value) {
  return std::string("SimulatedDeviceOptions.") + field + " must be " + requirement + " (got " +
         std::to_string(value) + ")";
}

Status Validate(const SimulatedDeviceOptions& o) {
  if (o.capacity_bytes < 0) {
    return Status::InvalidArgument(FieldError("capacity_bytes", ">= 0 (0: unlimited)", o.capacity_bytes));
  }
  if (o.segment_bytes <= 0) {
    return Status::InvalidArgument(FieldError("segment_bytes", "> 0", o.segment_bytes));
  }
  if (o.round_bytes <= 0) {
    return Status::InvalidArgument(FieldError("round_bytes", "> 0", o.round_bytes));
  }
  if (o.segment_bytes % o.round_bytes != 0) {
    return Status::InvalidArgument(
        FieldError("round_bytes", ("a divisor of segment_bytes=" + std::to_string(o.segment_bytes)).c_str(),
                   o.round_bytes));
  }
  if (o.small_request_bytes < 0) {
    return Status::InvalidArgument(FieldError("small_request_bytes", ">= 0", o.small_request_bytes));
  }
  if (o.small_request_bytes > o.segment_bytes) {
    return Status::InvalidArgument(FieldError("small_request_bytes",
                                              ("<= segment_bytes=" + std::to_string(o.segment_bytes)).c_str(),
                                              o.small_request_bytes));
  }
  if (o.index < 0) {
    return Status::InvalidArgument(FieldError("index", ">= 0", o.index));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Device>> MakeSimulatedDevice(const SimulatedDeviceOptions& options) {
  OOMGUARD_RETURN_IF_ERROR(Validate(options));
  return std::unique_ptr<Device>(std::make_unique<SimulatedDevice>(options));
}

}  // namespace oomguard
