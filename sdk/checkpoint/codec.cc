#include "sdk/checkpoint/codec.h"

#include <zstd.h>

#include <cstring>

namespace oomguard::ckpt {

namespace {

// Element sizes known at compile time let the compiler unroll the byte
// scatter; blocks of elements keep both sides of the transpose in cache.
// kShuffle: element-major -> byte-plane-major (HDF5's shuffle); else the inverse.
template <bool kShuffle, size_t N>
void TransposeFixed(const uint8_t* in, uint8_t* out, size_t n) {
  constexpr size_t kBlock = 256;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = b + kBlock < n ? b + kBlock : n;
    for (size_t j = 0; j < N; ++j) {
      for (size_t i = b; i < e; ++i) {
        if constexpr (kShuffle) {
          out[j * n + i] = in[i * N + j];
        } else {
          out[i * N + j] = in[j * n + i];
        }
      }
    }
  }
}

template <bool kShuffle>
void Transpose(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size) {
  if (elem_size <= 1) {
    std::memcpy(out, in, bytes);
    return;
  }
  const size_t n = bytes / elem_size;
  switch (elem_size) {
    case 2:
      TransposeFixed<kShuffle, 2>(in, out, n);
      break;
    case 4:
      TransposeFixed<kShuffle, 4>(in, out, n);
      break;
    case 8:
      TransposeFixed<kShuffle, 8>(in, out, n);
      break;
    default:
      for (size_t i = 0; i < n; ++i)
        for (size_t j = 0; j < elem_size; ++j) {
          if constexpr (kShuffle) {
            out[j * n + i] = in[i * elem_size + j];
          } else {
            out[i * elem_size + j] = in[j * n + i];
          }
        }
  }
  // Bytes past the last whole element are not shuffled (as HDF5 does).
  const size_t done = n * elem_size;
  std::memcpy(out + done, in + done, bytes - done);
}

}  // namespace

void Shuffle(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size) {
  Transpose<true>(in, out, bytes, elem_size);
}

void Unshuffle(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size) {
  Transpose<false>(in, out, bytes, elem_size);
}

std::vector<uint8_t> EncodeChunk(const uint8_t* data, size_t bytes, size_t elem_size, int level,
                                 std::vector<uint8_t>* scratch) {
  scratch->resize(bytes);
  Shuffle(data, scratch->data(), bytes, elem_size);
  std::vector<uint8_t> out(ZSTD_compressBound(bytes));
  // ZSTD_compress writes the content size into the frame header, which the
  // plugin's decoder relies on to size its output.
  size_t n = ZSTD_compress(out.data(), out.size(), scratch->data(), bytes, level);
  if (ZSTD_isError(n)) return {};
  out.resize(n);
  return out;
}

std::string DecodeChunk(const uint8_t* frame, size_t frame_bytes, size_t elem_size, uint8_t* out,
                        size_t out_bytes, std::vector<uint8_t>* scratch) {
  unsigned long long size = ZSTD_getFrameContentSize(frame, frame_bytes);
  if (size == ZSTD_CONTENTSIZE_ERROR) return "not a zstd frame";
  if (size == ZSTD_CONTENTSIZE_UNKNOWN) return "zstd frame without a content size";
  if (size != out_bytes)
    return "zstd frame holds " + std::to_string(size) + " bytes, expected " + std::to_string(out_bytes);
  scratch->resize(out_bytes);
  size_t n = ZSTD_decompress(scratch->data(), out_bytes, frame, frame_bytes);
  if (ZSTD_isError(n)) return std::string("zstd: ") + ZSTD_getErrorName(n);
  if (n != out_bytes) return "zstd frame decoded to " + std::to_string(n) + " bytes";
  Unshuffle(scratch->data(), out, out_bytes, elem_size);
  return "";
}

std::string Hex64(uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = digits[v & 0xf];
  return s;
}

}  // namespace oomguard::ckpt
