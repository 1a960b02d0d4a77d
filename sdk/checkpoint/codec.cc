#include "sdk/checkpoint/codec.h"

#include <zstd.h>

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include "sdk/checkpoint/xxh.h"

namespace oomguard::ckpt {

namespace {

// Scalar transpose, for element sizes without a vector path and for the
// elements after the last whole block of 16. Blocks of elements keep both
// sides in cache. kShuffle: element-major -> byte-plane-major (HDF5's
// shuffle); else the inverse. Elements [first, last) of a chunk of n elements.
template <bool kShuffle>
void TransposeScalar(const uint8_t* in, uint8_t* out, size_t n, size_t elem_size, size_t first, size_t last) {
  constexpr size_t kBlock = 256;
  for (size_t b = first; b < last; b += kBlock) {
    const size_t e = b + kBlock < last ? b + kBlock : last;
    for (size_t j = 0; j < elem_size; ++j) {
      for (size_t i = b; i < e; ++i) {
        if constexpr (kShuffle) {
          out[j * n + i] = in[i * elem_size + j];
        } else {
          out[i * elem_size + j] = in[j * n + i];
        }
      }
    }
  }
}

#if defined(__SSE2__)
// Vector transpose of blocks of 16 elements of N bytes (N = 2, 4, 8), held
// in N registers of 16 bytes. Number the block's bytes with log2(16 N) bits:
// the top log2(N) bits pick the register, the low 4 the byte in it. One
// round pairs register i with register i + N/2 and interleaves them bytewise
// (unpacklo into 2i, unpackhi into 2i + 1): that rotates every byte's index
// left by one bit. Element-major order is (element:4, byte:log2 N) and
// plane-major order is (byte:log2 N, element:4), so shuffling is 4 rounds
// and unshuffling is log2(N) rounds; both end with register k holding the
// k-th group of 16 bytes of the target order.
template <size_t N>
inline void InterleaveRound(__m128i* v) {
  __m128i t[N];
  for (size_t i = 0; i < N / 2; ++i) {
    t[2 * i] = _mm_unpacklo_epi8(v[i], v[i + N / 2]);
    t[2 * i + 1] = _mm_unpackhi_epi8(v[i], v[i + N / 2]);
  }
  for (size_t i = 0; i < N; ++i) v[i] = t[i];
}

constexpr size_t kStreamMinBytes = size_t{256} << 10;

template <size_t N>
constexpr int Log2() {
  return N == 2 ? 1 : N == 4 ? 2 : 3;
}

// Elements [16 * b0, 16 * b1) of a chunk of n elements, in whole blocks of
// 16. `stream`: unshuffle with non-temporal stores (the output must be
// 16-byte aligned).
template <bool kShuffle, size_t N>
void TransposeVector(const uint8_t* in, uint8_t* out, size_t n, size_t b0, size_t b1, bool stream) {
  __m128i v[N];
  for (size_t b = b0; b < b1; ++b) {
    if constexpr (kShuffle) {
      const uint8_t* src = in + b * 16 * N;
      for (size_t k = 0; k < N; ++k) v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * k));
      for (int r = 0; r < 4; ++r) InterleaveRound<N>(v);
      for (size_t k = 0; k < N; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k * n + b * 16), v[k]);
    } else {
      for (size_t k = 0; k < N; ++k)
        v[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + k * n + b * 16));
      for (int r = 0; r < Log2<N>(); ++r) InterleaveRound<N>(v);
      uint8_t* dst = out + b * 16 * N;
      if (stream) {
        for (size_t k = 0; k < N; ++k) _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16 * k), v[k]);
      } else {
        for (size_t k = 0; k < N; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * k), v[k]);
      }
    }
  }
  if (stream) _mm_sfence();
}
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define OOMGUARD_CODEC_AVX2 1
// Unshuffling with AVX2, for CPUs that have it (the build targets baseline
// x86-64): `blocks` blocks of 32 elements of N = 2 or 4 bytes from element
// `first`. The SSE2 rounds above, run in both 128-bit lanes at once, leave
// elements 0-7 | 16-23 and 8-15 | 24-31 in lane pairs (N = 2; quarters
// for N = 4); a lane permute puts them in order. About twice SSE2's speed.
template <size_t N>
__attribute__((target("avx2"))) void UnshuffleAvx2(const uint8_t* in, uint8_t* out, size_t n, size_t first,
                                                   size_t blocks) {
  static_assert(N == 2 || N == 4);
  // (No lambdas: they would not inherit the target attribute.)
  for (size_t k = 0; k < blocks; ++k) {
    const size_t e = first + 32 * k;
    const uint8_t* src = in + e;
    __m256i* dst = reinterpret_cast<__m256i*>(out + e * N);
    if constexpr (N == 2) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + n));
      const __m256i lo = _mm256_unpacklo_epi8(a, b);  // elements 0-7 | 16-23
      const __m256i hi = _mm256_unpackhi_epi8(a, b);  // elements 8-15 | 24-31
      _mm256_storeu_si256(dst, _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(dst + 1, _mm256_permute2x128_si256(lo, hi, 0x31));
    } else {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + n));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * n));
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 3 * n));
      const __m256i ab_lo = _mm256_unpacklo_epi8(a, b), ab_hi = _mm256_unpackhi_epi8(a, b);
      const __m256i cd_lo = _mm256_unpacklo_epi8(c, d), cd_hi = _mm256_unpackhi_epi8(c, d);
      const __m256i r0 = _mm256_unpacklo_epi16(ab_lo, cd_lo);  // elements 0-3 | 16-19
      const __m256i r1 = _mm256_unpackhi_epi16(ab_lo, cd_lo);  // 4-7 | 20-23
      const __m256i r2 = _mm256_unpacklo_epi16(ab_hi, cd_hi);  // 8-11 | 24-27
      const __m256i r3 = _mm256_unpackhi_epi16(ab_hi, cd_hi);  // 12-15 | 28-31
      _mm256_storeu_si256(dst, _mm256_permute2x128_si256(r0, r1, 0x20));
      _mm256_storeu_si256(dst + 1, _mm256_permute2x128_si256(r2, r3, 0x20));
      _mm256_storeu_si256(dst + 2, _mm256_permute2x128_si256(r0, r1, 0x31));
      _mm256_storeu_si256(dst + 3, _mm256_permute2x128_si256(r2, r3, 0x31));
    }
  }
}

bool CpuHasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

// Elements [first, last) of a chunk of n elements; `first` is a multiple of 16.
template <bool kShuffle>
void TransposeRange(const uint8_t* in, uint8_t* out, size_t n, size_t elem_size, size_t first, size_t last,
                    bool stream) {
#if defined(OOMGUARD_CODEC_AVX2)
  // Unshuffle into cached memory (the streaming stores stay SSE2).
  if (!kShuffle && !stream && (elem_size == 2 || elem_size == 4) && last > first && CpuHasAvx2()) {
    const size_t blocks = (last - first) / 32;
    if (elem_size == 2) UnshuffleAvx2<2>(in, out, n, first, blocks);
    if (elem_size == 4) UnshuffleAvx2<4>(in, out, n, first, blocks);
    first += 32 * blocks;
  }
#endif
  size_t done = first;
#if defined(__SSE2__)
  const size_t b0 = first / 16, b1 = last / 16;
  if (elem_size == 2 || elem_size == 4 || elem_size == 8) {
    if (elem_size == 2) TransposeVector<kShuffle, 2>(in, out, n, b0, b1, stream);
    if (elem_size == 4) TransposeVector<kShuffle, 4>(in, out, n, b0, b1, stream);
    if (elem_size == 8) TransposeVector<kShuffle, 8>(in, out, n, b0, b1, stream);
    done = b1 * 16 > first ? b1 * 16 : first;
  }
#else
  (void)stream;
#endif
  TransposeScalar<kShuffle>(in, out, n, elem_size, done, last);
}

template <bool kShuffle>
void Transpose(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size) {
  if (elem_size <= 1) {
    std::memcpy(out, in, bytes);
    return;
  }
  const size_t n = bytes / elem_size;
#if defined(__SSE2__)
  // Unshuffling writes a loaded tensor, which nobody reads again soon but
  // the in-order hash: large outputs bypass the cache instead of first
  // reading every line they overwrite (about 17% faster for unshuffle +
  // hash of 1 GiB on the reference machine).
  const bool stream = !kShuffle && bytes >= kStreamMinBytes && reinterpret_cast<uintptr_t>(out) % 16 == 0;
#else
  const bool stream = false;
#endif
  TransposeRange<kShuffle>(in, out, n, elem_size, 0, n, stream);
  // Bytes past the last whole element are not shuffled (as HDF5 does).
  const size_t whole = n * elem_size;
  std::memcpy(out + whole, in + whole, bytes - whole);
}

}  // namespace

void Shuffle(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size) {
  Transpose<true>(in, out, bytes, elem_size);
}

void Unshuffle(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size) {
  Transpose<false>(in, out, bytes, elem_size);
}

namespace {

// One compression and one decompression context per thread, reused across
// chunks: ZSTD_compress would allocate and initialise a fresh one per call.
struct ZstdContexts {
  ZstdContexts() : c(ZSTD_createCCtx()), d(ZSTD_createDCtx()) {}
  ~ZstdContexts() {
    ZSTD_freeCCtx(c);
    ZSTD_freeDCtx(d);
  }
  ZSTD_CCtx* c;
  ZSTD_DCtx* d;
};

ZstdContexts& Contexts() {
  thread_local ZstdContexts ctx;
  return ctx;
}

}  // namespace

size_t EncodeBound(size_t bytes) { return ZSTD_compressBound(bytes); }

size_t EncodeChunkInto(const uint8_t* data, size_t bytes, size_t elem_size, int level, bool floating_point,
                       std::vector<uint8_t>* scratch, uint8_t* out, size_t capacity) {
  scratch->resize(bytes);
  Shuffle(data, scratch->data(), bytes, elem_size);
  ZSTD_CCtx* c = Contexts().c;
  ZSTD_CCtx_reset(c, ZSTD_reset_session_and_parameters);
  ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level);
  // The frame header records the content size, which the plugin's decoder
  // relies on to size its output (this is zstd's default; set for clarity).
  ZSTD_CCtx_setParameter(c, ZSTD_c_contentSizeFlag, 1);
  if (floating_point && level <= kFloatTunedMaxLevel) {
    // Shuffled floats are a few compressible planes (sign and exponent)
    // next to mantissa planes of near-random bytes. What they gain comes
    // from entropy-coding the literals (with matches off, at negative
    // levels, the ratio falls to 1.000); the match finder mostly pays for
    // short, useless matches. zstd's smallest hash table with 7-byte
    // minimum matches more than halves the time and keeps (slightly
    // improves) the ratio; see docs/checkpoints.md for the figures.
    ZSTD_CCtx_setParameter(c, ZSTD_c_hashLog, 6);
    ZSTD_CCtx_setParameter(c, ZSTD_c_minMatch, 7);
  }
  size_t n = ZSTD_compress2(c, out, capacity, scratch->data(), bytes);
  return ZSTD_isError(n) ? 0 : n;
}

std::vector<uint8_t> EncodeChunk(const uint8_t* data, size_t bytes, size_t elem_size, int level,
                                 std::vector<uint8_t>* scratch, bool floating_point) {
  std::vector<uint8_t> out(EncodeBound(bytes));
  size_t n = EncodeChunkInto(data, bytes, elem_size, level, floating_point, scratch, out.data(), out.size());
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
  size_t n = ZSTD_decompressDCtx(Contexts().d, scratch->data(), out_bytes, frame, frame_bytes);
  if (ZSTD_isError(n)) return std::string("zstd: ") + ZSTD_getErrorName(n);
  if (n != out_bytes) return "zstd frame decoded to " + std::to_string(n) + " bytes";
  Unshuffle(scratch->data(), out, out_bytes, elem_size);
  return "";
}

namespace {

// Output bytes unshuffled and hashed at a time: small enough that the hash
// reads them from L1, large enough that the per-call costs vanish.
constexpr size_t kHashBlockBytes = size_t{16} << 10;

// One XXH3 state per thread (64-byte aligned, as XXH3 wants).
XXH3_state_t* ThreadHashState() {
  struct State {
    State() : s(XXH3_createState()) {}
    ~State() { XXH3_freeState(s); }
    XXH3_state_t* s;
  };
  thread_local State state;
  return state.s;
}

}  // namespace

uint64_t CopyHashed(const uint8_t* in, uint8_t* out, size_t bytes) {
  XXH3_state_t* h = ThreadHashState();
  XXH3_64bits_reset(h);
  for (size_t off = 0; off < bytes; off += kHashBlockBytes) {
    const size_t n = bytes - off < kHashBlockBytes ? bytes - off : kHashBlockBytes;
    std::memcpy(out + off, in + off, n);
    XXH3_64bits_update(h, out + off, n);
  }
  return XXH3_64bits_digest(h);
}

uint64_t UnshuffleHashed(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size, size_t keep) {
  if (elem_size <= 1) return CopyHashed(in, out, keep);
  if (bytes % elem_size != 0 || keep % elem_size != 0) {
    // Not whole elements (no writer makes such a chunk): whole, then copied.
    std::vector<uint8_t> whole(bytes);
    Unshuffle(in, whole.data(), bytes, elem_size);
    return CopyHashed(whole.data(), out, keep);
  }
  XXH3_state_t* h = ThreadHashState();
  XXH3_64bits_reset(h);
  const size_t n = bytes / elem_size;
  const size_t last = keep / elem_size;
  // A multiple of 16 elements, as TransposeRange wants its starts.
  const size_t step = (kHashBlockBytes / elem_size) / 16 * 16;
  for (size_t e0 = 0; e0 < last; e0 += step) {
    const size_t e1 = e0 + step < last ? e0 + step : last;
    TransposeRange<false>(in, out, n, elem_size, e0, e1, /*stream=*/false);
    XXH3_64bits_update(h, out + e0 * elem_size, (e1 - e0) * elem_size);
  }
  return XXH3_64bits_digest(h);
}

std::string DecodeChunkHashed(const uint8_t* frame, size_t frame_bytes, size_t elem_size, uint8_t* out,
                              size_t chunk_bytes, size_t keep, std::vector<uint8_t>* scratch,
                              uint64_t* hash) {
  unsigned long long size = ZSTD_getFrameContentSize(frame, frame_bytes);
  if (size == ZSTD_CONTENTSIZE_ERROR) return "not a zstd frame";
  if (size == ZSTD_CONTENTSIZE_UNKNOWN) return "zstd frame without a content size";
  if (size != chunk_bytes)
    return "zstd frame holds " + std::to_string(size) + " bytes, expected " + std::to_string(chunk_bytes);
  scratch->resize(chunk_bytes);
  size_t n = ZSTD_decompressDCtx(Contexts().d, scratch->data(), chunk_bytes, frame, frame_bytes);
  if (ZSTD_isError(n)) return std::string("zstd: ") + ZSTD_getErrorName(n);
  if (n != chunk_bytes) return "zstd frame decoded to " + std::to_string(n) + " bytes";
  *hash = UnshuffleHashed(scratch->data(), out, chunk_bytes, elem_size, keep);
  return "";
}

std::string Hex64(uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = digits[v & 0xf];
  return s;
}

}  // namespace oomguard::ckpt
