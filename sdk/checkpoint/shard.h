// WriteShard and ShardReader: one rank's HDF5 file of one checkpoint. WriteShard
// runs a ShardWriter (shard.cc), a method per phase of the write.
//
// Write path: datasets are created with the pipeline shuffle (2) + zstd
// (32015) so that any HDF5 reader with the plugin decodes them, but the SDK
// encodes chunks itself in a thread pool, outside the HDF5 lock, and hands
// the finished bytes to H5Dwrite_chunk in chunk order (a sequential file).
// Read path: ShardReader opens a shard and finds where its chunks lie
// (H5Dget_chunk_info_by_coord, under the lock); the tensors are decoded by
// the reader of the shard's format (shard_format.h) behind CheckedShard
// (shard_check.h), the only way a load or a verification reads a shard.
//
// Thread-safety: a writer or reader is used by one thread at a time; several
// may run concurrently (HDF5 calls are serialised by Hdf5Lock).
#ifndef OOMGUARD_SDK_CHECKPOINT_SHARD_H_
#define OOMGUARD_SDK_CHECKPOINT_SHARD_H_

#include <hdf5.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "oomguard/checkpoint.h"
#include "oomguard/status.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/thread_pool.h"

namespace oomguard::ckpt {

// Root attribute listing every tensor of a shard, in the order written: a
// JSON array of {"path": "model/fc1.weight", "dtype": "float32", "shape":
// [256, 32]}. A reader that only saw the datasets present could not tell a
// shard with a tensor deleted, or a dtype attribute or shape changed, from
// the one written. Shards written before it existed lack it; readers then
// take the datasets present as the inventory.
inline constexpr const char* kInventoryAttr = "tensors";

// "[256, 32]": a shape as the readers' and the checker's errors write it.
std::string ShapeString(const std::vector<int64_t>& shape);

// Decoded bytes of check-only reads (verify) in flight at once, in the
// format-1 and the format-2 readers alike (shard_format.h).
inline constexpr int64_t kCheckWindowBytes = int64_t{256} << 20;

struct ShardTensor {
  std::string path;  // without the leading '/'
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
};

// Where the writer finds staged bytes. Acquire may block until the range is
// staged (piece-wise staging); Release says the writer is done with it.
class ChunkSource {
 public:
  virtual ~ChunkSource() = default;
  virtual const uint8_t* Acquire(size_t tensor, int64_t begin, int64_t len) = 0;
  virtual void Release(size_t tensor, int64_t begin, int64_t len) = 0;
  // Whether Acquire of this range would return at once. The writer reads
  // ahead only over ready ranges: blocking on a range that staging cannot
  // produce until the writer releases budget would deadlock.
  virtual bool Ready(size_t /*tensor*/, int64_t /*begin*/) { return true; }
};

// Buffers for compressed frames, recycled between chunks and between saves:
// a fresh multi-MiB allocation per chunk costs page faults and zeroing that
// showed up as a tenth of a save's CPU time.
class FramePool {
 public:
  struct Frame {
    std::unique_ptr<uint8_t[]> data;
    size_t capacity = 0;
    size_t size = 0;
  };
  Frame Take(size_t capacity);
  void Give(Frame f);

 private:
  std::mutex mu_;
  std::vector<Frame> free_;  // guarded by mu_
};

struct ShardWriteOptions {
  int64_t step = 0;
  int rank = 0;
  int world_size = 1;
  // Shuffle + zstd at `level`, or stored as they are (no filters).
  bool compress = true;
  int level = 1;
  // compression = auto: why it chose `compress` (a JSON object), kept in the
  // root attribute kCompressionAutoAttr for the coordinated commit; empty:
  // a fixed choice.
  std::string compression_auto;
  int64_t chunk_bytes = 1 << 20;
  bool fsync = true;
  // Where frame buffers come from (a pool local to the call when null).
  FramePool* frames = nullptr;
  // Called once, halfway through the chunks, with the *.tmp file open (the
  // ckpt_write fault point: a kill there leaves a partial *.tmp behind).
  std::function<void()> midway;
};

struct ShardWriteResult {
  int64_t file_bytes = 0;
  std::string digest;       // shard_digest.h, 16 lowercase hex digits
  std::string compression;  // "none" or "zstd-<level>"
  // Seconds the writing thread spent in writes, writeback and the final
  // fsync of the file (not compression): file_bytes / io_seconds is the
  // write throughput compression = auto compares with.
  double io_seconds = 0;
};

// Writes <final_path>.tmp, fsyncs, renames to final_path, fsyncs the directory.
StatusOr<ShardWriteResult> WriteShard(const std::string& final_path, const std::vector<ShardTensor>& tensors,
                                      ChunkSource* source, ThreadPool* pool,
                                      const ShardWriteOptions& options);

// The chunk layout a writer uses for a tensor (bytes per full chunk, count).
int64_t ChunkCount(const ShardTensor& t, int64_t chunk_bytes);

// A stored chunk of a dataset chunked in contiguous runs (the writer's
// layout, hdf5_io.h): where its bytes are in the file and which bytes of the
// tensor it holds.
struct StoredChunk {
  uint64_t offset = 0;  // in the file (the user block included)
  uint64_t size = 0;    // stored bytes
  int64_t begin = 0;    // tensor bytes [begin, begin + len)
  int64_t len = 0;
};

// Root attribute of a format-2 shard: "none" or "zstd-<level>".
inline constexpr const char* kCompressionAttr = "compression";
// Optional root attribute of format 2: why compression = auto chose the
// shard's compression (a JSON object, as in the manifest's "auto").
inline constexpr const char* kCompressionAutoAttr = "compression_auto";
// Dataset attribute of format 2: XXH3_64bits of each chunk's tensor bytes
// [begin, begin + len), in chunk order (a 1-D uint64 array).
inline constexpr const char* kChunkHashAttr = "chunk_xxh3";

class ShardReader {
 public:
  // Opens `path` and reads its root attributes. kDataLoss when it is not a
  // regular file, or not an HDF5 file of this format; kNotFound when missing.
  static StatusOr<std::unique_ptr<ShardReader>> Open(const std::string& path);
  ~ShardReader();

  const std::string& path() const { return path_; }
  const std::string& format() const { return format_; }
  // 1 or 2 (the formats this version reads).
  int version() const { return version_; }
  // Format 2: the root `compression` attribute ("none", "zstd-1", ...).
  const std::string& compression() const { return compression_; }
  // The root attributes as the file holds them (64-bit: never narrowed, so
  // that a rank of 2^32 cannot pass for rank 0).
  int64_t step() const { return step_; }
  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  // kDataLoss naming them unless step is in [0, kMaxStep], world_size in
  // [1, kMaxWorldSize] and rank in [0, world_size): CheckedShard and
  // InspectShard refuse a shard whose root attributes no writer could make.
  Status CheckRootRanges() const;

  // Every dataset path in the file ("/model/fc1.weight"), sorted.
  StatusOr<std::vector<std::string>> DatasetPaths();
  StatusOr<TensorInfo> Info(const std::string& dataset);
  // Every stored chunk of `dataset`, in chunk order, when it is chunked in
  // contiguous runs and its filters are none or shuffle + zstd; *raw says
  // which. kDataLoss naming the tensor otherwise, or when a chunk is missing,
  // was stored with filters skipped, or lies outside the file.
  Status StoredChunks(const std::string& dataset, std::vector<StoredChunk>* out, ChunkLayout* layout,
                      bool* raw);
  // A read-only mapping of the whole file (made once). When the file is
  // truncated while mapped, reads of the lost part see zeros instead of a
  // SIGBUS and Truncated() turns true (mapped_file.h).
  StatusOr<std::span<const uint8_t>> Mapped();
  bool Truncated() const;

  // The open HDF5 file, for CheckedShard's walk over it. REQUIRES: Hdf5Lock
  // held while it is used; valid as long as this reader.
  hid_t hdf5_file() const;
  // HDF5 addresses are relative to the end of the user block of this many bytes.
  uint64_t base_address() const;

 private:
  ShardReader() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_, format_, compression_;
  int version_ = 0;
  int64_t step_ = -1;
  int64_t rank_ = -1, world_size_ = -1;
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_SHARD_H_
