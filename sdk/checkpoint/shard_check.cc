#include "sdk/checkpoint/shard_check.h"

#include <sys/stat.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/shard_format.h"
#include "sdk/checkpoint/zstd_filter.h"

namespace oomguard::ckpt {

std::string ShapeString(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

namespace {

// The inventory attribute: about 40 bytes per tensor.
constexpr size_t kMaxInventoryBytes = size_t{16} << 20;
// The writer's largest chunk (CheckpointOptions.chunk_bytes is at most
// 1 GiB); a reader allocates a chunk's decoded size, so no more is accepted.
constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 30;

bool IsLowerHex16(const std::string& s) {
  return s.size() == 16 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

bool MulOverflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

// Checks one dataset as the header describes. REQUIRES: Hdf5Lock held.
StatusOr<ShardEntry> CheckDataset(hid_t file, const std::string& dataset, uint64_t file_bytes, uint64_t base,
                                  const std::string& where) {
  auto bad = [&](const std::string& why) {
    return Status::DataLoss(where + ": tensor " + PrintableName(dataset) + " " + why);
  };
  H5Handle d(H5Dopen2(file, dataset.c_str(), H5P_DEFAULT));
  if (!d.valid()) return bad("cannot be opened (corrupt header)");
  H5Handle dcpl(H5Dget_create_plist(d.get()));
  if (!dcpl.valid()) return bad("has an unreadable creation property list");
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (layout == H5D_VIRTUAL)
    return bad(
        "is a virtual dataset (its data would come from other files); a checkpoint holds its tensors itself");
  const int externals = H5Pget_external_count(dcpl.get());
  if (externals != 0) {
    char name[256] = {0};
    off_t offset = 0;
    hsize_t size = 0;
    std::string first;
    if (externals > 0 && H5Pget_external(dcpl.get(), 0, sizeof(name) - 1, name, &offset, &size) >= 0)
      first = " ('" + PrintableName(name) + "')";
    return bad("keeps its data in an external file" + first + "; a checkpoint holds its tensors itself");
  }
  if (layout != H5D_CHUNKED && layout != H5D_CONTIGUOUS && layout != H5D_COMPACT)
    return bad("has an unknown storage layout");
  const int nfilters = H5Pget_nfilters(dcpl.get());
  if (nfilters < 0) return bad("has an unreadable filter pipeline");
  for (int i = 0; i < nfilters; ++i) {
    unsigned flags = 0, cd[8] = {0}, config = 0;
    size_t ncd = 8;
    const H5Z_filter_t id =
        H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &ncd, cd, 0, nullptr, &config);
    if (id != H5Z_FILTER_SHUFFLE && id != kZstdFilter && id != H5Z_FILTER_DEFLATE &&
        id != H5Z_FILTER_FLETCHER32)
      return bad("uses HDF5 filter " + std::to_string(id) + ", which no checkpoint writer uses");
  }

  ShardEntry e;
  e.dataset = dataset;
  const auto dtype_name = ReadStringAttr(d.get(), "dtype");
  const auto dtype = dtype_name ? ParseDType(*dtype_name) : std::nullopt;
  if (!dtype) return bad("has no valid dtype attribute (got '" + PrintableName(dtype_name.value_or("")) + "')");
  e.dtype = *dtype;
  const auto xxh3 = ReadStringAttr(d.get(), "xxh3");
  if (!xxh3 || !IsLowerHex16(*xxh3)) return bad("has no xxh3 attribute of 16 lowercase hex digits");
  e.xxh3 = *xxh3;

  H5Handle type(H5Dget_type(d.get()));
  const H5T_class_t cls = H5Tget_class(type.get());
  const size_t es = H5Tget_size(type.get());
  const H5T_order_t order = H5Tget_order(type.get());
  if ((cls != H5T_INTEGER && cls != H5T_FLOAT) || es != DTypeSize(e.dtype) ||
      (es > 1 && order != H5T_ORDER_LE))
    return bad("is stored as an HDF5 type that does not hold dtype " + std::string(DTypeName(e.dtype)) +
               " (a little-endian integer or float of " + std::to_string(DTypeSize(e.dtype)) + " bytes)");

  H5Handle space(H5Dget_space(d.get()));
  const H5S_class_t sclass = H5Sget_simple_extent_type(space.get());
  if (sclass != H5S_SCALAR && sclass != H5S_SIMPLE) return bad("has no shape (a null dataspace)");
  const int nd = H5Sget_simple_extent_ndims(space.get());
  if (nd < 0 || nd > H5S_MAX_RANK) return bad("has an unreadable shape");
  std::vector<hsize_t> dims(static_cast<size_t>(nd));
  if (nd > 0 && H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0)
    return bad("has an unreadable shape");
  uint64_t bytes = es;
  for (hsize_t x : dims) {
    if (x > static_cast<hsize_t>(std::numeric_limits<int64_t>::max()) || MulOverflows(bytes, x, &bytes))
      return bad("has dimensions whose product overflows 64 bits");
  }
  if (bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return bad("has dimensions whose product overflows 64 bits");
  e.shape.assign(dims.begin(), dims.end());
  e.bytes = static_cast<int64_t>(bytes);

  // The sizes must be ones this file can back before anyone allocates them.
  const std::string declared = "declares " + std::to_string(bytes) + " bytes";
  if (layout == H5D_CONTIGUOUS && bytes > 0) {
    const haddr_t addr = H5Dget_offset(d.get());
    const hsize_t stored = H5Dget_storage_size(d.get());
    if (addr == HADDR_UNDEF || stored != bytes)
      return bad(declared + " but stores " + std::to_string(stored) +
                 " in the file (HDF5 would invent fill values for the rest)");
    if (addr + base < addr || addr + base > file_bytes || bytes > file_bytes - (addr + base))
      return bad(declared + " that lie outside the file");
  } else if (layout == H5D_CHUNKED) {
    std::vector<hsize_t> cd(static_cast<size_t>(std::max(nd, 1)));
    if (H5Pget_chunk(dcpl.get(), static_cast<int>(cd.size()), cd.data()) != nd || nd == 0)
      return bad("has chunk dimensions that do not match its shape");
    cd.resize(static_cast<size_t>(nd));
    uint64_t chunk_bytes = es, chunks = 1;
    for (int i = 0; i < nd; ++i) {
      const hsize_t c = cd[static_cast<size_t>(i)];
      if (c == 0 || MulOverflows(chunk_bytes, c, &chunk_bytes) || chunk_bytes > kMaxChunkBytes)
        return bad("has chunks larger than 1 GiB, the largest a checkpoint writes");
      const uint64_t per_dim = dims[static_cast<size_t>(i)] / c + (dims[static_cast<size_t>(i)] % c != 0);
      if (MulOverflows(chunks, per_dim, &chunks)) return bad("has more chunks than the file has bytes");
    }
    // Every stored chunk takes at least one byte of the file.
    if (chunks > file_bytes)
      return bad("has " + std::to_string(chunks) + " chunks, more than the file has bytes");
    hsize_t present = 0;
    if (H5Dget_num_chunks(d.get(), space.get(), &present) < 0) return bad("has an unreadable chunk index");
    if (present != chunks)
      return bad("has " + std::to_string(present) + " of its " + std::to_string(chunks) +
                 " chunks (HDF5 would invent fill values for the rest)");
    const hsize_t stored = chunks > 0 ? H5Dget_storage_size(d.get()) : 0;
    if (stored > file_bytes)
      return bad("stores " + std::to_string(stored) + " bytes, more than the file holds");
    uint64_t padded = 0;
    if (MulOverflows(chunks, chunk_bytes, &padded) ||
        (padded > 0 && (stored == 0 || padded / stored > kMaxExpansion)))
      return bad(declared + " from " + std::to_string(stored) + " stored, more than its filters can expand");
  }
  return e;
}

}  // namespace

StatusOr<Manifest> ReadStepManifest(const std::string& step_dir, int64_t step) {
  auto m = ReadManifest(step_dir);
  if (!m.ok()) return m.status();
  if (m->step != step)
    return Status::DataLoss(step_dir + "/" + kManifestName + " names step " + std::to_string(m->step));
  return m;
}

StatusOr<std::unique_ptr<CheckedShard>> CheckedShard::Open(const std::string& step_dir,
                                                           const Manifest& manifest,
                                                           const ManifestShard& shard, bool hash_file) {
  std::unique_ptr<CheckedShard> c(new CheckedShard());
  c->path_ = step_dir + "/" + shard.file;
  const std::string& file = c->path_;
  struct stat st {};
  if (::lstat(file.c_str(), &st) != 0)
    return Status::DataLoss(file + " (rank " + std::to_string(shard.rank) + ") is missing");
  if (S_ISLNK(st.st_mode))
    return Status::DataLoss(file +
                            " is a symbolic link; a checkpoint's shards are regular files in its directory");
  if (!S_ISREG(st.st_mode)) return Status::DataLoss(file + " is not a regular file");
  if (st.st_size != shard.bytes)
    return Status::DataLoss(file + " is " + std::to_string(st.st_size) + " bytes, the manifest says " +
                            std::to_string(shard.bytes) + " (truncated or rewritten)");
  c->size_at_open_ = st.st_size;
  // The one place that asks which format the shard has.
  c->format_ = ShardFormatReader::For(manifest, shard, file, hash_file);
  auto reader = ShardReader::Open(file);
  if (!reader.ok()) return c->format_->OpenFailed(reader.status());
  c->reader_ = std::move(reader).value();
  ShardReader& r = *c->reader_;
  if (r.format() != manifest.format)
    return Status::DataLoss(file + ": format '" + r.format() + "', the manifest's is '" + manifest.format +
                            "'");
  OOMGUARD_RETURN_IF_ERROR(c->format_->CheckRoot(r));
  OOMGUARD_RETURN_IF_ERROR(r.CheckRootRanges());
  if (r.step() != manifest.step || r.rank() != shard.rank || r.world_size() != manifest.world_size)
    return Status::DataLoss(file + ": root attributes say step " + std::to_string(r.step()) + " rank " +
                            std::to_string(r.rank()) + " world size " + std::to_string(r.world_size()) +
                            ", the manifest step " + std::to_string(manifest.step) + " rank " +
                            std::to_string(shard.rank) + " world size " +
                            std::to_string(manifest.world_size));

  Hdf5Lock lock;
  const hid_t f = r.hdf5_file();
  // Bounded in depth and links before anything deeper is opened (hdf5_io.h).
  const ObjectWalk walk = WalkObjects(f);
  if (!walk.error.empty()) return Status::DataLoss(file + ": " + walk.error);

  // The inventory: what the writer wrote, against what the file holds.
  struct Listed {
    std::string dataset;
    std::optional<DType> dtype;  // nullopt: a shard without an inventory
    std::optional<std::vector<int64_t>> shape;
  };
  std::vector<Listed> inventory;
  if (H5Aexists(f, kInventoryAttr) > 0) {
    const Status unreadable = Status::DataLoss(file + ": the tensor inventory attribute is unreadable");
    auto text = ReadStringAttr(f, kInventoryAttr, kMaxInventoryBytes);
    nlohmann::json j;
    if (text && JsonNestingDepth(*text, 3) <= 3)
      j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_array()) return unreadable;
    for (const auto& t : j) {
      if (!t.is_object() || !t.contains("path") || !t["path"].is_string() || !t.contains("dtype") ||
          !t["dtype"].is_string() || !t.contains("shape") || !t["shape"].is_array())
        return unreadable;
      Listed l{"/" + t["path"].get<std::string>(), ParseDType(t["dtype"].get<std::string>()),
               std::vector<int64_t>()};
      if (!l.dtype) return unreadable;
      for (const auto& d : t["shape"]) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0) return unreadable;
        l.shape->push_back(d.get<int64_t>());
      }
      inventory.push_back(std::move(l));
    }
  } else {
    std::vector<std::string> found = walk.datasets;  // a shard written before the inventory existed
    std::sort(found.begin(), found.end());
    for (auto& ds : found) inventory.push_back({std::move(ds), std::nullopt, std::nullopt});
  }
  const std::set<std::string> present(walk.datasets.begin(), walk.datasets.end());
  std::set<std::string> listed;
  for (const Listed& l : inventory)
    if (!listed.insert(l.dataset).second)
      return Status::DataLoss(file + ": the tensor inventory lists " + PrintableName(l.dataset) + " twice");
  for (const Listed& l : inventory)
    if (!present.count(l.dataset))
      return Status::DataLoss(file + ": tensor " + PrintableName(l.dataset) +
                              " is missing (the shard's inventory lists it)");
  for (const std::string& ds : walk.datasets)
    if (!listed.count(ds))
      return Status::DataLoss(file + ": holds " + PrintableName(ds) +
                              ", which its tensor inventory does not list");

  for (const Listed& l : inventory) {
    auto e = CheckDataset(f, l.dataset, static_cast<uint64_t>(st.st_size), r.base_address(), file);
    if (!e.ok()) return e.status();
    if ((l.dtype && *l.dtype != e->dtype) || (l.shape && *l.shape != e->shape))
      return Status::DataLoss(file + ": tensor " + PrintableName(l.dataset) + " has dtype " +
                              std::string(DTypeName(e->dtype)) + " and shape " + ShapeString(e->shape) +
                              ", its inventory says " + std::string(DTypeName(*l.dtype)) + " and " +
                              ShapeString(*l.shape));
    if (__builtin_add_overflow(c->total_bytes_, e->bytes, &c->total_bytes_))
      return Status::DataLoss(file + ": its tensors together declare more than 2^63 bytes");
    c->entries_.push_back(std::move(e).value());
  }
  OOMGUARD_RETURN_IF_ERROR(c->format_->Plan(c->reader_.get(), c->entries_));
  // Cheaper checks first: see kDigestFirstRatio. Loads allocate objects of
  // their declared sizes, so this runs before Open returns.
  if (hash_file && c->total_bytes_ / kDigestFirstRatio > st.st_size)
    OOMGUARD_RETURN_IF_ERROR(c->format_->VerifyFileFirst());
  return c;
}

std::unique_ptr<ShardFormatReader> ShardFormatReader::For(const Manifest& manifest,
                                                          const ManifestShard& shard, const std::string& file,
                                                          bool hash_file) {
  if (manifest.format == kCheckpointFormatV1) return MakeFormatV1Reader(shard, file, hash_file);
  return MakeFormatV2Reader(shard, file, hash_file);
}

const ShardEntry* CheckedShard::Find(const std::string& dataset) const {
  for (const ShardEntry& e : entries_)
    if (e.dataset == dataset) return &e;
  return nullptr;
}

CheckedShard::CheckedShard() = default;
// Here, where ShardFormatReader is complete.
CheckedShard::~CheckedShard() = default;

Status CheckedShard::Read(const std::vector<ReadRequest>& requests, ThreadPool* pool) {
  std::vector<TensorRead> reads;
  reads.reserve(requests.size());
  for (const auto& q : requests) {
    const ShardEntry* e = Find(q.dataset);
    if (e == nullptr) return Status::DataLoss(path_ + ": tensor " + q.dataset + " is missing");
    reads.push_back({e, q.out});
  }
  // Each request against its entry (CheckDataset's reading of the file):
  // the one place these are compared, whatever the format.
  for (size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& q = requests[i];
    const ShardEntry& e = *reads[i].entry;
    const std::string where = path_ + ": tensor " + q.dataset;
    if (q.check && e.dtype != q.dtype)
      return Status::DataLoss(where + " has dtype '" + std::string(DTypeName(e.dtype)) + "', expected '" +
                              std::string(DTypeName(q.dtype)) + "'");
    if (q.check && e.shape != q.shape)
      return Status::DataLoss(where + " has shape " + ShapeString(e.shape) + ", expected " +
                              ShapeString(q.shape));
    if (e.bytes != q.bytes)
      return Status::DataLoss(where + " holds " + std::to_string(e.bytes) + " bytes, expected " +
                              std::to_string(q.bytes));
  }
  return format_->Read(reads, pool);
}

Status CheckedShard::ReadEverything(ThreadPool* pool) {
  std::vector<ReadRequest> all;
  all.reserve(entries_.size());
  for (const ShardEntry& e : entries_) all.push_back({e.dataset, true, e.dtype, e.shape, nullptr, e.bytes});
  return Read(all, pool);
}

Status CheckedShard::Finish(const Status& read_status) {
  const Status verdict = format_->Finish(read_status);
  // What was read past the new end was zeros (mapped_file.h): that, not the
  // hash mismatch it caused, is what the caller needs to hear.
  if (reader_ != nullptr && reader_->Truncated())
    return Status::DataLoss(path_ + " was truncated while it was read (it was " + std::to_string(size_at_open_) +
                            " bytes)");
  return verdict;
}

}  // namespace oomguard::ckpt
