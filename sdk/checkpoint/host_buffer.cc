#include "sdk/checkpoint/host_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <new>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace oomguard::ckpt {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// Below this, the cache pollution an ordinary copy causes is not worth a
// second code path.
constexpr size_t kStreamMinBytes = size_t{64} << 10;

size_t PageSize() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

HostBuffer::HostBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  const size_t page = PageSize();
  mapped_ = (bytes + page - 1) / page * page;
  void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  p_ = static_cast<uint8_t*>(p);
#ifdef MADV_HUGEPAGE
  // 512 times fewer faults and TLB entries; the kernel may decline.
  if (mapped_ >= kHugePage) (void)::madvise(p, mapped_, MADV_HUGEPAGE);
#endif
}

HostBuffer::~HostBuffer() {
  if (p_ != nullptr) ::munmap(p_, mapped_);
}

HostBuffer::HostBuffer(HostBuffer&& o) noexcept : p_(o.p_), size_(o.size_), mapped_(o.mapped_) {
  o.p_ = nullptr;
  o.size_ = o.mapped_ = 0;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    if (p_ != nullptr) ::munmap(p_, mapped_);
    p_ = o.p_;
    size_ = o.size_;
    mapped_ = o.mapped_;
    o.p_ = nullptr;
    o.size_ = o.mapped_ = 0;
  }
  return *this;
}

void HostBuffer::Prefault() {
  if (p_ == nullptr) return;
#ifdef MADV_POPULATE_WRITE
  if (::madvise(p_, mapped_, MADV_POPULATE_WRITE) == 0) return;
#endif
  // Older kernels: one write per page.
  const size_t page = PageSize();
  for (size_t off = 0; off < mapped_; off += page) reinterpret_cast<volatile uint8_t*>(p_)[off] = 0;
}

void StreamCopy(void* dst, const void* src, size_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
#if defined(__SSE2__)
  if (n >= kStreamMinBytes) {
    const size_t head = (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    const size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; ++i, d += 64, s += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
    }
    // Streamed stores are weakly ordered: fence before anyone else reads them.
    _mm_sfence();
    n -= blocks * 64;
  }
#endif
  std::memcpy(d, s, n);
}

}  // namespace oomguard::ckpt
