// Test helpers that edit real shards the way a hostile file would, shared by
// shard_check_test.cc (one case per refusal) and shard_fuzz_test.cc (random
// cases). Test-only: nothing in the library includes this.
#ifndef OOMGUARD_SDK_CHECKPOINT_HOSTILE_SHARD_TESTUTIL_H_
#define OOMGUARD_SDK_CHECKPOINT_HOSTILE_SHARD_TESTUTIL_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/zstd_filter.h"

namespace oomguard::ckpt::testutil {

// A zstd frame of `n` zero bytes made of RLE blocks (4 bytes per 128 KiB):
// how a hostile file declares gigabytes in kilobytes.
inline std::string ZeroFrame(uint64_t n) {
  std::string f;
  auto put = [&](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) f.push_back(static_cast<char>(v >> (8 * i)));
  };
  put(0xFD2FB528, 4);
  f.push_back(static_cast<char>(0xE0));  // single segment, 8-byte content size
  put(n, 8);
  for (uint64_t done = 0; done < n;) {
    const uint64_t len = std::min<uint64_t>(n - done, 128 * 1024);
    done += len;
    put((len << 3) | (1u << 1) | (done == n ? 1u : 0u), 3);  // an RLE block
    f.push_back('\0');
  }
  return f;
}

// Replaces `dataset` of the open file `file` with a 1-D uint8 dataset of
// `chunks` chunks of `chunk` bytes, shuffle + zstd, each chunk a ZeroFrame:
// the layout, filters and attributes a writer makes, the chunk hashes wrong
// (1), and the inventory rewritten to list the new shape, so that only the
// sizes it declares stand out. False when an HDF5 call failed.
// REQUIRES: Hdf5Lock held; the dataset is listed in the inventory.
inline bool ReplaceWithZeroFrames(hid_t file, const std::string& dataset, uint64_t chunk, uint64_t chunks) {
  if (!EnsureZstdRegistered().ok()) return false;
  auto inventory = ReadStringAttr(file, kInventoryAttr, size_t{16} << 20);
  if (!inventory) return false;
  H5Ldelete(file, dataset.c_str(), H5P_DEFAULT);
  const hsize_t dims = chunk * chunks, chunk_dims = chunk;
  H5Handle space(H5Screate_simple(1, &dims, nullptr));
  H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE));
  H5Pset_chunk(dcpl.get(), 1, &chunk_dims);
  H5Pset_shuffle(dcpl.get());
  const unsigned level = 1;
  H5Pset_filter(dcpl.get(), kZstdFilter, H5Z_FLAG_MANDATORY, 1, &level);
  H5Handle d(
      H5Dcreate2(file, dataset.c_str(), H5T_STD_U8LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!d.valid()) return false;
  const std::string frame = ZeroFrame(chunk);
  for (hsize_t i = 0; i < chunks; ++i) {
    const hsize_t offset = i * chunk;
    if (H5Dwrite_chunk(d.get(), H5P_DEFAULT, 0, &offset, frame.size(), frame.data()) < 0) return false;
  }
  if (!WriteStringAttr(d.get(), "dtype", "uint8").ok() ||
      !WriteStringAttr(d.get(), "xxh3", "0123456789abcdef").ok() ||
      !WriteUint64ArrayAttr(d.get(), kChunkHashAttr, std::vector<uint64_t>(chunks, 1)).ok())
    return false;
  // {"dtype":"...","path":"<dataset without '/'>","shape":[...]} -> uint8, [dims].
  const std::string path = "\"path\":\"" + dataset.substr(1) + "\"";
  const size_t at = inventory->find(path);
  if (at == std::string::npos) return false;
  const size_t begin = inventory->rfind('{', at), end = inventory->find('}', at);
  inventory->replace(begin, end + 1 - begin,
                     "{\"dtype\":\"uint8\"," + path + ",\"shape\":[" + std::to_string(dims) + "]}");
  H5Adelete(file, kInventoryAttr);
  return WriteStringAttr(file, kInventoryAttr, *inventory).ok();
}

}  // namespace oomguard::ckpt::testutil

#endif  // OOMGUARD_SDK_CHECKPOINT_HOSTILE_SHARD_TESTUTIL_H_
