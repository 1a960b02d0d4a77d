#include "sdk/checkpoint/zstd_filter.h"

#include <zstd.h>

namespace oomguard::ckpt {
namespace {

// HDF5 owns the buffer: it is replaced with one from H5allocate_memory and
// the old one released with H5free_memory, as the filter ABI requires.
// Returns the new valid size, or 0 on failure (HDF5 then fails the I/O).
size_t ZstdFilter(unsigned int flags, size_t cd_nelmts, const unsigned int cd_values[], size_t nbytes,
                  size_t* buf_size, void** buf) {
  if ((flags & H5Z_FLAG_REVERSE) != 0) {
    unsigned long long size = ZSTD_getFrameContentSize(*buf, nbytes);
    if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) return 0;
    void* out = H5allocate_memory(size, false);
    if (out == nullptr) return 0;
    size_t n = ZSTD_decompress(out, size, *buf, nbytes);
    if (ZSTD_isError(n) || n != size) {
      H5free_memory(out);
      return 0;
    }
    H5free_memory(*buf);
    *buf = out;
    *buf_size = size;
    return n;
  }
  int level = cd_nelmts > 0 ? static_cast<int>(cd_values[0]) : 3;
  size_t bound = ZSTD_compressBound(nbytes);
  void* out = H5allocate_memory(bound, false);
  if (out == nullptr) return 0;
  size_t n = ZSTD_compress(out, bound, *buf, nbytes, level);
  if (ZSTD_isError(n)) {
    H5free_memory(out);
    return 0;
  }
  H5free_memory(*buf);
  *buf = out;
  *buf_size = bound;
  return n;
}

const H5Z_class2_t kClass = {
    H5Z_CLASS_T_VERS, kZstdFilter, 1, 1, "zstd (oomguard)", nullptr, nullptr, ZstdFilter,
};

}  // namespace

const H5Z_class2_t* ZstdFilterClass() { return &kClass; }

}  // namespace oomguard::ckpt
