// Chunk codec of formats oomguard-ckpt/1 and /2: HDF5's byte shuffle (filter id 2)
// followed by one Zstandard frame that records its content size (filter id
// 32015, cd_values[0] = level). Shared by the writer, the loader, the
// in-process HDF5 filter and the h5py/h5dump plugin, so that every reader
// decodes exactly what the writer encoded.
//
// Thread-safety: pure functions; safe from any thread.
#ifndef OOMGUARD_SDK_CHECKPOINT_CODEC_H_
#define OOMGUARD_SDK_CHECKPOINT_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace oomguard::ckpt {

// HDF5 shuffle: byte j of element i goes to j * n + i (n = bytes / elem_size);
// trailing bytes that do not fill an element are copied unchanged.
void Shuffle(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size);
void Unshuffle(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size);

// Levels up to this one use match-finder settings tuned for floating-point
// tensors when EncodeChunk is told the chunk holds floats.
inline constexpr int kFloatTunedMaxLevel = 3;

// Shuffle + zstd of one chunk into out[0, capacity) (capacity at least
// EncodeBound(bytes)). Returns the frame's size, 0 when zstd fails.
// `scratch` is reused between calls.
size_t EncodeBound(size_t bytes);
size_t EncodeChunkInto(const uint8_t* data, size_t bytes, size_t elem_size, int level, bool floating_point,
                       std::vector<uint8_t>* scratch, uint8_t* out, size_t capacity);
// The same into a new vector (empty when zstd fails).
std::vector<uint8_t> EncodeChunk(const uint8_t* data, size_t bytes, size_t elem_size, int level,
                                 std::vector<uint8_t>* scratch, bool floating_point = false);

// The inverse: decodes into `out`, which must hold exactly the frame's
// content size. Returns "" or what is wrong (not a zstd frame, size mismatch).
std::string DecodeChunk(const uint8_t* frame, size_t frame_bytes, size_t elem_size, uint8_t* out,
                        size_t out_bytes, std::vector<uint8_t>* scratch);

// Format 2 verifies each chunk's bytes as they are produced, block by block
// while they are still in L1, instead of in a second pass over memory:
// Unshuffle of a chunk of `bytes` into out[0, keep) (the leading part of an
// edge chunk), returning XXH3_64bits of out[0, keep) ...
uint64_t UnshuffleHashed(const uint8_t* in, uint8_t* out, size_t bytes, size_t elem_size, size_t keep);
// ... memcpy returning XXH3_64bits of what was written ...
uint64_t CopyHashed(const uint8_t* in, uint8_t* out, size_t bytes);
// ... and DecodeChunk of a frame holding `chunk_bytes` into out[0, keep),
// setting *hash to XXH3_64bits of out[0, keep). Returns "" or what is wrong.
std::string DecodeChunkHashed(const uint8_t* frame, size_t frame_bytes, size_t elem_size, uint8_t* out,
                              size_t chunk_bytes, size_t keep, std::vector<uint8_t>* scratch, uint64_t* hash);

// 16 lowercase hex digits of XXH3_64bits (seed 0).
std::string Hex64(uint64_t v);

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_CODEC_H_
