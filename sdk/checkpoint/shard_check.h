// CheckedShard: the one checker of a committed checkpoint's shard, shared by
// the loader (Checkpointer::LoadLatest/Load/Restore) and by
// VerifyCheckpoint (`oomguard ckpt verify`), so that verify accepts exactly
// what a load accepts.
//
// A checkpoint may come from another machine or another person. Before any
// tensor byte is read, Open refuses, naming the file and the tensor:
//   * a shard file that is missing, a symlink, not a regular file, or not the
//     size the manifest records; root attributes outside what a writer makes
//     (ShardReader::CheckRootRanges) or that do not name this step, rank and
//     world size (a step directory that is a symlink is refused before, by
//     ReadManifest);
//   * any link but a hard one (soft links, external links), any object but
//     groups and datasets, groups nested deeper than kMaxGroupDepth, more than
//     kMaxLinks links, an object reached by a second link (WalkObjects, which
//     stops at the first of these before opening anything deeper);
//   * a dataset whose data would not come from the shard itself (external
//     storage, a virtual dataset) or whose layout is not chunked, contiguous
//     or compact; a filter other than shuffle, zstd, deflate or fletcher32;
//   * a dataset without a known `dtype` or a 16-hex-digit `xxh3` attribute,
//     or whose HDF5 type (integer or float, little-endian, of the dtype's
//     size) does not hold its dtype;
//   * sizes the file cannot back: dimensions whose product overflows,
//     contiguous data not allocated or outside the file, chunks missing (HDF5
//     would invent fill values), more chunks than the file has bytes, stored
//     bytes beyond the file, or more decoded bytes than any of the allowed
//     filters can expand the stored ones to (kMaxExpansion);
//   * datasets other than the ones the shard's inventory attribute lists, a
//     listed one missing, or one whose dtype or shape differs from the listed.
// So nothing is allocated from a size the file does not back, and nothing
// outside the checkpoint directory is read. A shard whose tensors declare
// more than kDigestFirstRatio times its size proves its whole-file hash in
// Open too, before anything is decoded or allocated from those sizes. A
// shard truncated while it is read is refused by Finish as truncated
// (mapped_file.h), never with a signal.
//
// Then Read/ReadEverything decode the tensors and Finish gives the verdict
// on the whole file (a tensor's own error first: it names the tensor). Open
// chooses the reader of the manifest's format once (shard_format.h):
//   * format 2 (shard_pass.cc): Open also requires every chunked tensor to be
//     chunked as the writer chunks (contiguous runs; no filters, or shuffle +
//     zstd, as the shard's `compression` says) with a `chunk_xxh3` attribute
//     of one hash per chunk, and finds every chunk's place in the file. Each
//     chunk is then hashed as stored, decoded and hashed again as decoded by
//     one pool task while its bytes are in cache; a decoded chunk whose hash
//     differs from its `chunk_xxh3` entry is refused at once, and Finish
//     hashes what no task read (metadata, tensors not asked for) and compares
//     the shard's digest (shard_digest.h) with the manifest's. One pass over
//     the bytes, every byte of the file verified, as in format 1.
//   * format 1: every tensor's xxh3 is checked while the whole file is hashed
//     on a thread of its own, and Finish joins the two verdicts.
//
// Thread-safety: a CheckedShard is used by one thread at a time.
#ifndef OOMGUARD_SDK_CHECKPOINT_SHARD_CHECK_H_
#define OOMGUARD_SDK_CHECKPOINT_SHARD_CHECK_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "oomguard/status.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/thread_pool.h"

namespace oomguard::ckpt {

// Decoded bytes per stored byte that no allowed filter exceeds: a zstd RLE
// block turns 4 bytes into at most 128 KiB (32768x), deflate reaches ~1032x.
inline constexpr int64_t kMaxExpansion = int64_t{1} << 16;
// A shard whose tensors declare more than this many times the file's size
// (zeros, or a forged size) proves its whole-file hash before anything is
// decoded or allocated from those sizes: hashing the file then costs less
// than an eighth of decoding it, and a damaged one is refused in
// milliseconds instead of after gigabytes were allocated and decoded.
inline constexpr int64_t kDigestFirstRatio = 8;

// One tensor of a checked shard.
struct ShardEntry {
  std::string dataset;  // "/model/fc1.weight"
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
  int64_t bytes = 0;  // decoded
  std::string xxh3;   // the stored hash of the tensor's bytes
};

// Reads <step_dir>/MANIFEST.json and checks that it names `step`.
// kNotFound when there is none; kDataLoss naming the file otherwise.
StatusOr<Manifest> ReadStepManifest(const std::string& step_dir, int64_t step);

// The environment variable OOMGUARD_CKPT_READS chooses how a format-2 load
// fetches its chunks: auto (unset: by the page cache's state), mapping or
// pread (shard_pass.cc). InvalidArgument, naming it, for anything else;
// checked where a Checkpointer is created and where a checkpoint is verified.
Status CheckReadsSetting();

// Chunks this process has fetched with pread rather than through the
// mapping, over every load and verification (for tests and diagnostics).
uint64_t ChunksReadWithPread();

// One tensor to decode: `dataset` into out[0, bytes), its dtype and shape
// checked against the shard's entry when `check` is true (its byte count
// always). With out == nullptr the tensor is decoded and its xxh3 checked,
// but its bytes are not kept: the chunks pass through a few recycled buffers
// (a check of a whole shard needs memory for a few chunks, not for its
// tensors).
struct ReadRequest {
  std::string dataset;
  bool check = false;
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
  uint8_t* out = nullptr;
  int64_t bytes = 0;
};

class ShardFormatReader;  // shard_format.h: the reading of one format

class CheckedShard {
 public:
  // Checks shard `shard` of `manifest` (the file <step_dir>/<shard.file>) as
  // described above; hash_file: verify the whole file too (the format-1
  // file hash, started at once; the format-2 digest, in Read and Finish).
  // Errors are kDataLoss naming the file and, where one is at fault, the
  // tensor.
  static StatusOr<std::unique_ptr<CheckedShard>> Open(const std::string& step_dir, const Manifest& manifest,
                                                      const ManifestShard& shard, bool hash_file);
  ~CheckedShard();

  const std::string& path() const { return path_; }
  // Every tensor of the shard, in inventory order.
  const std::vector<ShardEntry>& entries() const { return entries_; }
  const ShardEntry* Find(const std::string& dataset) const;
  // Sum of entries()' bytes.
  int64_t total_bytes() const { return total_bytes_; }

  // Decodes `requests`, each tensor's hash verified. kDataLoss naming the
  // tensor when a request names a dataset the shard does not hold, or one
  // whose dtype, shape or size differs from the request's. On error the
  // outputs may hold partial data.
  Status Read(const std::vector<ReadRequest>& requests, ThreadPool* pool);
  // Decodes every entry and checks its xxh3 without keeping the bytes.
  Status ReadEverything(ThreadPool* pool);
  // Completes the whole-file check and returns `read_status` when it failed
  // (it names the tensor), else the file's verdict.
  Status Finish(const Status& read_status);

 private:
  CheckedShard();
  std::string path_;
  std::unique_ptr<ShardReader> reader_;
  // The reading of the manifest's format, chosen once in Open. After
  // reader_, so destroyed before it.
  std::unique_ptr<ShardFormatReader> format_;
  std::vector<ShardEntry> entries_;
  int64_t total_bytes_ = 0;
  int64_t size_at_open_ = 0;
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_SHARD_CHECK_H_
