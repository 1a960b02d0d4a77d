// ShardReader (sdk/checkpoint/shard.h): opens a shard, lists and describes
// its datasets, finds their stored chunks and maps the file. Below it,
// FormatV1Reader (shard_format.h): CheckedShard's reading of format 1, which
// decodes tensors out of the mapping in one pipeline over the thread pool.
// The writer is in shard.cc, the format-2 reader in shard_pass.cc.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <new>
#include <optional>

#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/compression.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/mapped_file.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/shard_format.h"
#include "sdk/checkpoint/xxh.h"
#include "sdk/checkpoint/zstd_filter.h"

namespace oomguard::ckpt {

struct ShardReader::Impl {
  H5Handle file;
  // A read-only mapping of the whole file, made on the first fast read;
  // reads of it survive the file being truncated (mapped_file.h).
  std::unique_ptr<MappedFile> map;
  // HDF5 addresses count from the end of the user block.
  hsize_t base = 0;
};

hid_t ShardReader::hdf5_file() const { return impl_->file.get(); }
uint64_t ShardReader::base_address() const { return impl_->base; }

ShardReader::~ShardReader() {
  Hdf5Lock lock;
  impl_.reset();
}

StatusOr<std::unique_ptr<ShardReader>> ShardReader::Open(const std::string& path) {
  // stat, not open: opening a FIFO would block until someone writes to it.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::NotFound(path + " does not exist");
  if (!S_ISREG(st.st_mode)) return Status::DataLoss(path + " is not a regular file");
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
  if (*format == kCheckpointFormat) {
    r->version_ = 2;
    auto compression = ReadStringAttr(f, kCompressionAttr, 64);
    if (!compression || !IsCompressionName(*compression))
      return Status::DataLoss(path +
                              ": root attribute compression is missing or not 'none' or 'zstd-<level>'");
    r->compression_ = *compression;
  } else if (*format == kCheckpointFormatV1) {
    r->version_ = 1;
  } else {
    return Status::DataLoss(path + ": format '" + *format + "', expected '" + std::string(kCheckpointFormat) +
                            "' (or '" + std::string(kCheckpointFormatV1) + "')");
  }
  r->format_ = *format;
  r->step_ = *step;
  r->rank_ = *rank;
  r->world_size_ = *ws;
  return r;
}

Status ShardReader::CheckRootRanges() const {
  if (world_size_ >= 1 && world_size_ <= kMaxWorldSize && rank_ >= 0 && rank_ < world_size_ && step_ >= 0 &&
      step_ <= kMaxStep)
    return Status::Ok();
  return Status::DataLoss(path_ + ": root attributes step " + std::to_string(step_) + ", rank " +
                          std::to_string(rank_) + ", world_size " + std::to_string(world_size_) +
                          " are out of range (step in [0, " + std::to_string(kMaxStep) + "], world_size in [1, " +
                          std::to_string(kMaxWorldSize) + "], rank in [0, world_size))");
}

StatusOr<std::vector<std::string>> ShardReader::DatasetPaths() {
  Hdf5Lock lock;
  // The checker's bounded walk (hdf5_io.h): a file nested thousands of groups
  // deep is refused at once instead of overflowing HDF5's recursive visitor.
  ObjectWalk walk = WalkObjects(impl_->file.get());
  if (!walk.error.empty()) return Status::DataLoss(path_ + ": " + walk.error);
  std::sort(walk.datasets.begin(), walk.datasets.end());
  return std::move(walk.datasets);
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
  // -1 when the file's dimensions overflow (inspect shows what is there;
  // CheckedShard refuses it).
  uint64_t bytes = H5Tget_size(type.get());
  bool overflow = false;
  for (hsize_t x : dims) overflow = overflow || __builtin_mul_overflow(bytes, x, &bytes);
  info.bytes = overflow || bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                   ? -1
                   : static_cast<int64_t>(bytes);
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

StatusOr<std::span<const uint8_t>> ShardReader::Mapped() {
  if (impl_->map == nullptr) {
    int fd = ::open(path_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return Status::DataLoss(path_ + ": cannot open: " + std::strerror(errno));
    auto map = MappedFile::Map(fd, path_);
    ::close(fd);
    if (!map.ok()) return map.status();
    if ((*map)->bytes().empty()) return Status::DataLoss(path_ + ": cannot map the file (it is empty)");
    impl_->map = std::move(map).value();
  }
  return impl_->map->bytes();
}

bool ShardReader::Truncated() const { return impl_->map != nullptr && impl_->map->truncated(); }

Status ShardReader::StoredChunks(const std::string& dataset, std::vector<StoredChunk>* out, ChunkLayout* L,
                                 bool* raw) {
  auto bad = [&](const std::string& why) {
    return Status::DataLoss(path_ + ": tensor " + dataset + " " + why);
  };
  Hdf5Lock lock;
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) return Status::DataLoss(path_ + " is gone");
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  H5Handle d(H5Dopen2(impl_->file.get(), dataset.c_str(), H5P_DEFAULT));
  if (!d.valid()) return bad("cannot be opened");
  H5Handle type(H5Dget_type(d.get()));
  const size_t es = H5Tget_size(type.get());
  H5Handle space(H5Dget_space(d.get()));
  const int nd = H5Sget_simple_extent_ndims(space.get());
  if (nd <= 0 || nd > H5S_MAX_RANK || es == 0) return bad("is not a chunked tensor");
  std::vector<hsize_t> dims(static_cast<size_t>(nd));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  const std::vector<int64_t> shape(dims.begin(), dims.end());
  H5Handle dcpl(H5Dget_create_plist(d.get()));
  if (H5Pget_layout(dcpl.get()) != H5D_CHUNKED) return bad("is not chunked");
  const int nf = H5Pget_nfilters(dcpl.get());
  if (nf == 0) {
    *raw = true;
  } else if (nf == 2) {
    unsigned flags = 0, cdv[4] = {0}, config = 0;
    size_t n = 4;
    const H5Z_filter_t f0 = H5Pget_filter2(dcpl.get(), 0, &flags, &n, cdv, 0, nullptr, &config);
    n = 4;
    const H5Z_filter_t f1 = H5Pget_filter2(dcpl.get(), 1, &flags, &n, cdv, 0, nullptr, &config);
    if (f0 != H5Z_FILTER_SHUFFLE || f1 != kZstdFilter) return bad("uses filters other than shuffle + zstd");
    *raw = false;
  } else {
    return bad("uses filters other than shuffle + zstd");
  }
  std::vector<hsize_t> cd(dims.size());
  int k = 0;
  if (H5Pget_chunk(dcpl.get(), nd, cd.data()) != nd || !IsContiguousLayout(shape, cd, &k))
    return bad("is not chunked in contiguous runs of its bytes, as checkpoint writers chunk tensors");
  // The writer's layout, recomputed from the stored chunk dims.
  L->k = k;
  L->chunk_dims = cd;
  int64_t row = static_cast<int64_t>(es);
  for (size_t i = static_cast<size_t>(k) + 1; i < cd.size(); ++i) row *= shape[i];
  const int64_t r = static_cast<int64_t>(cd[static_cast<size_t>(k)]);
  L->chunk_bytes = row * r;
  int64_t outer = 1;
  for (int i = 0; i < k; ++i) outer *= shape[static_cast<size_t>(i)];
  L->count = outer * ((shape[static_cast<size_t>(k)] + r - 1) / r);
  out->clear();
  out->reserve(static_cast<size_t>(L->count));
  std::vector<hsize_t> offset;
  for (int64_t i = 0; i < L->count; ++i) {
    StoredChunk c;
    ChunkPosition(shape, *L, i, &offset, &c.begin, &c.len);
    unsigned mask = 0;
    haddr_t addr = HADDR_UNDEF;
    hsize_t size = 0;
    if (H5Dget_chunk_info_by_coord(d.get(), offset.data(), &mask, &addr, &size) < 0 || addr == HADDR_UNDEF ||
        size == 0)
      return bad("chunk " + std::to_string(i) + " is missing");
    if (mask != 0) return bad("chunk " + std::to_string(i) + " was stored with filters skipped");
    c.offset = addr + impl_->base;
    c.size = size;
    if (c.offset < addr || c.offset > file_bytes || c.size > file_bytes - c.offset)
      return bad("chunk " + std::to_string(i) + " lies outside the file (corrupt chunk index)");
    out->push_back(c);
  }
  return Status::Ok();
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

// kDataLoss naming the tensor unless `h` is its stored xxh3.
Status CheckTensorHash(const std::string& path, const ShardEntry& e, uint64_t h) {
  const std::string got = Hex64(h);
  if (got == e.xxh3) return Status::Ok();
  return Status::DataLoss(path + ": tensor " + e.dataset + ": xxh3 mismatch (stored " + e.xxh3 +
                          ", computed " + got + ")");
}

// The format-1 reader (shard_format.h): tensors decoded out of the file's
// mapping in one pipeline over the pool, each one's xxh3 checked in order on
// the calling thread, while the whole file is hashed on a thread of its own
// (FileHashCheck) whose verdict Finish joins.
class FormatV1Reader final : public ShardFormatReader {
 public:
  FormatV1Reader(const ManifestShard& shard, const std::string& file, bool hash_file) {
    // The whole-file hash runs on its own thread while the pool decodes: it
    // reads the same pages, so the two passes share one trip through memory
    // (or one read from disk when the file is not cached).
    if (hash_file) file_check_.emplace(file, shard.xxh3);
  }
  // HDF5's own message names no tensor; a whole-file mismatch says more.
  Status OpenFailed(const Status& why) override {
    Status fs = FileVerdict();
    return fs.ok() ? why : fs;
  }
  Status Plan(ShardReader* reader, const std::vector<ShardEntry>&) override {
    reader_ = reader;
    return Status::Ok();
  }
  Status VerifyFileFirst() override { return FileVerdict(); }
  Status Read(const std::vector<TensorRead>& reads, ThreadPool* pool) override;
  Status Finish(const Status& read_status) override {
    Status fs = FileVerdict();
    return read_status.ok() ? fs : read_status;
  }

 private:
  // What the first phase of Read learns: whether HDF5 decoded a tensor (and,
  // for a check alone, the hash of what it decoded), and the file address of
  // every chunk it reads.
  struct Index {
    std::vector<bool> done_by_hdf5;
    std::vector<uint64_t> hdf5_hash;
    std::vector<ReadChunk> chunks;
  };
  Status FileVerdict() { return file_check_ ? file_check_->Verdict() : Status::Ok(); }
  // Adds read `r`'s chunks to `idx`; a dataset in another writer's layout is
  // read through HDF5 here. REQUIRES: Hdf5Lock held.
  Status IndexRead(const TensorRead& q, size_t r, Index* idx);
  // Decodes the indexed chunks in the pool and checks each tensor's hash in
  // order; the first error.
  Status DecodeChunks(const std::vector<TensorRead>& reads, const Index& idx, ThreadPool* pool);

  ShardReader* reader_ = nullptr;
  std::optional<FileHashCheck> file_check_;
};

Status FormatV1Reader::IndexRead(const TensorRead& q, size_t r, Index* idx) {
  const ShardEntry& e = *q.entry;
  auto where = [&] { return reader_->path() + ": tensor " + e.dataset; };
  if (e.bytes == 0) return Status::Ok();
  H5Handle d(H5Dopen2(reader_->hdf5_file(), e.dataset.c_str(), H5P_DEFAULT));
  if (!d.valid()) return Status::DataLoss(where() + " is missing");
  H5Handle dcpl(H5Dget_create_plist(d.get()));
  // CheckDataset checked that the stored type's size is the dtype's.
  const size_t es = DTypeSize(e.dtype);
  ChunkLayout L;
  if (!FastLayout(dcpl.get(), e.shape, es, &L)) {
    // Another writer's layout or filters: let HDF5 decode it (for a check
    // alone, into a buffer of its own that is hashed and dropped).
    std::vector<uint8_t> scratch;
    uint8_t* dst = q.out;
    if (dst == nullptr) {
      try {
        scratch.resize(static_cast<size_t>(e.bytes));
      } catch (const std::bad_alloc&) {
        return Status::ResourceExhausted(where() + ": no host memory for the " + std::to_string(e.bytes) +
                                         " bytes HDF5 needs to decode it");
      }
      dst = scratch.data();
    }
    H5Handle type(H5Dget_type(d.get()));
    if (H5Dread(d.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, dst) < 0)
      return Status::DataLoss(where() + ": HDF5 could not read it (corrupt chunk or missing filter)");
    if (q.out == nullptr) idx->hdf5_hash[r] = XXH3_64bits(dst, static_cast<size_t>(e.bytes));
    idx->done_by_hdf5[r] = true;
    return Status::Ok();
  }
  std::vector<hsize_t> offset;
  for (int64_t i = 0; i < L.count; ++i) {
    ReadChunk c{r, i, 0, 0, L.chunk_bytes, es, HADDR_UNDEF, 0};
    ChunkPosition(e.shape, L, i, &offset, &c.begin, &c.len);
    unsigned mask = 0;
    if (H5Dget_chunk_info_by_coord(d.get(), offset.data(), &mask, &c.addr, &c.size) < 0 ||
        c.addr == HADDR_UNDEF || c.size == 0)
      return Status::DataLoss(where() + ": chunk " + std::to_string(i) + " is missing");
    if (mask != 0)
      return Status::DataLoss(where() + ": chunk " + std::to_string(i) + " was stored with filters skipped");
    idx->chunks.push_back(c);
  }
  return Status::Ok();
}

Status FormatV1Reader::Read(const std::vector<TensorRead>& reads, ThreadPool* pool) {
  Index idx;
  idx.done_by_hdf5.assign(reads.size(), false);
  idx.hdf5_hash.assign(reads.size(), 0);
  // Phase 1, under the lock: collect the file address of every chunk.
  {
    Hdf5Lock lock;
    for (size_t r = 0; r < reads.size(); ++r) OOMGUARD_RETURN_IF_ERROR(IndexRead(reads[r], r, &idx));
  }
  // Phase 2: decode out of the mapping in the pool, hash in order here.
  OOMGUARD_RETURN_IF_ERROR(DecodeChunks(reads, idx, pool));
  // Tensors HDF5 decoded, and empty ones.
  for (size_t r = 0; r < reads.size(); ++r) {
    const ShardEntry& e = *reads[r].entry;
    uint64_t h = 0;
    if (e.bytes == 0) {
      h = XXH3_64bits(nullptr, 0);
    } else if (idx.done_by_hdf5[r]) {
      h = reads[r].out == nullptr ? idx.hdf5_hash[r]
                                  : XXH3_64bits(reads[r].out, static_cast<size_t>(e.bytes));
    } else {
      continue;
    }
    OOMGUARD_RETURN_IF_ERROR(CheckTensorHash(reader_->path(), e, h));
  }
  return Status::Ok();
}

Status FormatV1Reader::DecodeChunks(const std::vector<TensorRead>& reads, const Index& idx,
                                    ThreadPool* pool) {
  auto where = [&](size_t r) { return reader_->path() + ": tensor " + reads[r].entry->dataset; };
  const std::vector<ReadChunk>& chunks = idx.chunks;
  std::span<const uint8_t> mapped;
  if (!chunks.empty()) {
    auto m = reader_->Mapped();
    if (!m.ok()) return m.status();
    mapped = *m;
  }
  const uint8_t* base = mapped.data();
  const size_t map_bytes = mapped.size();
  std::vector<XXH3_state_t*> hashes(reads.size(), nullptr);
  struct HashFree {
    std::vector<XXH3_state_t*>* v;
    ~HashFree() {
      for (auto* h : *v)
        if (h != nullptr) XXH3_freeState(h);
    }
  } hash_free{&hashes};
  Status status;
  auto check_hash = [&](size_t r, uint64_t h) {
    if (status.ok()) status = CheckTensorHash(reader_->path(), *reads[r].entry, h);
  };
  const size_t window = static_cast<size_t>(std::max(1, pool->size() * kTasksPerWorker));
  // Chunks of check-only requests decode into recycled buffers, at most
  // kCheckWindowBytes of them in flight (at least one chunk), so checking a
  // shard needs memory for a few chunks, not for its tensors.
  ChunkBuffers checks;
  std::deque<std::future<std::string>> inflight;
  WaitForAll<std::string> wait_all{&inflight};  // tasks write into the caller's buffers (and ours)
  size_t next = 0, drained = 0;
  while (drained < chunks.size()) {
    while (next < chunks.size() && inflight.size() < window && status.ok()) {
      const ReadChunk c = chunks[next];
      const bool check_only = reads[c.req].out == nullptr;
      if (check_only && !checks.Fits(c.full, kCheckWindowBytes)) break;
      ++next;
      const uint64_t start = c.addr + reader_->base_address();
      if (start < c.addr || start > map_bytes || c.size > map_bytes - start) {
        status = Status::DataLoss(where(c.req) + ": chunk " + std::to_string(c.index) +
                                  " lies outside the file (corrupt chunk index)");
        break;
      }
      const uint8_t* frame = base + start;
      uint8_t* dst = nullptr;
      if (check_only) {
        dst = checks.Take(static_cast<size_t>(c.full));
      } else {
        dst = reads[c.req].out + c.begin;
      }
      inflight.push_back(pool->Submit([frame, c, dst, check_only]() -> std::string {
        thread_local std::vector<uint8_t> scratch, padded;
        std::string err;
        if (c.len == c.full || check_only) {
          err = DecodeChunk(frame, c.size, c.elem_size, dst, static_cast<size_t>(c.full), &scratch);
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
    const bool check_only = reads[c.req].out == nullptr;
    std::vector<uint8_t> check_buf;
    if (check_only) check_buf = checks.Oldest();
    struct Recycle {
      ChunkBuffers* checks;
      std::vector<uint8_t>* buf;
      ~Recycle() { checks->Reuse(std::move(*buf)); }
    } recycle{&checks, &check_buf};
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
    const uint8_t* decoded = check_only ? check_buf.data() : reads[c.req].out + c.begin;
    XXH3_64bits_update(h, decoded, static_cast<size_t>(c.len));
    const bool last_of_tensor = drained == chunks.size() || chunks[drained].req != c.req;
    if (last_of_tensor) check_hash(c.req, XXH3_64bits_digest(h));
  }
  while (!inflight.empty()) {
    inflight.front().wait();
    inflight.pop_front();
  }
  return status;
}

}  // namespace

std::unique_ptr<ShardFormatReader> MakeFormatV1Reader(const ManifestShard& shard, const std::string& file,
                                                      bool hash_file) {
  return std::make_unique<FormatV1Reader>(shard, file, hash_file);
}

}  // namespace oomguard::ckpt
