// FormatV2Reader, CheckedShard's reading of format 2 (shard_format.h): one
// pass over the bytes. Every chunk is read by one pool task that hashes it as stored (its
// region of the shard's digest), decodes it into the caller's buffer and
// hashes the decoded bytes block by block as they are written (codec.h), so
// each byte of a chunk is fetched from memory (or disk) once. Finish hashes
// the rest of the file (metadata, tensors not asked for) and compares the
// digest with the manifest's.
//
// Where the chunks come from depends on the page cache. A shard that is
// mostly cached (a warm load) is read through its mapping, in the tasks. A
// shard mostly on disk (a cold load, after a restart) is read by this thread
// with pread, in file order, a few chunks ahead of the tasks: the kernel's
// readahead sees one sequential reader and keeps the disk busy while the
// workers decode, where faulting the mapping in from every worker would
// leave each one waiting for its own reads and the disk idle between them.
// An uncompressed chunk is read straight into the caller's tensor. The
// environment variable OOMGUARD_CKPT_READS=mapping|pread|auto (the default)
// forces one way, to compare them or to test both.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/shard_check.h"
#include "sdk/checkpoint/shard_digest.h"
#include "sdk/checkpoint/shard_format.h"
#include "sdk/checkpoint/xxh.h"

namespace oomguard::ckpt {
namespace {

struct FileDescriptor {
  int fd = -1;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

// Less than half of the mapped file is in the page cache. Asked a slice at
// a time, so that a huge shard needs no huge vector.
bool MostlyOnDisk(std::span<const uint8_t> file) {
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  constexpr size_t kSlicePages = size_t{1} << 16;
  std::vector<unsigned char> resident(kSlicePages);
  size_t cached = 0, pages = 0;
  for (size_t off = 0; off < file.size(); off += kSlicePages * page) {
    const size_t len = std::min(file.size() - off, kSlicePages * page);
    if (::mincore(const_cast<uint8_t*>(file.data() + off), len, resident.data()) != 0)
      return false;  // unknown: the mapping, as before
    const size_t n = (len + page - 1) / page;
    for (size_t i = 0; i < n; ++i) cached += resident[i] & 1;
    pages += n;
  }
  return cached * 2 < pages;
}

enum class Reads { kAuto, kMapping, kPread };

// OOMGUARD_CKPT_READS.
StatusOr<Reads> ReadsSetting() {
  const char* v = std::getenv("OOMGUARD_CKPT_READS");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return Reads::kAuto;
  if (std::strcmp(v, "pread") == 0) return Reads::kPread;
  if (std::strcmp(v, "mapping") == 0) return Reads::kMapping;
  return Status::InvalidArgument("OOMGUARD_CKPT_READS='" + std::string(v).substr(0, 64) +
                                 "': expected auto, mapping or pread");
}

std::atomic<uint64_t> g_chunks_preads{0};

// Reads exactly n bytes at `offset`; an error says why.
std::string ReadFully(int fd, uint8_t* out, size_t n, uint64_t offset) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, out + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return std::string("cannot read: ") + std::strerror(errno);
    if (r == 0) return "the file ends at byte " + std::to_string(offset + got) + " (it was truncated)";
    got += static_cast<size_t>(r);
  }
  return "";
}

// What a task of FormatV2Reader::Read reports for one chunk: why it is
// bad (empty when good), and the hash of its stored bytes (when the whole
// file is verified).
struct ChunkResult {
  std::string error;
  uint64_t stored_hash = 0;
};

// One task of FormatV2Reader::Read: decodes (or copies) stored chunk
// `index` from `frame` into `dst` (nullptr: hash it only) and checks its
// xxh3 against `expect`. `in_place`: the frame was read into `dst` itself.
ChunkResult VerifyChunk(const uint8_t* frame, const StoredChunk& c, uint8_t* dst, uint64_t expect,
                        size_t index, bool raw, size_t es, int64_t full, bool verify_file, bool in_place) {
  thread_local std::vector<uint8_t> scratch;
  ChunkResult res;
  uint64_t got = 0;
  const auto size = static_cast<size_t>(c.size);
  const auto len = static_cast<size_t>(c.len);
  if (raw) {
    if (c.size != static_cast<uint64_t>(full)) {
      res.error = "chunk " + std::to_string(index) + " stores " + std::to_string(c.size) +
                  " bytes, a whole chunk is " + std::to_string(full);
      return res;
    }
    got = in_place || dst == nullptr ? XXH3_64bits(frame, len) : CopyHashed(frame, dst, len);
    if (verify_file) res.stored_hash = len == size ? got : XXH3_64bits(frame, size);
  } else {
    // The stored bytes first: they are then in cache for the decoder.
    if (verify_file) res.stored_hash = XXH3_64bits(frame, size);
    const std::string err =
        DecodeChunkHashed(frame, size, es, dst, static_cast<size_t>(full), len, &scratch, &got);
    if (!err.empty()) {
      res.error = "chunk " + std::to_string(index) + ": " + err;
      return res;
    }
  }
  if (got != expect)
    res.error = "chunk " + std::to_string(index) + ": xxh3 mismatch (stored " + Hex64(expect) +
                ", computed " + Hex64(got) + ")";
  return res;
}

// Opens `path` for pread, refusing a file that is no longer `size` bytes.
Status OpenToRead(const std::string& path, uint64_t size, FileDescriptor* fd) {
  fd->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd->fd < 0 || ::fstat(fd->fd, &st) != 0)
    return Status::DataLoss(path + ": cannot open: " + std::strerror(errno));
  if (static_cast<uint64_t>(st.st_size) != size)
    return Status::DataLoss(path + ": changed size while it was read (" + std::to_string(size) +
                            " bytes, now " + std::to_string(st.st_size) + ")");
  return Status::Ok();
}

}  // namespace

Status CheckReadsSetting() { return ReadsSetting().status(); }

uint64_t ChunksReadWithPread() { return g_chunks_preads.load(std::memory_order_relaxed); }

namespace {

// The format-2 reader (shard_format.h): every chunk's place and hashes, what
// has been hashed so far, and the manifest's digest.
class FormatV2Reader final : public ShardFormatReader {
 public:
  FormatV2Reader(const ManifestShard& shard, std::string path, bool verify_file)
      : path_(std::move(path)),
        compression_(shard.compression),
        digest_(shard.digest),
        verify_file_(verify_file) {}

  Status CheckRoot(const ShardReader& r) override {
    if (r.compression() != compression_)
      return Status::DataLoss(path_ + ": compression '" + r.compression() + "', the manifest says '" +
                              compression_ + "'");
    return Status::Ok();
  }
  Status Plan(ShardReader* reader, const std::vector<ShardEntry>& entries) override;
  // Hashes every region of the file now and compares the digest; the pass
  // then checks only the chunks' own hashes.
  Status VerifyFileFirst() override {
    OOMGUARD_RETURN_IF_ERROR(VerifyDigest());
    // The whole file is verified: the tasks need not hash the stored bytes again.
    verify_file_ = false;
    return Status::Ok();
  }
  Status Read(const std::vector<TensorRead>& reads, ThreadPool* pool) override;
  Status Finish(const Status& read_status) override {
    return read_status.ok() ? VerifyDigest() : read_status;
  }

 private:
  struct Tensor {
    bool chunked = false;
    bool raw = false;  // chunks stored without filters
    size_t elem_size = 0;
    int64_t full = 0;  // bytes of a whole chunk
    std::vector<StoredChunk> chunks;
    std::vector<uint64_t> expect;  // chunk_xxh3
    std::vector<size_t> region;    // each chunk's index in `regions_`
  };
  // One work item per chunk of the chunked reads, in file order.
  struct Item {
    size_t read, t, chunk;
  };
  // Reads a tensor that is not chunked (nothing, or a few bytes: a scalar)
  // through HDF5 and checks its xxh3; its bytes lie in the gaps of the digest.
  Status ReadUnchunked(const TensorRead& q);
  // Hashes what no task hashed and compares the digest with the manifest's.
  Status VerifyDigest();

  const std::string path_;
  const std::string compression_;  // the manifest's
  const std::string digest_;       // the manifest's
  bool verify_file_ = true;
  ShardReader* reader_ = nullptr;
  const ShardEntry* first_entry_ = nullptr;  // entries' start: a read's entry indexes tensors_
  std::vector<Tensor> tensors_;              // parallel to the entries
  std::vector<FileRegion> regions_;
  std::vector<uint64_t> region_hash_;
  std::vector<uint8_t> hashed_;  // per region: region_hash_ is known
  std::span<const uint8_t> file_;
};

}  // namespace

std::unique_ptr<ShardFormatReader> MakeFormatV2Reader(const ManifestShard& shard, const std::string& file,
                                                      bool hash_file) {
  return std::make_unique<FormatV2Reader>(shard, file, hash_file);
}

Status FormatV2Reader::Plan(ShardReader* reader, const std::vector<ShardEntry>& entries) {
  reader_ = reader;
  first_entry_ = entries.data();
  auto mapped = reader_->Mapped();
  if (!mapped.ok()) return mapped.status();
  file_ = *mapped;
  const bool uncompressed = reader_->compression() == "none";
  std::vector<FileRegion> chunks;
  tensors_.resize(entries.size());
  for (size_t t = 0; t < entries.size(); ++t) {
    const ShardEntry& e = entries[t];
    Tensor& T = tensors_[t];
    auto bad = [&](const std::string& why) {
      return Status::DataLoss(path_ + ": tensor " + e.dataset + " " + why);
    };
    H5Handle d(H5Dopen2(reader_->hdf5_file(), e.dataset.c_str(), H5P_DEFAULT));
    if (!d.valid()) return bad("cannot be opened (corrupt header)");
    H5Handle dcpl(H5Dget_create_plist(d.get()));
    T.chunked = dcpl.valid() && H5Pget_layout(dcpl.get()) == H5D_CHUNKED;
    if (!T.chunked) continue;  // a scalar or an empty tensor: read through HDF5, in the gaps of the digest
    ChunkLayout L;
    OOMGUARD_RETURN_IF_ERROR(reader_->StoredChunks(e.dataset, &T.chunks, &L, &T.raw));
    if (T.raw != uncompressed)
      return bad(std::string(T.raw ? "is stored without filters" : "is stored with filters") +
                 ", but the shard's compression is '" + reader_->compression() + "'");
    T.elem_size = DTypeSize(e.dtype);
    T.full = L.chunk_bytes;
    auto expect = ReadUint64ArrayAttr(d.get(), kChunkHashAttr, T.chunks.size(), file_.size());
    if (!expect)
      return bad("has no " + std::string(kChunkHashAttr) + " attribute of " +
                 std::to_string(T.chunks.size()) + " uint64 chunk hashes");
    T.expect = std::move(*expect);
    for (const StoredChunk& c : T.chunks) chunks.push_back({c.offset, c.size, true});
  }
  const std::string why = PartitionFile(std::move(chunks), file_.size(), &regions_);
  if (!why.empty()) return Status::DataLoss(path_ + ": " + why);
  region_hash_.assign(regions_.size(), 0);
  hashed_.assign(regions_.size(), 0);
  // Each chunk's region, by offset (regions are sorted and chunks unique).
  for (Tensor& T : tensors_) {
    T.region.reserve(T.chunks.size());
    for (const StoredChunk& c : T.chunks) {
      auto it = std::lower_bound(regions_.begin(), regions_.end(), c.offset,
                                 [](const FileRegion& r, uint64_t off) { return r.offset < off; });
      T.region.push_back(static_cast<size_t>(it - regions_.begin()));
    }
  }
  return Status::Ok();
}

Status FormatV2Reader::ReadUnchunked(const TensorRead& q) {
  const ShardEntry& e = *q.entry;
  std::vector<uint8_t> scratch;
  uint8_t* dst = q.out;
  if (e.bytes > 0) {
    if (dst == nullptr) {
      scratch.resize(static_cast<size_t>(e.bytes));  // bounded by the file (CheckDataset)
      dst = scratch.data();
    }
    Hdf5Lock lock;
    H5Handle d(H5Dopen2(reader_->hdf5_file(), e.dataset.c_str(), H5P_DEFAULT));
    H5Handle type(d.valid() ? H5Dget_type(d.get()) : H5I_INVALID_HID);
    if (!d.valid() || !type.valid() || H5Dread(d.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, dst) < 0)
      return Status::DataLoss(path_ + ": tensor " + e.dataset + ": HDF5 could not read it (corrupt file)");
  }
  const std::string got = Hex64(XXH3_64bits(dst, static_cast<size_t>(e.bytes)));
  if (got != e.xxh3)
    return Status::DataLoss(path_ + ": tensor " + e.dataset + ": xxh3 mismatch (stored " + e.xxh3 +
                            ", computed " + got + ")");
  return Status::Ok();
}

Status FormatV2Reader::Read(const std::vector<TensorRead>& reads, ThreadPool* pool) {
  auto where = [&](const TensorRead& q) { return path_ + ": tensor " + q.entry->dataset; };
  std::vector<Item> items;
  for (size_t r = 0; r < reads.size(); ++r) {
    const size_t t = static_cast<size_t>(reads[r].entry - first_entry_);
    const Tensor& T = tensors_[t];
    if (!T.chunked) {
      OOMGUARD_RETURN_IF_ERROR(ReadUnchunked(reads[r]));
      continue;
    }
    for (size_t c = 0; c < T.chunks.size(); ++c) items.push_back({r, t, c});
  }
  std::sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return tensors_[a.t].chunks[a.chunk].offset < tensors_[b.t].chunks[b.chunk].offset;
  });
  // A cold shard is read here, ahead of the tasks (see the top of the file).
  // A setting changed since the Checkpointer checked it (CheckReadsSetting)
  // counts as auto: it is no reason to call the shard corrupt.
  auto setting = ReadsSetting();
  const Reads how = setting.ok() ? *setting : Reads::kAuto;
  FileDescriptor fd;
  if (!items.empty() && (how == Reads::kPread || (how == Reads::kAuto && MostlyOnDisk(file_)))) {
    OOMGUARD_RETURN_IF_ERROR(OpenToRead(path_, file_.size(), &fd));
  }
  const bool stream = fd.fd >= 0;

  // Frames read ahead of their tasks: one per task in flight when streaming
  // (none for a chunk read into its tensor), at most kCheckWindowBytes of
  // them (at least one).
  ChunkBuffers frames;
  Status status;
  const size_t window = static_cast<size_t>(std::max(1, pool->size() * kTasksPerWorker));
  // Check-only zstd chunks decode into recycled buffers, at most
  // kCheckWindowBytes of them in flight (at least one chunk).
  ChunkBuffers checks;
  std::deque<std::future<ChunkResult>> inflight;
  WaitForAll<ChunkResult> wait_all{&inflight};  // tasks write into the caller's buffers (and ours)
  const bool verify_file = verify_file_;
  size_t next = 0, drained = 0;
  auto buffered = [&](const Item& it) { return reads[it.read].out == nullptr && !tensors_[it.t].raw; };
  while (drained < items.size()) {
    while (next < items.size() && inflight.size() < window && status.ok()) {
      const Item it = items[next];
      const Tensor& T = tensors_[it.t];
      const StoredChunk& c = T.chunks[it.chunk];
      const bool own_buffer = buffered(it);
      if (own_buffer && !checks.Fits(c.len, kCheckWindowBytes)) break;
      if (stream && !frames.Fits(static_cast<int64_t>(c.size), kCheckWindowBytes)) break;
      ++next;
      uint8_t* dst = nullptr;
      if (own_buffer) {
        dst = checks.Take(static_cast<size_t>(c.len));
      } else if (reads[it.read].out != nullptr) {
        dst = reads[it.read].out + c.begin;
      }
      const uint8_t* frame = file_.data() + c.offset;
      // Read into the tensor itself: a stored chunk that is exactly its part.
      bool in_place = false;
      if (stream) {
        // A stored size no chunk can have (a damaged index) is refused
        // before a buffer of that size is allocated.
        const uint64_t most = T.raw ? static_cast<uint64_t>(T.full) : EncodeBound(static_cast<size_t>(T.full));
        if (c.size > most) {
          status = Status::DataLoss(where(reads[it.read]) + ": chunk " + std::to_string(it.chunk) +
                                    " stores " + std::to_string(c.size) + " bytes, more than a chunk of " +
                                    std::to_string(T.full) + " bytes can take");
          if (own_buffer) checks.DropNewest();
          break;
        }
        in_place = T.raw && dst != nullptr && T.full == c.len && c.size == static_cast<uint64_t>(T.full);
        uint8_t* into = dst;
        if (!in_place) {
          into = frames.Take(static_cast<size_t>(c.size));
          frame = into;
        } else {
          frames.TakeNone();
        }
        const std::string err = ReadFully(fd.fd, into, static_cast<size_t>(c.size), c.offset);
        if (!err.empty()) {
          status =
              Status::DataLoss(where(reads[it.read]) + ": chunk " + std::to_string(it.chunk) + ": " + err);
          frames.DropNewest();
          if (own_buffer) checks.DropNewest();
          break;  // not submitted: the drain below stops at the tasks that were
        }
        if (in_place) frame = dst;
        g_chunks_preads.fetch_add(1, std::memory_order_relaxed);
      }
      const uint64_t expect = T.expect[it.chunk];
      const size_t index = it.chunk;
      const bool raw = T.raw;
      const size_t es = T.elem_size;
      const int64_t full = T.full;
      inflight.push_back(pool->Submit([frame, c, dst, expect, index, raw, es, full, verify_file, in_place] {
        return VerifyChunk(frame, c, dst, expect, index, raw, es, full, verify_file, in_place);
      }));
    }
    if (inflight.empty()) break;  // stopped submitting on an error
    ChunkResult res = inflight.front().get();
    inflight.pop_front();
    if (stream) frames.Reuse(frames.Oldest());
    const Item& it = items[drained++];
    if (buffered(it)) checks.Reuse(checks.Oldest());
    if (!res.error.empty()) {
      if (status.ok()) status = Status::DataLoss(where(reads[it.read]) + ": " + res.error);
      continue;
    }
    const size_t region = tensors_[it.t].region[it.chunk];
    region_hash_[region] = res.stored_hash;
    hashed_[region] = verify_file;
  }
  return status;
}

Status FormatV2Reader::VerifyDigest() {
  if (!verify_file_) return Status::Ok();
  for (size_t i = 0; i < regions_.size(); ++i) {
    if (hashed_[i]) continue;
    region_hash_[i] = XXH3_64bits(file_.data() + regions_[i].offset, static_cast<size_t>(regions_[i].length));
    hashed_[i] = 1;
  }
  const std::string got = Hex64(CombineDigest(regions_, region_hash_));
  if (got != digest_)
    return Status::DataLoss(path_ + ": shard digest " + got + " differs from the manifest's " + digest_ +
                            " (the file was changed after it was written)");
  return Status::Ok();
}

}  // namespace oomguard::ckpt
