// ShardFormatReader: how CheckedShard (shard_check.h) reads the tensors of
// one shard format, behind one interface. CheckedShard::Open picks the
// reader once, from the manifest's format, and every later step goes through
// it; nothing else in the checker asks which format it holds.
//
//   format 2  shard_pass.cc    one pass over the bytes: every chunk hashed as
//                              stored (the shard's digest) and as decoded (its
//                              chunk_xxh3 entry) by one pool task
//   format 1  shard_reader.cc  chunks decoded out of the file's mapping, each
//                              tensor's xxh3 checked in order; the whole file
//                              hashed on a thread of its own
//
// One owner per check: CheckDataset (shard_check.cc) checks each dataset's
// dtype, shape, sizes and xxh3 attribute when the shard is opened, and
// CheckedShard::Read checks each request against that entry. A reader is
// handed only checked entries and does not look at those again; it checks
// what only it sees (the chunks' places, stored sizes and hashes).
//
// Thread-safety: used by the one thread that uses its CheckedShard.
#ifndef OOMGUARD_SDK_CHECKPOINT_SHARD_FORMAT_H_
#define OOMGUARD_SDK_CHECKPOINT_SHARD_FORMAT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "oomguard/status.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/shard_check.h"
#include "sdk/checkpoint/thread_pool.h"

namespace oomguard::ckpt {

// One checked tensor to decode: `entry`'s bytes into out[0, entry->bytes),
// or, with out == nullptr, decoded and its xxh3 checked without keeping them.
struct TensorRead {
  const ShardEntry* entry = nullptr;
  uint8_t* out = nullptr;
};

class ShardFormatReader {
 public:
  // The reader of `manifest.format` for shard `shard` (the file `file`);
  // hash_file: verify the whole file too. Format 1 starts hashing the file
  // here, before the shard is opened: the hash and the decode then share
  // one trip through the file's pages.
  static std::unique_ptr<ShardFormatReader> For(const Manifest& manifest, const ManifestShard& shard,
                                                const std::string& file, bool hash_file);
  virtual ~ShardFormatReader() = default;

  // ShardReader::Open refused the file with `why`: what to report (a
  // whole-file mismatch, when known, says more than HDF5's message).
  virtual Status OpenFailed(const Status& why) { return why; }
  // Root attributes only this format has, against the manifest's shard.
  virtual Status CheckRoot(const ShardReader& /*reader*/) { return Status::Ok(); }
  // Once CheckDataset accepted every entry: find what the reads will need.
  // `reader` and `entries` outlive this object. REQUIRES: Hdf5Lock held.
  virtual Status Plan(ShardReader* reader, const std::vector<ShardEntry>& entries) = 0;
  // The whole-file verdict now, before anything is decoded or allocated
  // from the entries' sizes (kDigestFirstRatio).
  virtual Status VerifyFileFirst() = 0;
  // Decodes `reads`, every tensor's hash verified. kDataLoss naming the file,
  // the tensor and (for a bad chunk) the chunk.
  virtual Status Read(const std::vector<TensorRead>& reads, ThreadPool* pool) = 0;
  // `read_status` when it failed (it names the tensor), else the whole
  // file's verdict.
  virtual Status Finish(const Status& read_status) = 0;
};

// The two readers (ShardFormatReader::For chooses).
std::unique_ptr<ShardFormatReader> MakeFormatV1Reader(const ManifestShard& shard, const std::string& file,
                                                      bool hash_file);
std::unique_ptr<ShardFormatReader> MakeFormatV2Reader(const ManifestShard& shard, const std::string& file,
                                                      bool hash_file);

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_SHARD_FORMAT_H_
