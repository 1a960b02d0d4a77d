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

StatusOr<ShardWriteResult> WriteShard(const std::string& final_path, const std::vector<ShardTensor>& tensors,
                                      ChunkSource* source, ThreadPool* pool, const ShardWriteOptions& o) {
  const std::string tmp = final_path + ".tmp";
  struct Planned {
    ChunkLayout layout;
    H5Handle dset;
  };
  std::vector<Planned> planned(tensors.size());
  H5Handle file;
  int64_t total_chunks = 0;
  {
    Hdf5Lock lock;
    OOMGUARD_RETURN_IF_ERROR(EnsureZstdRegistered());
    // HDF5 1.10 file structures: every metadata block carries a checksum that
    // the library verifies when it reads it, so a corrupt shard fails with an
    // error instead of feeding garbage to the parser; the chunk index of a
    // fixed-size dataset is a fixed array (one lookup per chunk).
    H5Handle fapl(H5Pcreate(H5P_FILE_ACCESS));
    H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_LATEST);
    file = H5Handle(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()));
    if (!file.valid()) return Status::Internal("cannot create " + tmp);
    OOMGUARD_RETURN_IF_ERROR(WriteStringAttr(file.get(), "format", std::string(kCheckpointFormat)));
    OOMGUARD_RETURN_IF_ERROR(WriteInt64Attr(file.get(), "step", o.step));
    OOMGUARD_RETURN_IF_ERROR(WriteInt64Attr(file.get(), "rank", o.rank));
    OOMGUARD_RETURN_IF_ERROR(WriteInt64Attr(file.get(), "world_size", o.world_size));
    OOMGUARD_RETURN_IF_ERROR(
        WriteStringAttr(file.get(), kCompressionAttr,
                        ShardCompressionName(o.compress ? std::optional<int>(o.level) : std::nullopt)));
    if (!o.compression_auto.empty())
      OOMGUARD_RETURN_IF_ERROR(WriteStringAttr(file.get(), kCompressionAutoAttr, o.compression_auto));
    // The inventory: a reader that only saw the datasets present could not
    // tell a shard with a tensor deleted from a complete one.
    nlohmann::json inventory = nlohmann::json::array();
    for (const ShardTensor& T : tensors)
      inventory.push_back({{"path", T.path}, {"dtype", DTypeName(T.dtype)}, {"shape", T.shape}});
    OOMGUARD_RETURN_IF_ERROR(WriteStringAttr(file.get(), kInventoryAttr, inventory.dump()));
    for (size_t t = 0; t < tensors.size(); ++t) {
      const ShardTensor& T = tensors[t];
      const size_t es = DTypeSize(T.dtype);
      planned[t].layout = PlanChunks(T.shape, es, o.chunk_bytes);
      H5Handle type = FileType(T.dtype);
      auto dims = Dims(T.shape);
      H5Handle space(T.shape.empty() ? H5Screate(H5S_SCALAR)
                                     : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
      H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE));
      if (!planned[t].layout.chunk_dims.empty()) {
        const auto& cd = planned[t].layout.chunk_dims;
        H5Pset_chunk(dcpl.get(), static_cast<int>(cd.size()), cd.data());
        if (o.compress) {
          H5Pset_shuffle(dcpl.get());
          const unsigned level = static_cast<unsigned>(o.level);
          H5Pset_filter(dcpl.get(), kZstdFilter, H5Z_FLAG_MANDATORY, 1, &level);
        }
        H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
        total_chunks += planned[t].layout.count;
      }
      planned[t].dset = CreateDataset(file.get(), T.path, type.get(), space.get(), dcpl.get());
      if (!planned[t].dset.valid()) return Status::Internal(tmp + ": cannot create dataset /" + T.path);
      OOMGUARD_RETURN_IF_ERROR(
          WriteStringAttr(planned[t].dset.get(), "dtype", std::string(DTypeName(T.dtype))));
      if (planned[t].layout.chunk_dims.empty() && T.bytes > 0) {
        // A scalar: too small to compress, written through HDF5 as is.
        const uint8_t* p = source->Acquire(t, 0, T.bytes);
        herr_t rc = H5Dwrite(planned[t].dset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, p);
        if (rc < 0) return Status::Internal(tmp + ": cannot write /" + T.path);
      }
    }
  }

  // Chunks in file order. Each task reads staged bytes (a partial edge chunk
  // is zero-padded to the full chunk size, as HDF5 stores it), hashes them
  // while they are in cache (the chunk's xxh3 that loads verify), encodes
  // them unless the shard is uncompressed, and hashes the stored bytes (its
  // region of the shard's digest, shard_digest.h).
  struct Job {
    size_t t;
    int64_t i, begin, len;
    std::vector<hsize_t> offset;
  };
  std::vector<Job> jobs;
  jobs.reserve(static_cast<size_t>(total_chunks));
  for (size_t t = 0; t < tensors.size(); ++t) {
    const auto& L = planned[t].layout;
    for (int64_t i = 0; i < L.count; ++i) {
      Job j{t, i, 0, 0, {}};
      ChunkPosition(tensors[t].shape, L, i, &j.offset, &j.begin, &j.len);
      jobs.push_back(std::move(j));
    }
  }
  std::vector<XXH3_state_t*> hashes(tensors.size(), nullptr);
  for (auto& h : hashes) {
    h = XXH3_createState();
    XXH3_64bits_reset(h);
  }
  struct HashFree {
    std::vector<XXH3_state_t*>* v;
    ~HashFree() {
      for (auto* h : *v) XXH3_freeState(h);
    }
  } hash_free{&hashes};
  std::vector<std::vector<uint64_t>> chunk_hashes(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t)
    chunk_hashes[t].reserve(static_cast<size_t>(planned[t].layout.count));
  std::vector<uint64_t> stored_hashes(jobs.size());

  // What a task hands the writer: an encoded (or padded) frame of its own,
  // or, for a whole uncompressed chunk, the staged bytes themselves.
  struct Encoded {
    FramePool::Frame frame;
    const uint8_t* bytes = nullptr;
    size_t size = 0;
    uint64_t chunk_hash = 0;
    uint64_t stored_hash = 0;
  };
  const size_t window = static_cast<size_t>(std::max(1, pool->size() * kTasksPerWorker));
  FramePool local_frames;
  FramePool* frames = o.frames != nullptr ? o.frames : &local_frames;
  std::deque<std::future<Encoded>> inflight;
  // Tasks use `frames` and the staged bytes: if the midway hook throws (an
  // injected fault), they must finish before this frame's locals go away.
  WaitForAll<Encoded> wait_all{&inflight};
  std::vector<const uint8_t*> data(jobs.size(), nullptr);
  ThreadPool tensor_hasher(1);
  std::deque<std::future<void>> tensor_hashed;
  WaitForAll<void> wait_hashed{&tensor_hashed};
  size_t next_submit = 0;
  auto submit = [&] {
    const Job& j = jobs[next_submit];
    const uint8_t* p = source->Acquire(j.t, j.begin, j.len);
    data[next_submit] = p;
    const size_t es = DTypeSize(tensors[j.t].dtype);
    const int64_t full = planned[j.t].layout.chunk_bytes;
    const int level = o.level;
    const bool compress = o.compress;
    const int64_t len = j.len;
    const bool fp = IsFloatingPoint(tensors[j.t].dtype);
    inflight.push_back(pool->Submit([p, len, full, es, level, fp, compress, frames] {
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
  const size_t midway = jobs.size() / 2;
  int64_t unflushed = 0;
  // Time this thread spends handing bytes to the kernel and waiting for the
  // disk (writes, writeback starts, the final fsync): what compression =
  // auto weighs compression against.
  std::chrono::steady_clock::duration io_time{};
  struct IoTimer {
    std::chrono::steady_clock::duration* total;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~IoTimer() { *total += std::chrono::steady_clock::now() - start; }
  };
  // Starts writeback of what was written so far and returns at once.
  auto start_writeback = [&] {
#ifdef SYNC_FILE_RANGE_WRITE
    void* handle = nullptr;
    if (H5Fget_vfd_handle(file.get(), H5P_DEFAULT, &handle) >= 0 && handle != nullptr)
      (void)::sync_file_range(*static_cast<int*>(handle), 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
    unflushed = 0;
  };
  for (size_t n = 0; n < jobs.size(); ++n) {
    while (next_submit < jobs.size() && inflight.size() < window &&
           (inflight.empty() || source->Ready(jobs[next_submit].t, jobs[next_submit].begin)))
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
    const Job& j = jobs[n];
    chunk_hashes[j.t].push_back(enc.chunk_hash);
    stored_hashes[n] = enc.stored_hash;
    if (n == midway && o.midway) o.midway();
    if (status.ok()) {
      if (enc.size == 0) {
        status = Status::Internal(tmp + ": zstd compression failed for /" + tensors[j.t].path);
      } else {
        Hdf5Lock lock;
        IoTimer timed{&io_time};
        if (H5Dwrite_chunk(planned[j.t].dset.get(), H5P_DEFAULT, 0, j.offset.data(), enc.size, enc.bytes) < 0)
          status = Status::Internal(tmp + ": H5Dwrite_chunk failed for /" + tensors[j.t].path + " chunk " +
                                    std::to_string(j.i));
        unflushed += static_cast<int64_t>(enc.size);
        if (o.fsync && unflushed >= kWritebackBytes) start_writeback();
      }
    }
    // The tensor hash runs on its own thread, in chunk order (one FIFO
    // worker), so this thread only feeds H5Dwrite_chunk: the write is what
    // a save waits for. Queued after the write, which may have read the
    // staged bytes themselves, since the task releases them.
    tensor_hashed.push_back(tensor_hasher.Submit([&hashes, &data, &j, n, source] {
      XXH3_64bits_update(hashes[j.t], data[n], static_cast<size_t>(j.len));
      source->Release(j.t, j.begin, j.len);
    }));
    while (tensor_hashed.size() > 1 &&
           tensor_hashed.front().wait_for(std::chrono::seconds(0)) == std::future_status::ready)
      tensor_hashed.pop_front();
  }
  if (jobs.empty() && o.midway) o.midway();
  while (!tensor_hashed.empty()) {
    tensor_hashed.front().get();
    tensor_hashed.pop_front();
  }
  // Every chunk's place in the file: the regions of the digest.
  std::vector<FileRegion> chunk_regions;
  chunk_regions.reserve(jobs.size());
  {
    Hdf5Lock lock;
    if (status.ok()) {
      for (size_t t = 0; t < tensors.size(); ++t) {
        uint64_t h = 0;
        if (!planned[t].layout.chunk_dims.empty()) {
          h = XXH3_64bits_digest(hashes[t]);
          Status s = WriteUint64ArrayAttr(planned[t].dset.get(), kChunkHashAttr, chunk_hashes[t]);
          if (!s.ok() && status.ok()) status = s;
        } else {
          const uint8_t* p = tensors[t].bytes > 0 ? source->Acquire(t, 0, tensors[t].bytes) : nullptr;
          h = XXH3_64bits(p, static_cast<size_t>(tensors[t].bytes));
          if (p != nullptr) source->Release(t, 0, tensors[t].bytes);
        }
        Status s = WriteStringAttr(planned[t].dset.get(), "xxh3", Hex64(h));
        if (!s.ok() && status.ok()) status = s;
      }
      for (size_t n = 0; n < jobs.size() && status.ok(); ++n) {
        unsigned mask = 0;
        haddr_t addr = HADDR_UNDEF;
        hsize_t size = 0;
        if (H5Dget_chunk_info_by_coord(planned[jobs[n].t].dset.get(), jobs[n].offset.data(), &mask, &addr,
                                       &size) < 0 ||
            addr == HADDR_UNDEF)
          status = Status::Internal(tmp + ": cannot find chunk " + std::to_string(jobs[n].i) + " of /" +
                                    tensors[jobs[n].t].path + " after writing it");
        chunk_regions.push_back({addr, size, true});
      }
    }
    for (auto& p : planned) p.dset.reset();
    if (status.ok() && H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) status = Status::Internal("flush " + tmp);
    file.reset();
  }
  if (!status.ok()) {
    std::remove(tmp.c_str());
    return status;
  }
  // The digest: the chunks' hashes from the tasks, the gaps (metadata, a few
  // KiB) hashed from the page cache while fsync waits for the disk.
  ShardWriteResult res;
  res.compression = ShardCompressionName(o.compress ? std::optional<int>(o.level) : std::nullopt);
  Status digested;
  {
    std::jthread digester([&] {
      std::vector<FileRegion> regions;
      int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
      struct stat st {};
      if (fd < 0 || ::fstat(fd, &st) != 0) {
        digested = Status::Internal("cannot read back " + tmp + ": " + std::strerror(errno));
        if (fd >= 0) ::close(fd);
        return;
      }
      res.file_bytes = st.st_size;
      const std::string bad = PartitionFile(chunk_regions, static_cast<uint64_t>(st.st_size), &regions);
      if (!bad.empty()) {
        ::close(fd);
        digested = Status::Internal(tmp + ": " + bad);
        return;
      }
      // Each chunk region's stored hash, matched by offset (both sorted).
      std::vector<std::pair<uint64_t, uint64_t>> by_offset(jobs.size());
      for (size_t n = 0; n < jobs.size(); ++n) by_offset[n] = {chunk_regions[n].offset, stored_hashes[n]};
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
          digested = Status::Internal("cannot read back " + tmp);
          break;
        }
        region_hashes[i] = XXH3_64bits(buf.data(), buf.size());
      }
      ::close(fd);
      if (digested.ok()) res.digest = Hex64(CombineDigest(regions, region_hashes));
    });
    if (o.fsync) {
      IoTimer timed{&io_time};
      status = FsyncPath(tmp, false);
    }
  }
  res.io_seconds = std::chrono::duration<double>(io_time).count();
  if (status.ok()) status = digested;
  if (!status.ok()) {
    std::remove(tmp.c_str());
    return status;
  }
  if (std::rename(tmp.c_str(), final_path.c_str()) != 0)
    return Status::Internal("rename " + tmp + ": " + std::strerror(errno));
  if (o.fsync) {
    std::string dir = final_path.substr(0, final_path.find_last_of('/'));
    OOMGUARD_RETURN_IF_ERROR(FsyncPath(dir, true));
  }
  return res;
}

}  // namespace oomguard::ckpt
