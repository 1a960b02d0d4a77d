// HostBuffer and StreamCopy: the memory a save stages into, and the copy
// that fills it.
//
// A save's blocking part should cost what copying the bytes costs, and
// nothing else. Two things beside the copy showed up in it: page faults of
// freshly allocated staging buffers (a std::vector also zero-fills them, one
// more pass over the bytes), and the copy itself, which glibc's memcpy does
// with ordinary stores below its non-temporal threshold: every destination
// line is first read into the cache, then written back, and it evicts the
// training step's working set on the way. So staging buffers are one page-
// aligned anonymous mapping per staged state (transparent huge pages asked
// for), never initialised, faulted in ahead of use by the writer thread, and
// filled with non-temporal stores.
//
// Thread-safety: a HostBuffer is owned by one thread at a time; StreamCopy
// is a pure function.
#ifndef OOMGUARD_SDK_CHECKPOINT_HOST_BUFFER_H_
#define OOMGUARD_SDK_CHECKPOINT_HOST_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace oomguard::ckpt {

class HostBuffer {
 public:
  HostBuffer() = default;
  // `bytes` of page-aligned, uninitialised memory. Throws std::bad_alloc.
  explicit HostBuffer(size_t bytes);
  ~HostBuffer();
  HostBuffer(HostBuffer&& o) noexcept;
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  uint8_t* data() const { return p_; }
  size_t size() const { return size_; }
  // Makes every page resident and writable now, so that copies into the
  // buffer later take no page faults. Any thread; not while others write it.
  void Prefault();

 private:
  uint8_t* p_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
};

// Bytes of one staged entry: a run of a HostBuffer (tensors), or bytes of
// its own (an object's serialisation).
class StagedBytes {
 public:
  StagedBytes() = default;
  StagedBytes(uint8_t* p, size_t n) : p_(p), n_(n) {}
  explicit StagedBytes(std::vector<uint8_t> own) : own_(std::move(own)) {}
  uint8_t* data() { return p_ != nullptr ? p_ : own_.data(); }
  const uint8_t* data() const { return p_ != nullptr ? p_ : own_.data(); }
  size_t size() const { return p_ != nullptr ? n_ : own_.size(); }
  operator std::span<const uint8_t>() const { return {data(), size()}; }  // NOLINT: objects' load() takes a span

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
  std::vector<uint8_t> own_;
};

// memcpy with non-temporal stores for large copies (ordinary memcpy below
// a few pages, or when `dst` is not 16-byte aligned after the first bytes).
void StreamCopy(void* dst, const void* src, size_t n);

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_HOST_BUFFER_H_
