#include "sdk/checkpoint/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/compression.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/shard_digest.h"
#include "sdk/checkpoint/xxh.h"
#include "sdk/checkpoint/zstd_filter.h"

namespace oomguard::ckpt {
namespace {

// Dirty bytes after which the writer asks the kernel to start writing them
// back, so the disk works while later chunks are compressed instead of all at
// the final fsync.
constexpr int64_t kWritebackBytes = int64_t{32} << 20;

bool IsFloatingPoint(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 || t == DType::kFloat64;
}

std::vector<hsize_t> Dims(const std::vector<int64_t>& shape) {
  return std::vector<hsize_t>(shape.begin(), shape.end());
}

// Creates the groups on the way to `path` ("a/b/c": groups a and a/b).
H5Handle CreateDataset(hid_t file, const std::string& path, hid_t type, hid_t space, hid_t dcpl) {
  H5Handle lcpl(H5Pcreate(H5P_LINK_CREATE));
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  return H5Handle(H5Dcreate2(file, ("/" + path).c_str(), type, space, lcpl.get(), dcpl, H5P_DEFAULT));
}

}  // namespace

FramePool::Frame FramePool::Take(size_t capacity) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].capacity < capacity) continue;
      Frame f = std::move(free_[i]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      f.size = 0;
      return f;
    }
  }
  Frame f;
  f.data.reset(new uint8_t[capacity]);  // not value-initialised: zstd overwrites it
  f.capacity = capacity;
  return f;
}

void FramePool::Give(Frame f) {
  std::lock_guard<std::mutex> lk(mu_);
  free_.push_back(std::move(f));
}

int64_t ChunkCount(const ShardTensor& t, int64_t chunk_bytes) {
  return PlanChunks(t.shape, DTypeSize(t.dtype), chunk_bytes).count;
}

namespace {

// Time spent in a scope, added to `*total` when it ends.
struct IoTimer {
  std::chrono::steady_clock::duration* total;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~IoTimer() { *total += std::chrono::steady_clock::now() - start; }
};

// What WriteShard does, one method per phase, in the order Write calls them:
//   Create       the .tmp file, its attributes and a dataset per tensor (the
//                chunk layout); scalars are written here.
//   PlanJobs     every chunk, in file order.
//   WriteChunks  encodes chunks in the pool, writes them in order
//                (H5Dwrite_chunk), hashes each tensor on a thread of its own.
//   WriteHashes  the chunk and tensor hashes as attributes, every chunk's
//                place in the file; closes the file.
//   Seal         the shard's digest (read back while fsync waits), then
//                rename to the final path and fsync the directory.
// Used once, by one thread; a failed phase removes the .tmp file where the
// function always did.
class ShardWriter {
 public:
  ShardWriter(const std::string& final_path, const std::vector<ShardTensor>& tensors, ChunkSource* source,
              ThreadPool* pool, const ShardWriteOptions& o)
      : final_path_(final_path),
        tmp_(final_path + ".tmp"),
        tensors_(tensors),
        source_(source),
        pool_(pool),
        o_(o) {}
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  ~ShardWriter() {
    for (auto* h : hashes_) XXH3_freeState(h);
  }

  StatusOr<ShardWriteResult> Write() {
    OOMGUARD_RETURN_IF_ERROR(Create());
    PlanJobs();
    Status status = WriteChunks();
    status = WriteHashes(status);
    if (!status.ok()) {
      std::remove(tmp_.c_str());
      return status;
    }
    return Seal();
  }

 private:
  struct Planned {
    ChunkLayout layout;
    H5Handle dset;
  };
  // One chunk: tensor t's chunk i, bytes [begin, begin + len) of the tensor.
  struct Job {
    size_t t;
    int64_t i, begin, len;
    std::vector<hsize_t> offset;
  };
  // What a task hands the writer: an encoded (or padded) frame of its own,
  // or, for a whole uncompressed chunk, the staged bytes themselves.
  struct Encoded {
    FramePool::Frame frame;
    const uint8_t* bytes = nullptr;
    size_t size = 0;
    uint64_t chunk_hash = 0;
    uint64_t stored_hash = 0;
  };

  Status Create();
  void PlanJobs();
  Status WriteChunks();
  Status WriteHashes(Status status);
  Status Digest(ShardWriteResult* res);
  StatusOr<ShardWriteResult> Seal();

  const std::string& final_path_;
  const std::string tmp_;
  const std::vector<ShardTensor>& tensors_;
  ChunkSource* const source_;
  ThreadPool* const pool_;
  const ShardWriteOptions& o_;
  std::vector<Planned> planned_;
  H5Handle file_;
  int64_t total_chunks_ = 0;
  std::vector<Job> jobs_;
  std::vector<XXH3_state_t*> hashes_;                // per tensor, freed by the destructor
  std::vector<std::vector<uint64_t>> chunk_hashes_;  // per tensor, per chunk
  std::vector<uint64_t> stored_hashes_;              // per job
  std::vector<FileRegion> chunk_regions_;            // per job: the regions of the digest
  // Time this thread spends handing bytes to the kernel and waiting for the
  // disk (writes, writeback starts, the final fsync): what compression =
  // auto weighs compression against.
  std::chrono::steady_clock::duration io_time_{};
};

Status ShardWriter::Create() {
  planned_.resize(tensors_.size());
  {
    Hdf5Lock lock;
    OOMGUARD_RETURN_IF_ERROR(EnsureZstdRegistered());
    // HDF5 1.10 file structures: every metadata block carries a checksum that
    // the library verifies when it reads it, so a corrupt shard fails with an
    // error instead of feeding garbage to the parser; the chunk index of a
    // fixed-size dataset is a fixed array (one lookup per chunk).
    H5Handle fapl(H5Pcreate(H5P_FILE_ACCESS));
    H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_LATEST);
    file_ = H5Handle(H5Fcreate(tmp_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()));
    if (!file_.valid()) return Status::Internal("cannot create " + tmp_);
    OOMGUARD_RETURN_IF_ERROR(WriteStringAttr(file_.get(), "format", std::string(kCheckpointFormat)));
    OOMGUARD_RETURN_IF_ERROR(WriteInt64Attr(file_.get(), "step", o_.step));
    OOMGUARD_RETURN_IF_ERROR(WriteInt64Attr(file_.get(), "rank", o_.rank));
    OOMGUARD_RETURN_IF_ERROR(WriteInt64Attr(file_.get(), "world_size", o_.world_size));
    OOMGUARD_RETURN_IF_ERROR(
        WriteStringAttr(file_.get(), kCompressionAttr,
                        ShardCompressionName(o_.compress ? std::optional<int>(o_.level) : std::nullopt)));
    if (!o_.compression_auto.empty())
      OOMGUARD_RETURN_IF_ERROR(WriteStringAttr(file_.get(), kCompressionAutoAttr, o_.compression_auto));
    // The inventory: a reader that only saw the datasets present could not
    // tell a shard with a tensor deleted from a complete one.
    nlohmann::json inventory = nlohmann::json::array();
    for (const ShardTensor& T : tensors_)
      inventory.push_back({{"path", T.path}, {"dtype", DTypeName(T.dtype)}, {"shape", T.shape}});
    OOMGUARD_RETURN_IF_ERROR(WriteStringAttr(file_.get(), kInventoryAttr, inventory.dump()));
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const ShardTensor& T = tensors_[t];
      const size_t es = DTypeSize(T.dtype);
      planned_[t].layout = PlanChunks(T.shape, es, o_.chunk_bytes);
      H5Handle type = FileType(T.dtype);
      auto dims = Dims(T.shape);
      H5Handle space(T.shape.empty() ? H5Screate(H5S_SCALAR)
                                     : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
      H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE));
      if (!planned_[t].layout.chunk_dims.empty()) {
        const auto& cd = planned_[t].layout.chunk_dims;
        H5Pset_chunk(dcpl.get(), static_cast<int>(cd.size()), cd.data());
        if (o_.compress) {
          H5Pset_shuffle(dcpl.get());
          const unsigned level = static_cast<unsigned>(o_.level);
          H5Pset_filter(dcpl.get(), kZstdFilter, H5Z_FLAG_MANDATORY, 1, &level);
        }
        H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
        total_chunks_ += planned_[t].layout.count;
      }
      planned_[t].dset = CreateDataset(file_.get(), T.path, type.get(), space.get(), dcpl.get());
      if (!planned_[t].dset.valid()) return Status::Internal(tmp_ + ": cannot create dataset /" + T.path);
      OOMGUARD_RETURN_IF_ERROR(
          WriteStringAttr(planned_[t].dset.get(), "dtype", std::string(DTypeName(T.dtype))));
      if (planned_[t].layout.chunk_dims.empty() && T.bytes > 0) {
        // A scalar: too small to compress, written through HDF5 as is.
        const uint8_t* p = source_->Acquire(t, 0, T.bytes);
        herr_t rc = H5Dwrite(planned_[t].dset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, p);
        if (rc < 0) return Status::Internal(tmp_ + ": cannot write /" + T.path);
      }
    }
  }
  return Status::Ok();
}

void ShardWriter::PlanJobs() {
  // Chunks in file order. Each task reads staged bytes (a partial edge chunk
  // is zero-padded to the full chunk size, as HDF5 stores it), hashes them
  // while they are in cache (the chunk's xxh3 that loads verify), encodes
  // them unless the shard is uncompressed, and hashes the stored bytes (its
  // region of the shard's digest, shard_digest.h).
  jobs_.reserve(static_cast<size_t>(total_chunks_));
  for (size_t t = 0; t < tensors_.size(); ++t) {
    const auto& L = planned_[t].layout;
    for (int64_t i = 0; i < L.count; ++i) {
      Job j{t, i, 0, 0, {}};
      ChunkPosition(tensors_[t].shape, L, i, &j.offset, &j.begin, &j.len);
      jobs_.push_back(std::move(j));
    }
  }
  hashes_.assign(tensors_.size(), nullptr);
  for (auto& h : hashes_) {
    h = XXH3_createState();
    XXH3_64bits_reset(h);
  }
  chunk_hashes_.resize(tensors_.size());
  for (size_t t = 0; t < tensors_.size(); ++t)
    chunk_hashes_[t].reserve(static_cast<size_t>(planned_[t].layout.count));
  stored_hashes_.resize(jobs_.size());
}

Status ShardWriter::WriteChunks() {
  const size_t window = static_cast<size_t>(std::max(1, pool_->size() * kTasksPerWorker));
  FramePool local_frames;
  FramePool* frames = o_.frames != nullptr ? o_.frames : &local_frames;
  std::deque<std::future<Encoded>> inflight;
  // Tasks use `frames` and the staged bytes: if the midway hook throws (an
  // injected fault), they must finish before this frame's locals go away.
  WaitForAll<Encoded> wait_all{&inflight};
  std::vector<const uint8_t*> data(jobs_.size(), nullptr);
  ThreadPool tensor_hasher(1);
  std::deque<std::future<void>> tensor_hashed;
  WaitForAll<void> wait_hashed{&tensor_hashed};
  size_t next_submit = 0;
  auto submit = [&] {
    const Job& j = jobs_[next_submit];
    const uint8_t* p = source_->Acquire(j.t, j.begin, j.len);
    data[next_submit] = p;
    const size_t es = DTypeSize(tensors_[j.t].dtype);
    const int64_t full = planned_[j.t].layout.chunk_bytes;
    const int level = o_.level;
    const bool compress = o_.compress;
    const int64_t len = j.len;
    const bool fp = IsFloatingPoint(tensors_[j.t].dtype);
    inflight.push_back(pool_->Submit([p, len, full, es, level, fp, compress, frames] {
      thread_local std::vector<uint8_t> scratch, padded;
      Encoded e;
      e.chunk_hash = XXH3_64bits(p, static_cast<size_t>(len));
      const uint8_t* in = p;
      if (len != full) {
        padded.assign(static_cast<size_t>(full), 0);
        std::memcpy(padded.data(), p, static_cast<size_t>(len));
        in = padded.data();
      }
      if (!compress && len == full) {
        e.bytes = p;
        e.size = static_cast<size_t>(full);
        e.stored_hash = e.chunk_hash;
        return e;
      }
      if (!compress) {
        e.frame = frames->Take(static_cast<size_t>(full));
        std::memcpy(e.frame.data.get(), in, static_cast<size_t>(full));
        e.frame.size = static_cast<size_t>(full);
      } else {
        e.frame = frames->Take(EncodeBound(static_cast<size_t>(full)));
        e.frame.size = EncodeChunkInto(in, static_cast<size_t>(full), es, level, fp, &scratch,
                                       e.frame.data.get(), e.frame.capacity);
      }
      e.bytes = e.frame.data.get();
      e.size = e.frame.size;
      e.stored_hash = XXH3_64bits(e.bytes, e.size);
      return e;
    }));
    ++next_submit;
  };
  Status status;
  const size_t midway = jobs_.size() / 2;
  int64_t unflushed = 0;
  // Starts writeback of what was written so far and returns at once.
  auto start_writeback = [&] {
#ifdef SYNC_FILE_RANGE_WRITE
    void* handle = nullptr;
    if (H5Fget_vfd_handle(file_.get(), H5P_DEFAULT, &handle) >= 0 && handle != nullptr)
      (void)::sync_file_range(*static_cast<int*>(handle), 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
    unflushed = 0;
  };
  for (size_t n = 0; n < jobs_.size(); ++n) {
    while (next_submit < jobs_.size() && inflight.size() < window &&
           (inflight.empty() || source_->Ready(jobs_[next_submit].t, jobs_[next_submit].begin)))
      submit();
    Encoded enc = inflight.front().get();
    inflight.pop_front();
    struct GiveBack {
      FramePool* pool;
      FramePool::Frame* f;
      ~GiveBack() {
        if (f->data) pool->Give(std::move(*f));
      }
    } give_back{frames, &enc.frame};
    const Job& j = jobs_[n];
    chunk_hashes_[j.t].push_back(enc.chunk_hash);
    stored_hashes_[n] = enc.stored_hash;
    if (n == midway && o_.midway) o_.midway();
    if (status.ok()) {
      if (enc.size == 0) {
        status = Status::Internal(tmp_ + ": zstd compression failed for /" + tensors_[j.t].path);
      } else {
        Hdf5Lock lock;
        IoTimer timed{&io_time_};
        if (H5Dwrite_chunk(planned_[j.t].dset.get(), H5P_DEFAULT, 0, j.offset.data(), enc.size, enc.bytes) <
            0)
          status = Status::Internal(tmp_ + ": H5Dwrite_chunk failed for /" + tensors_[j.t].path + " chunk " +
                                    std::to_string(j.i));
        unflushed += static_cast<int64_t>(enc.size);
        if (o_.fsync && unflushed >= kWritebackBytes) start_writeback();
      }
    }
    // The tensor hash runs on its own thread, in chunk order (one FIFO
    // worker), so this thread only feeds H5Dwrite_chunk: the write is what
    // a save waits for. Queued after the write, which may have read the
    // staged bytes themselves, since the task releases them.
    tensor_hashed.push_back(tensor_hasher.Submit([this, &data, &j, n] {
      XXH3_64bits_update(hashes_[j.t], data[n], static_cast<size_t>(j.len));
      source_->Release(j.t, j.begin, j.len);
    }));
    while (tensor_hashed.size() > 1 &&
           tensor_hashed.front().wait_for(std::chrono::seconds(0)) == std::future_status::ready)
      tensor_hashed.pop_front();
  }
  if (jobs_.empty() && o_.midway) o_.midway();
  while (!tensor_hashed.empty()) {
    tensor_hashed.front().get();
    tensor_hashed.pop_front();
  }
  return status;
}

Status ShardWriter::WriteHashes(Status status) {
  // Every chunk's place in the file: the regions of the digest.
  chunk_regions_.reserve(jobs_.size());
  {
    Hdf5Lock lock;
    if (status.ok()) {
      for (size_t t = 0; t < tensors_.size(); ++t) {
        uint64_t h = 0;
        if (!planned_[t].layout.chunk_dims.empty()) {
          h = XXH3_64bits_digest(hashes_[t]);
          Status s = WriteUint64ArrayAttr(planned_[t].dset.get(), kChunkHashAttr, chunk_hashes_[t]);
          if (!s.ok() && status.ok()) status = s;
        } else {
          const uint8_t* p = tensors_[t].bytes > 0 ? source_->Acquire(t, 0, tensors_[t].bytes) : nullptr;
          h = XXH3_64bits(p, static_cast<size_t>(tensors_[t].bytes));
          if (p != nullptr) source_->Release(t, 0, tensors_[t].bytes);
        }
        Status s = WriteStringAttr(planned_[t].dset.get(), "xxh3", Hex64(h));
        if (!s.ok() && status.ok()) status = s;
      }
      for (size_t n = 0; n < jobs_.size() && status.ok(); ++n) {
        unsigned mask = 0;
        haddr_t addr = HADDR_UNDEF;
        hsize_t size = 0;
        if (H5Dget_chunk_info_by_coord(planned_[jobs_[n].t].dset.get(), jobs_[n].offset.data(), &mask, &addr,
                                       &size) < 0 ||
            addr == HADDR_UNDEF)
          status = Status::Internal(tmp_ + ": cannot find chunk " + std::to_string(jobs_[n].i) + " of /" +
                                    tensors_[jobs_[n].t].path + " after writing it");
        chunk_regions_.push_back({addr, size, true});
      }
    }
    for (auto& p : planned_) p.dset.reset();
    if (status.ok() && H5Fflush(file_.get(), H5F_SCOPE_GLOBAL) < 0)
      status = Status::Internal("flush " + tmp_);
    file_.reset();
  }
  return status;
}

// The digest: the chunks' hashes from the tasks, the gaps (metadata, a few
// KiB) hashed from the page cache. Runs while Seal waits for fsync.
Status ShardWriter::Digest(ShardWriteResult* res) {
  Status digested;
  std::vector<FileRegion> regions;
  int fd = ::open(tmp_.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    digested = Status::Internal("cannot read back " + tmp_ + ": " + std::strerror(errno));
    if (fd >= 0) ::close(fd);
    return digested;
  }
  res->file_bytes = st.st_size;
  const std::string bad = PartitionFile(chunk_regions_, static_cast<uint64_t>(st.st_size), &regions);
  if (!bad.empty()) {
    ::close(fd);
    digested = Status::Internal(tmp_ + ": " + bad);
    return digested;
  }
  // Each chunk region's stored hash, matched by offset (both sorted).
  std::vector<std::pair<uint64_t, uint64_t>> by_offset(jobs_.size());
  for (size_t n = 0; n < jobs_.size(); ++n) by_offset[n] = {chunk_regions_[n].offset, stored_hashes_[n]};
  std::sort(by_offset.begin(), by_offset.end());
  std::vector<uint64_t> region_hashes(regions.size());
  std::vector<uint8_t> buf;
  size_t next_chunk = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].chunk) {
      region_hashes[i] = by_offset[next_chunk++].second;
      continue;
    }
    buf.resize(static_cast<size_t>(regions[i].length));
    size_t got = 0;
    while (got < buf.size()) {
      const ssize_t r =
          ::pread(fd, buf.data() + got, buf.size() - got, static_cast<off_t>(regions[i].offset + got));
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    if (got != buf.size()) {
      digested = Status::Internal("cannot read back " + tmp_);
      break;
    }
    region_hashes[i] = XXH3_64bits(buf.data(), buf.size());
  }
  ::close(fd);
  if (digested.ok()) res->digest = Hex64(CombineDigest(regions, region_hashes));
  return digested;
}

StatusOr<ShardWriteResult> ShardWriter::Seal() {
  ShardWriteResult res;
  res.compression = ShardCompressionName(o_.compress ? std::optional<int>(o_.level) : std::nullopt);
  Status status;
  Status digested;
  {
    std::jthread digester([&] { digested = Digest(&res); });
    if (o_.fsync) {
      IoTimer timed{&io_time_};
      status = FsyncPath(tmp_, false);
    }
  }
  res.io_seconds = std::chrono::duration<double>(io_time_).count();
  if (status.ok()) status = digested;
  if (!status.ok()) {
    std::remove(tmp_.c_str());
    return status;
  }
  if (std::rename(tmp_.c_str(), final_path_.c_str()) != 0)
    return Status::Internal("rename " + tmp_ + ": " + std::strerror(errno));
  if (o_.fsync) {
    std::string dir = final_path_.substr(0, final_path_.find_last_of('/'));
    OOMGUARD_RETURN_IF_ERROR(FsyncPath(dir, true));
  }
  return res;
}

}  // namespace

StatusOr<ShardWriteResult> WriteShard(const std::string& final_path, const std::vector<ShardTensor>& tensors,
                                      ChunkSource* source, ThreadPool* pool, const ShardWriteOptions& o) {
  return ShardWriter(final_path, tensors, source, pool, o).Write();
}

}  // namespace oomguard::ckpt
