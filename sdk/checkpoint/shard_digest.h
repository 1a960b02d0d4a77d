// The integrity of a whole shard file in format oomguard-ckpt/2, computed
// from the bytes the loader reads anyway.
//
// Format 1 recorded XXH3 of the whole file in the manifest, so a load read
// every byte twice: once to hash the file, once to decode it. Format 2 cuts
// the file into regions: every stored chunk of every chunked dataset (at its
// address, of its stored size) and the gaps between them (HDF5 metadata,
// attributes, contiguous scalars). Each region is hashed on its own, a chunk
// by the task that decodes it, while its bytes are in cache; the digest is
//   XXH3_64bits( for each region in file order: le64(offset) le64(length)
//                                               le64(XXH3_64bits(bytes)) )
// and the manifest records it (as 16 lowercase hex digits). It covers every
// byte of the file exactly once, and the region boundaries themselves, so a
// change anywhere, a moved chunk or a file of another length changes it.
//
// Thread-safety: pure functions, and DigestShardFile on distinct files.
#ifndef OOMGUARD_SDK_CHECKPOINT_SHARD_DIGEST_H_
#define OOMGUARD_SDK_CHECKPOINT_SHARD_DIGEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "oomguard/status.h"

namespace oomguard::ckpt {

struct FileRegion {
  uint64_t offset = 0;
  uint64_t length = 0;
  bool chunk = false;  // a stored chunk (else a gap between chunks)
};

// The regions that cover [0, file_bytes) exactly: `chunks` in file order and
// the non-empty gaps between them. Returns "" or why the chunks cannot be a
// file's: two overlap, or one lies beyond the end.
std::string PartitionFile(std::vector<FileRegion> chunks, uint64_t file_bytes, std::vector<FileRegion>* out);

// The digest of `regions` (from PartitionFile) whose bytes hash to `hashes`.
uint64_t CombineDigest(const std::vector<FileRegion>& regions, const std::vector<uint64_t>& hashes);

struct ShardFileDigest {
  int64_t bytes = 0;
  std::string digest;       // 16 lowercase hex digits
  std::string compression;  // the shard's `compression` attribute
  std::string compression_auto;  // its `compression_auto` attribute, if any
};

// Reads a format-2 shard on disk whole and computes its digest: the
// coordinated commit does this for other ranks' shards. kDataLoss when the
// file is not a readable format-2 shard.
StatusOr<ShardFileDigest> DigestShardFile(const std::string& path);

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_SHARD_DIGEST_H_
