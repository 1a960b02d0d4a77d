#include "sdk/checkpoint/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <chrono>
#include <future>
#include <thread>

#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/zstd_filter.h"

namespace oomguard::ckpt {
namespace {

// In-flight compressed chunks per worker: enough to keep every worker busy
// while the writer thread waits on the oldest, small enough to bound memory.
constexpr int kWindowPerThread = 4;
// Dirty bytes after which the writer asks the kernel to start writing them
// back, so the disk works while later chunks are compressed instead of all at
// the final fsync.
constexpr int64_t kWritebackBytes = int64_t{32} << 20;

// Waits for every task still in `q` when it goes out of scope, so that no
// task outlives the locals and buffers it uses, however the scope is left.
template <typename T>
struct WaitForAll {
  std::deque<std::future<T>>* q;
  ~WaitForAll() {
    for (auto& f : *q)
      if (f.valid()) f.wait();
  }
};

bool IsFloatingPoint(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 || t == DType::kFloat64;
}

std::vector<hsize_t> Dims(const std::vector<int64_t>& shape) {
  return std::vector<hsize_t>(shape.begin(), shape.end());
}

std::string ShapeString(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
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
        H5Pset_shuffle(dcpl.get());
        const unsigned level = static_cast<unsigned>(o.level);
        H5Pset_filter(dcpl.get(), kZstdFilter, H5Z_FLAG_MANDATORY, 1, &level);
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

  // Chunks in file order. Each compression task reads staged bytes (a
  // partial edge chunk is zero-padded to the full chunk size, as HDF5 stores it).
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

  const size_t window = static_cast<size_t>(std::max(1, pool->size() * kWindowPerThread));
  FramePool local_frames;
  FramePool* frames = o.frames != nullptr ? o.frames : &local_frames;
  std::deque<std::future<FramePool::Frame>> inflight;
  // Tasks use `frames` and the staged bytes: if the midway hook throws (an
  // injected fault), they must finish before this frame's locals go away.
  WaitForAll<FramePool::Frame> wait_all{&inflight};
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
    const int64_t len = j.len;
    const bool fp = IsFloatingPoint(tensors[j.t].dtype);
    inflight.push_back(pool->Submit([p, len, full, es, level, fp, frames] {
      thread_local std::vector<uint8_t> scratch, padded;
      FramePool::Frame f = frames->Take(EncodeBound(static_cast<size_t>(full)));
      const uint8_t* in = p;
      if (len != full) {
        padded.assign(static_cast<size_t>(full), 0);
        std::memcpy(padded.data(), p, static_cast<size_t>(len));
        in = padded.data();
      }
      f.size = EncodeChunkInto(in, static_cast<size_t>(full), es, level, fp, &scratch, f.data.get(), f.capacity);
      return f;
    }));
    ++next_submit;
  };
  Status status;
  const size_t midway = jobs.size() / 2;
  int64_t unflushed = 0;
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
    FramePool::Frame frame = inflight.front().get();
    inflight.pop_front();
    struct GiveBack {
      FramePool* pool;
      FramePool::Frame* f;
      ~GiveBack() { pool->Give(std::move(*f)); }
    } give_back{frames, &frame};
    const Job& j = jobs[n];
    // The tensor hash runs on its own thread, in chunk order (one FIFO
    // worker), so this thread only feeds H5Dwrite_chunk: the write is what
    // a save waits for.
    tensor_hashed.push_back(tensor_hasher.Submit([&hashes, &data, &j, n, source] {
      XXH3_64bits_update(hashes[j.t], data[n], static_cast<size_t>(j.len));
      source->Release(j.t, j.begin, j.len);
    }));
    while (tensor_hashed.size() > 1 &&
           tensor_hashed.front().wait_for(std::chrono::seconds(0)) == std::future_status::ready)
      tensor_hashed.pop_front();
    if (n == midway && o.midway) o.midway();
    if (!status.ok()) continue;  // drain the window before returning
    if (frame.size == 0) {
      status = Status::Internal(tmp + ": zstd compression failed for /" + tensors[j.t].path);
      continue;
    }
    Hdf5Lock lock;
    if (H5Dwrite_chunk(planned[j.t].dset.get(), H5P_DEFAULT, 0, j.offset.data(), frame.size, frame.data.get()) <
        0)
      status = Status::Internal(tmp + ": H5Dwrite_chunk failed for /" + tensors[j.t].path + " chunk " +
                                std::to_string(j.i));
    unflushed += static_cast<int64_t>(frame.size);
    if (o.fsync && unflushed >= kWritebackBytes) start_writeback();
  }
  if (jobs.empty() && o.midway) o.midway();
  while (!tensor_hashed.empty()) {
    tensor_hashed.front().get();
    tensor_hashed.pop_front();
  }
  {
    Hdf5Lock lock;
    if (status.ok()) {
      for (size_t t = 0; t < tensors.size(); ++t) {
        uint64_t h = 0;
        if (!planned[t].layout.chunk_dims.empty()) {
          h = XXH3_64bits_digest(hashes[t]);
        } else {
          const uint8_t* p = tensors[t].bytes > 0 ? source->Acquire(t, 0, tensors[t].bytes) : nullptr;
          h = XXH3_64bits(p, static_cast<size_t>(tensors[t].bytes));
          if (p != nullptr) source->Release(t, 0, tensors[t].bytes);
        }
        Status s = WriteStringAttr(planned[t].dset.get(), "xxh3", Hex64(h));
        if (!s.ok() && status.ok()) status = s;
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
  // The file hash reads the page cache while fsync waits for the disk.
  ShardWriteResult res;
  uint64_t fh = 0;
  Status hashed;
  {
    std::jthread hasher([&] { hashed = HashFile(tmp, &fh, &res.file_bytes); });
    if (o.fsync) status = FsyncPath(tmp, false);
  }
  if (status.ok()) status = hashed;
  if (!status.ok()) {
    std::remove(tmp.c_str());
    return status;
  }
  res.file_xxh3 = Hex64(fh);
  if (std::rename(tmp.c_str(), final_path.c_str()) != 0)
    return Status::Internal("rename " + tmp + ": " + std::strerror(errno));
  if (o.fsync) {
    std::string dir = final_path.substr(0, final_path.find_last_of('/'));
    OOMGUARD_RETURN_IF_ERROR(FsyncPath(dir, true));
  }
  return res;
}

// ---------------------------------------------------------------- reader

struct ShardReader::Impl {
  ~Impl() {
    if (map != nullptr) ::munmap(map, map_bytes);
  }
  H5Handle file;
  // A read-only mapping of the whole file, made on the first fast read.
  void* map = nullptr;
  size_t map_bytes = 0;
  // HDF5 addresses count from the end of the user block.
  hsize_t base = 0;
};

ShardReader::~ShardReader() {
  Hdf5Lock lock;
  impl_.reset();
}

StatusOr<std::unique_ptr<ShardReader>> ShardReader::Open(const std::string& path) {
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    std::fclose(f);
  } else {
    return Status::NotFound(path + " does not exist");
  }
  std::unique_ptr<ShardReader> r(new ShardReader());
  r->impl_ = std::make_unique<Impl>();
  r->path_ = path;
  Hdf5Lock lock;
  OOMGUARD_RETURN_IF_ERROR(EnsureZstdRegistered());
  H5Handle fapl(H5Pcreate(H5P_FILE_ACCESS));
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
  r->impl_->file = H5Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()));
  if (!r->impl_->file.valid())
    return Status::DataLoss(path + ": not a readable HDF5 file (truncated or corrupt)");
  hid_t f = r->impl_->file.get();
  {
    H5Handle fcpl(H5Fget_create_plist(f));
    hsize_t ub = 0;
    if (fcpl.valid() && H5Pget_userblock(fcpl.get(), &ub) >= 0) r->impl_->base = ub;
  }
  auto format = ReadStringAttr(f, "format");
  auto step = ReadInt64Attr(f, "step");
  auto rank = ReadInt64Attr(f, "rank");
  auto ws = ReadInt64Attr(f, "world_size");
  if (!format || !step || !rank || !ws)
    return Status::DataLoss(path + ": missing root attribute format/step/rank/world_size");
  if (*format != kCheckpointFormat)
    return Status::DataLoss(path + ": format '" + *format + "', expected '" + std::string(kCheckpointFormat) +
                            "'");
  r->format_ = *format;
  r->step_ = *step;
  r->rank_ = static_cast<int>(*rank);
  r->world_size_ = static_cast<int>(*ws);
  return r;
}

StatusOr<std::vector<std::string>> ShardReader::DatasetPaths() {
  Hdf5Lock lock;
  std::vector<std::string> out;
  auto visit = [](hid_t, const char* name, const H5O_info_t* info, void* op) -> herr_t {
    if (info->type == H5O_TYPE_DATASET)
      static_cast<std::vector<std::string>*>(op)->push_back(std::string("/") + name);
    return 0;
  };
  if (H5Ovisit(impl_->file.get(), H5_INDEX_NAME, H5_ITER_INC, visit, &out) < 0)
    return Status::DataLoss(path_ + ": cannot list datasets (corrupt file)");
  std::sort(out.begin(), out.end());
  return out;
}

StatusOr<TensorInfo> ShardReader::Info(const std::string& dataset) {
  Hdf5Lock lock;
  TensorInfo info;
  info.path = dataset;
  H5Handle d(H5Dopen2(impl_->file.get(), dataset.c_str(), H5P_DEFAULT));
  if (!d.valid()) return Status::DataLoss(path_ + ": cannot open tensor " + dataset);
  info.dtype = ReadStringAttr(d.get(), "dtype").value_or("");
  info.xxh3 = ReadStringAttr(d.get(), "xxh3").value_or("");
  H5Handle space(H5Dget_space(d.get()));
  int nd = H5Sget_simple_extent_ndims(space.get());
  std::vector<hsize_t> dims(static_cast<size_t>(std::max(nd, 0)));
  if (nd > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  info.shape.assign(dims.begin(), dims.end());
  H5Handle type(H5Dget_type(d.get()));
  int64_t elems = 1;
  for (auto x : dims) elems *= static_cast<int64_t>(x);
  info.bytes = elems * static_cast<int64_t>(H5Tget_size(type.get()));
  info.stored_bytes = static_cast<int64_t>(H5Dget_storage_size(d.get()));
  H5Handle dcpl(H5Dget_create_plist(d.get()));
  if (H5Pget_layout(dcpl.get()) == H5D_CHUNKED) {
    std::vector<hsize_t> cd(static_cast<size_t>(std::max(nd, 1)));
    H5Pget_chunk(dcpl.get(), static_cast<int>(cd.size()), cd.data());
    info.chunk.assign(cd.begin(), cd.end());
  }
  int nf = H5Pget_nfilters(dcpl.get());
  for (int i = 0; i < nf; ++i) {
    unsigned flags = 0, cd_values[8] = {0};
    size_t cd_n = 8;
    char name[64] = {0};
    unsigned config = 0;
    H5Z_filter_t id = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &cd_n, cd_values,
                                     sizeof(name), name, &config);
    if (id == H5Z_FILTER_SHUFFLE)
      info.filters.push_back("shuffle");
    else if (id == kZstdFilter)
      info.filters.push_back("zstd(level=" + std::to_string(cd_n > 0 ? cd_values[0] : 0) + ")");
    else if (id == H5Z_FILTER_DEFLATE)
      info.filters.push_back("gzip");
    else
      info.filters.push_back("filter " + std::to_string(id));
  }
  return info;
}

Status ShardReader::ReadAll(const std::string& dataset, std::vector<uint8_t>* out, ThreadPool* pool) {
  auto info = Info(dataset);
  if (!info.ok()) return info.status();
  out->assign(static_cast<size_t>(info->bytes), 0);
  return ReadInto(dataset, false, DType::kUInt8, {}, out->data(), info->bytes, pool);
}

namespace {

// One chunk of a fast read: where its frame lies in the file and where its
// bytes go.
struct ReadChunk {
  size_t req;
  int64_t index, begin, len, full;
  size_t elem_size;
  haddr_t addr;
  hsize_t size;
};

// Recomputes the writer's chunk layout from a dataset's stored chunk dims, or
// returns false when the dataset is not shuffle + zstd in contiguous runs
// (another writer's file: HDF5 decodes it instead).
bool FastLayout(hid_t dcpl, const std::vector<int64_t>& shape, size_t es, ChunkLayout* L) {
  if (H5Pget_layout(dcpl) != H5D_CHUNKED || H5Pget_nfilters(dcpl) != 2) return false;
  unsigned flags = 0, cdv[4] = {0}, config = 0;
  size_t n = 4;
  H5Z_filter_t f0 = H5Pget_filter2(dcpl, 0, &flags, &n, cdv, 0, nullptr, &config);
  n = 4;
  H5Z_filter_t f1 = H5Pget_filter2(dcpl, 1, &flags, &n, cdv, 0, nullptr, &config);
  std::vector<hsize_t> cd(shape.size());
  if (cd.empty() || H5Pget_chunk(dcpl, static_cast<int>(cd.size()), cd.data()) < 0) return false;
  int k = 0;
  if (f0 != H5Z_FILTER_SHUFFLE || f1 != kZstdFilter || !IsContiguousLayout(shape, cd, &k)) return false;
  L->k = k;
  L->chunk_dims = cd;
  int64_t row = static_cast<int64_t>(es);
  for (size_t i = static_cast<size_t>(k) + 1; i < cd.size(); ++i) row *= shape[i];
  L->chunk_bytes = row * static_cast<int64_t>(cd[static_cast<size_t>(k)]);
  int64_t outer = 1;
  for (int i = 0; i < k; ++i) outer *= shape[static_cast<size_t>(i)];
  const int64_t r = static_cast<int64_t>(cd[static_cast<size_t>(k)]);
  L->count = outer * ((shape[static_cast<size_t>(k)] + r - 1) / r);
  return true;
}

}  // namespace

Status ShardReader::ReadMany(const std::vector<ReadRequest>& requests, ThreadPool* pool) {
  auto where = [&](size_t r) { return path_ + ": tensor " + requests[r].dataset; };
  std::vector<std::string> stored_hash(requests.size());
  std::vector<bool> done_by_hdf5(requests.size(), false);
  std::vector<ReadChunk> chunks;
  // Phase 1, under the lock: check every dataset against its request and
  // collect the file address of every chunk.
  {
    Hdf5Lock lock;
    for (size_t r = 0; r < requests.size(); ++r) {
      const ReadRequest& q = requests[r];
      H5Handle d(H5Dopen2(impl_->file.get(), q.dataset.c_str(), H5P_DEFAULT));
      if (!d.valid()) return Status::DataLoss(where(r) + " is missing");
      auto dt = ReadStringAttr(d.get(), "dtype");
      stored_hash[r] = ReadStringAttr(d.get(), "xxh3").value_or("");
      if (stored_hash[r].empty()) return Status::DataLoss(where(r) + " has no xxh3 attribute");
      if (q.check && dt.value_or("") != DTypeName(q.dtype))
        return Status::DataLoss(where(r) + " has dtype '" + dt.value_or("?") + "', expected '" +
                                std::string(DTypeName(q.dtype)) + "'");
      H5Handle space(H5Dget_space(d.get()));
      int nd = H5Sget_simple_extent_ndims(space.get());
      std::vector<hsize_t> dims(static_cast<size_t>(std::max(nd, 0)));
      if (nd > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
      std::vector<int64_t> shape(dims.begin(), dims.end());
      if (q.check && shape != q.shape)
        return Status::DataLoss(where(r) + " has shape " + ShapeString(shape) + ", expected " +
                                ShapeString(q.shape));
      H5Handle type(H5Dget_type(d.get()));
      const size_t es = H5Tget_size(type.get());
      int64_t elems = 1;
      for (int64_t x : shape) elems *= x;
      if (elems * static_cast<int64_t>(es) != q.bytes)
        return Status::DataLoss(where(r) + " holds " + std::to_string(elems * static_cast<int64_t>(es)) +
                                " bytes, expected " + std::to_string(q.bytes));
      H5Handle dcpl(H5Dget_create_plist(d.get()));
      ChunkLayout L;
      if (q.bytes == 0) continue;
      if (!FastLayout(dcpl.get(), shape, es, &L)) {
        // Another writer's layout or filters: let HDF5 decode it.
        if (H5Dread(d.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, q.out) < 0)
          return Status::DataLoss(where(r) + ": HDF5 could not read it (corrupt chunk or missing filter)");
        done_by_hdf5[r] = true;
        continue;
      }
      std::vector<hsize_t> offset;
      for (int64_t i = 0; i < L.count; ++i) {
        ReadChunk c{r, i, 0, 0, L.chunk_bytes, es, HADDR_UNDEF, 0};
        ChunkPosition(shape, L, i, &offset, &c.begin, &c.len);
        unsigned mask = 0;
        if (H5Dget_chunk_info_by_coord(d.get(), offset.data(), &mask, &c.addr, &c.size) < 0 ||
            c.addr == HADDR_UNDEF || c.size == 0)
          return Status::DataLoss(where(r) + ": chunk " + std::to_string(i) + " is missing");
        if (mask != 0)
          return Status::DataLoss(where(r) + ": chunk " + std::to_string(i) + " was stored with filters skipped");
        chunks.push_back(c);
      }
    }
  }

  // Phase 2: decode out of the mapping in the pool, hash in order here.
  if (!chunks.empty() && impl_->map == nullptr) {
    int fd = ::open(path_.c_str(), O_RDONLY);
    if (fd < 0) return Status::DataLoss(path_ + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_size > 0) {
      void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        impl_->map = p;
        impl_->map_bytes = static_cast<size_t>(st.st_size);
        (void)::madvise(p, impl_->map_bytes, MADV_SEQUENTIAL);
      }
    }
    ::close(fd);
    if (impl_->map == nullptr) return Status::DataLoss(path_ + ": cannot map the file");
  }
  const auto* base = static_cast<const uint8_t*>(impl_->map);
  std::vector<XXH3_state_t*> hashes(requests.size(), nullptr);
  struct HashFree {
    std::vector<XXH3_state_t*>* v;
    ~HashFree() {
      for (auto* h : *v)
        if (h != nullptr) XXH3_freeState(h);
    }
  } hash_free{&hashes};
  Status status;
  auto check_hash = [&](size_t r, uint64_t h) {
    const std::string got = Hex64(h);
    if (got != stored_hash[r] && status.ok())
      status = Status::DataLoss(where(r) + ": xxh3 mismatch (stored " + stored_hash[r] + ", computed " + got +
                                ")");
  };
  const size_t window = static_cast<size_t>(std::max(1, pool->size() * kWindowPerThread));
  std::deque<std::future<std::string>> inflight;
  WaitForAll<std::string> wait_all{&inflight};  // tasks write into the caller's buffers
  size_t next = 0, drained = 0;
  while (drained < chunks.size()) {
    while (next < chunks.size() && inflight.size() < window && status.ok()) {
      const ReadChunk c = chunks[next++];
      if (c.addr + impl_->base + c.size > impl_->map_bytes) {
        status = Status::DataLoss(where(c.req) + ": chunk " + std::to_string(c.index) +
                                  " lies outside the file (corrupt chunk index)");
        break;
      }
      const uint8_t* frame = base + impl_->base + c.addr;
      uint8_t* dst = requests[c.req].out + c.begin;
      inflight.push_back(pool->Submit([frame, c, dst]() -> std::string {
        thread_local std::vector<uint8_t> scratch, padded;
        std::string err;
        if (c.len == c.full) {
          err = DecodeChunk(frame, c.size, c.elem_size, dst, static_cast<size_t>(c.len), &scratch);
        } else {
          padded.resize(static_cast<size_t>(c.full));
          err = DecodeChunk(frame, c.size, c.elem_size, padded.data(), static_cast<size_t>(c.full), &scratch);
          if (err.empty()) std::memcpy(dst, padded.data(), static_cast<size_t>(c.len));
        }
        return err.empty() ? err : "chunk " + std::to_string(c.index) + ": " + err;
      }));
    }
    if (inflight.empty()) break;  // stopped submitting on an error
    std::string err = inflight.front().get();
    inflight.pop_front();
    const ReadChunk& c = chunks[drained++];
    if (!err.empty()) {
      if (status.ok()) status = Status::DataLoss(where(c.req) + ": " + err);
      continue;
    }
    if (!status.ok()) continue;  // drain the window before returning
    XXH3_state_t*& h = hashes[c.req];
    if (h == nullptr) {
      h = XXH3_createState();
      XXH3_64bits_reset(h);
    }
    XXH3_64bits_update(h, requests[c.req].out + c.begin, static_cast<size_t>(c.len));
    const bool last_of_tensor = drained == chunks.size() || chunks[drained].req != c.req;
    if (last_of_tensor) check_hash(c.req, XXH3_64bits_digest(h));
  }
  while (!inflight.empty()) {
    inflight.front().wait();
    inflight.pop_front();
  }
  if (!status.ok()) return status;
  // Tensors HDF5 decoded, and empty ones.
  for (size_t r = 0; r < requests.size(); ++r)
    if (done_by_hdf5[r] || requests[r].bytes == 0)
      check_hash(r, XXH3_64bits(requests[r].out, static_cast<size_t>(requests[r].bytes)));
  return status;
}

}  // namespace oomguard::ckpt
