#include "sdk/checkpoint/hdf5_io.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "sdk/checkpoint/zstd_filter.h"

namespace oomguard::ckpt {
namespace {
std::recursive_mutex& Hdf5Mutex() {
  static std::recursive_mutex mu;
  return mu;
}
}  // namespace

Hdf5Lock::Hdf5Lock() : lock_(Hdf5Mutex()) {
  H5Eget_auto2(H5E_DEFAULT, &old_func_, &old_data_);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

Hdf5Lock::~Hdf5Lock() { H5Eset_auto2(H5E_DEFAULT, old_func_, old_data_); }

void H5Handle::reset() {
  if (id_ < 0) return;
  switch (H5Iget_type(id_)) {
    case H5I_FILE:
      H5Fclose(id_);
      break;
    case H5I_GROUP:
      H5Gclose(id_);
      break;
    case H5I_DATASET:
      H5Dclose(id_);
      break;
    case H5I_DATASPACE:
      H5Sclose(id_);
      break;
    case H5I_DATATYPE:
      H5Tclose(id_);
      break;
    case H5I_ATTR:
      H5Aclose(id_);
      break;
    case H5I_GENPROP_LST:
      H5Pclose(id_);
      break;
    default:
      H5Idec_ref(id_);
      break;
  }
  id_ = H5I_INVALID_HID;
}

Status EnsureZstdRegistered() {
  if (H5Zfilter_avail(kZstdFilter) > 0) return Status::Ok();
  if (H5Zregister(ZstdFilterClass()) < 0) return Status::Internal("cannot register the zstd HDF5 filter");
  return Status::Ok();
}

H5Handle FileType(DType t) {
  switch (t) {
    case DType::kFloat16: {
      // IEEE binary16, which h5py maps to numpy float16.
      hid_t h = H5Tcopy(H5T_IEEE_F32LE);
      H5Tset_fields(h, 15, 10, 5, 0, 10);
      H5Tset_size(h, 2);
      H5Tset_ebias(h, 15);
      return H5Handle(h);
    }
    case DType::kBFloat16:
      return H5Handle(H5Tcopy(H5T_STD_U16LE));  // raw bits; `dtype` says bfloat16
    case DType::kFloat32:
      return H5Handle(H5Tcopy(H5T_IEEE_F32LE));
    case DType::kFloat64:
      return H5Handle(H5Tcopy(H5T_IEEE_F64LE));
    case DType::kInt8:
      return H5Handle(H5Tcopy(H5T_STD_I8LE));
    case DType::kInt16:
      return H5Handle(H5Tcopy(H5T_STD_I16LE));
    case DType::kInt32:
      return H5Handle(H5Tcopy(H5T_STD_I32LE));
    case DType::kInt64:
      return H5Handle(H5Tcopy(H5T_STD_I64LE));
    case DType::kUInt8:
      return H5Handle(H5Tcopy(H5T_STD_U8LE));
    case DType::kUInt16:
      return H5Handle(H5Tcopy(H5T_STD_U16LE));
    case DType::kUInt32:
      return H5Handle(H5Tcopy(H5T_STD_U32LE));
    case DType::kUInt64:
      return H5Handle(H5Tcopy(H5T_STD_U64LE));
    case DType::kBool:
      return H5Handle(H5Tcopy(H5T_STD_U8LE));
  }
  return H5Handle(H5Tcopy(H5T_STD_U8LE));
}

Status WriteStringAttr(hid_t obj, const char* name, const std::string& value) {
  H5Handle type(H5Tcopy(H5T_C_S1));
  H5Tset_size(type.get(), std::max<size_t>(1, value.size()));
  H5Tset_strpad(type.get(), H5T_STR_NULLTERM);
  H5Handle space(H5Screate(H5S_SCALAR));
  H5Handle attr(H5Acreate2(obj, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!attr.valid()) return Status::Internal(std::string("cannot create attribute ") + name);
  std::string padded = value;
  padded.resize(std::max<size_t>(1, value.size()), '\0');
  if (H5Awrite(attr.get(), type.get(), padded.data()) < 0)
    return Status::Internal(std::string("cannot write attribute ") + name);
  return Status::Ok();
}

Status WriteInt64Attr(hid_t obj, const char* name, int64_t value) {
  H5Handle space(H5Screate(H5S_SCALAR));
  H5Handle attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!attr.valid()) return Status::Internal(std::string("cannot create attribute ") + name);
  if (H5Awrite(attr.get(), H5T_NATIVE_INT64, &value) < 0)
    return Status::Internal(std::string("cannot write attribute ") + name);
  return Status::Ok();
}

namespace {

// Opens attribute `name` of `obj` when it holds exactly one element: a file
// from elsewhere may make any attribute an array, and H5Aread writes every
// element into the caller's buffer.
H5Handle OpenSingleAttr(hid_t obj, const char* name) {
  if (H5Aexists(obj, name) <= 0) return H5Handle();
  H5Handle attr(H5Aopen(obj, name, H5P_DEFAULT));
  if (!attr.valid()) return H5Handle();
  H5Handle space(H5Aget_space(attr.get()));
  if (!space.valid() || H5Sget_simple_extent_npoints(space.get()) != 1) return H5Handle();
  return attr;
}

}  // namespace

std::optional<std::string> ReadStringAttr(hid_t obj, const char* name, size_t max_bytes) {
  H5Handle attr = OpenSingleAttr(obj, name);
  if (!attr.valid()) return std::nullopt;
  H5Handle type(H5Aget_type(attr.get()));
  if (H5Tget_class(type.get()) != H5T_STRING) return std::nullopt;
  if (H5Tis_variable_str(type.get()) > 0) {
    // The stored size bounds what HDF5 allocates for the string.
    if (H5Aget_storage_size(attr.get()) > max_bytes + 64) return std::nullopt;
    H5Handle mem(H5Tcopy(H5T_C_S1));
    H5Tset_size(mem.get(), H5T_VARIABLE);
    char* s = nullptr;
    if (H5Aread(attr.get(), mem.get(), &s) < 0 || s == nullptr) return std::nullopt;
    std::string out(s, strnlen(s, max_bytes + 1));
    H5free_memory(s);
    if (out.size() > max_bytes) return std::nullopt;
    return out;
  }
  size_t n = H5Tget_size(type.get());
  if (n == 0 || n > max_bytes) return std::nullopt;
  std::string buf(n, '\0');
  if (H5Aread(attr.get(), type.get(), buf.data()) < 0) return std::nullopt;
  buf.resize(std::strlen(buf.c_str()));
  return buf;
}

std::optional<int64_t> ReadInt64Attr(hid_t obj, const char* name) {
  H5Handle attr = OpenSingleAttr(obj, name);
  if (!attr.valid()) return std::nullopt;
  H5Handle type(H5Aget_type(attr.get()));
  if (H5Tget_class(type.get()) != H5T_INTEGER) return std::nullopt;
  int64_t v = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_INT64, &v) < 0) return std::nullopt;
  return v;
}

Status WriteUint64ArrayAttr(hid_t obj, const char* name, const std::vector<uint64_t>& values) {
  const hsize_t n = values.size();
  H5Handle space(n == 0 ? H5Screate(H5S_NULL) : H5Screate_simple(1, &n, nullptr));
  H5Handle attr(H5Acreate2(obj, name, H5T_STD_U64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!attr.valid()) return Status::Internal(std::string("cannot create attribute ") + name);
  if (n > 0 && H5Awrite(attr.get(), H5T_NATIVE_UINT64, values.data()) < 0)
    return Status::Internal(std::string("cannot write attribute ") + name);
  return Status::Ok();
}

std::optional<std::vector<uint64_t>> ReadUint64ArrayAttr(hid_t obj, const char* name, uint64_t count,
                                                         uint64_t file_bytes) {
  if (H5Aexists(obj, name) <= 0) return std::nullopt;
  H5Handle attr(H5Aopen(obj, name, H5P_DEFAULT));
  if (!attr.valid()) return std::nullopt;
  H5Handle type(H5Aget_type(attr.get()));
  if (H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) != 8) return std::nullopt;
  H5Handle space(H5Aget_space(attr.get()));
  if (!space.valid() || H5Sget_simple_extent_ndims(space.get()) != 1) return std::nullopt;
  hsize_t n = 0;
  if (H5Sget_simple_extent_dims(space.get(), &n, nullptr) != 1 || n != count) return std::nullopt;
  if (count > file_bytes / 8 || H5Aget_storage_size(attr.get()) > file_bytes) return std::nullopt;
  std::vector<uint64_t> out(static_cast<size_t>(count));
  if (H5Aread(attr.get(), H5T_NATIVE_UINT64, out.data()) < 0) return std::nullopt;
  return out;
}

std::string PrintableName(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, 256)) {
    if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > 256) out += "...";
  return out;
}

namespace {

// One group of the walk: its links are listed when it is opened, then
// taken one at a time.
struct WalkGroup {
  H5Handle group;
  std::string path;  // "" for the root, else "model/sub"
  int depth = 0;     // the root is 0
  struct Link {
    std::string name;
    H5L_type_t type;
    size_t val_size;
  };
  std::vector<Link> links;
  size_t next = 0;
};

struct ListLinks {
  std::vector<WalkGroup::Link>* out;
  int64_t* links;  // over the whole walk
};

herr_t ListLink(hid_t, const char* name, const H5L_info_t* info, void* op) {
  auto* l = static_cast<ListLinks*>(op);
  if (++*l->links > kMaxLinks) return 1;
  l->out->push_back({name, info->type, info->type == H5L_TYPE_HARD ? 0 : info->u.val_size});
  return 0;
}

// "a soft link to /x", "an external link to /d in the file 'f.h5'".
std::string DescribeLink(hid_t group, const WalkGroup::Link& link) {
  std::string what = link.type == H5L_TYPE_SOFT       ? "a soft link"
                     : link.type == H5L_TYPE_EXTERNAL ? "an external link"
                                                      : "a user-defined link";
  // Name the target, so that whoever made the file sees where it pointed.
  const size_t n = link.val_size;
  if (n == 0 || n > 4096) return what;
  std::vector<char> val(n + 1, '\0');
  if (H5Lget_val(group, link.name.c_str(), val.data(), n, H5P_DEFAULT) < 0) return what;
  const char* file = nullptr;
  const char* obj = nullptr;
  unsigned flags = 0;
  if (link.type == H5L_TYPE_SOFT)
    what += " to " + PrintableName(val.data());
  else if (link.type == H5L_TYPE_EXTERNAL && H5Lunpack_elink_val(val.data(), n, &flags, &file, &obj) >= 0 &&
           file != nullptr && obj != nullptr)
    what += " to " + PrintableName(obj) + " in the file '" + PrintableName(file) + "'";
  return what;
}

}  // namespace

ObjectWalk WalkObjects(hid_t file) {
  ObjectWalk w;
  int64_t links = 0;
  std::set<haddr_t> seen;
  std::vector<WalkGroup> stack;
  auto open_group = [&](H5Handle group, std::string path, int depth) -> bool {
    WalkGroup g;
    g.group = std::move(group);
    g.path = std::move(path);
    g.depth = depth;
    ListLinks list{&g.links, &links};
    const herr_t rc = H5Literate(g.group.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, ListLink, &list);
    if (links > kMaxLinks) {
      w.error = "holds more than " + std::to_string(kMaxLinks) + " links";
      return false;
    }
    if (rc < 0) {
      w.error = "cannot list its links (corrupt file)";
      return false;
    }
    stack.push_back(std::move(g));
    return true;
  };
  {
    H5O_info_t root{};
    if (H5Oget_info2(file, &root, H5O_INFO_BASIC) < 0) {
      w.error = "cannot list its links (corrupt file)";
      return w;
    }
    seen.insert(root.addr);
    H5Handle g(H5Gopen2(file, "/", H5P_DEFAULT));
    if (!g.valid()) {
      w.error = "cannot list its links (corrupt file)";
      return w;
    }
    if (!open_group(std::move(g), "", 0)) return w;
  }
  while (!stack.empty()) {
    WalkGroup& g = stack.back();
    if (g.next == g.links.size()) {
      stack.pop_back();
      continue;
    }
    const WalkGroup::Link link = g.links[g.next++];
    const std::string path = g.path.empty() ? link.name : g.path + "/" + link.name;
    if (link.type != H5L_TYPE_HARD) {
      w.error = "tensor /" + PrintableName(path) + " is " + DescribeLink(g.group.get(), link) +
                "; a checkpoint holds its tensors itself (hard links only)";
      return w;
    }
    H5O_info_t info{};
    if (H5Oget_info_by_name2(g.group.get(), link.name.c_str(), &info, H5O_INFO_BASIC, H5P_DEFAULT) < 0) {
      w.error = "/" + PrintableName(path) + " cannot be opened (corrupt header)";
      return w;
    }
    if (!seen.insert(info.addr).second) {
      w.error = "/" + PrintableName(path) +
                " is a second link to an object linked elsewhere in the file; a checkpoint links each "
                "tensor and group once";
      return w;
    }
    if (info.type == H5O_TYPE_DATASET) {
      w.datasets.push_back("/" + path);
    } else if (info.type == H5O_TYPE_GROUP) {
      if (g.depth + 1 > kMaxGroupDepth) {
        w.error = "nests groups deeper than " + std::to_string(kMaxGroupDepth) + " levels (at /" +
                  PrintableName(path) + "); a checkpoint's state paths are not that deep";
        return w;
      }
      H5Handle child(H5Gopen2(g.group.get(), link.name.c_str(), H5P_DEFAULT));
      if (!child.valid()) {
        w.error = "/" + PrintableName(path) + " cannot be opened (corrupt header)";
        return w;
      }
      const int depth = g.depth + 1;
      if (!open_group(std::move(child), path, depth)) return w;  // `g` may dangle from here
    } else {
      w.error = "/" + PrintableName(path) +
                " is an HDF5 object of another kind (a committed datatype?), not a tensor";
      return w;
    }
  }
  return w;
}

ChunkLayout PlanChunks(const std::vector<int64_t>& shape, size_t elem_size, int64_t target_bytes) {
  ChunkLayout L;
  int64_t elems = 1;
  for (int64_t d : shape) elems *= d;
  if (shape.empty() || elems == 0) return L;
  const int n = static_cast<int>(shape.size());
  // Smallest k whose trailing block (dims after k) fits the target.
  int64_t tail = static_cast<int64_t>(elem_size);
  int k = n - 1;
  std::vector<int64_t> tail_at(static_cast<size_t>(n));
  for (int i = n - 1; i >= 0; --i) {
    tail_at[static_cast<size_t>(i)] = tail;
    tail *= shape[static_cast<size_t>(i)];
  }
  for (int i = 0; i < n; ++i) {
    if (tail_at[static_cast<size_t>(i)] <= target_bytes) {
      k = i;
      break;
    }
  }
  const int64_t row = tail_at[static_cast<size_t>(k)];
  const int64_t r = std::clamp<int64_t>(target_bytes / row, 1, shape[static_cast<size_t>(k)]);
  L.k = k;
  L.chunk_dims.assign(static_cast<size_t>(n), 1);
  L.chunk_dims[static_cast<size_t>(k)] = static_cast<hsize_t>(r);
  for (int i = k + 1; i < n; ++i)
    L.chunk_dims[static_cast<size_t>(i)] = static_cast<hsize_t>(shape[static_cast<size_t>(i)]);
  L.chunk_bytes = r * row;
  int64_t outer = 1;
  for (int i = 0; i < k; ++i) outer *= shape[static_cast<size_t>(i)];
  L.count = outer * ((shape[static_cast<size_t>(k)] + r - 1) / r);
  return L;
}

bool IsContiguousLayout(const std::vector<int64_t>& shape, const std::vector<hsize_t>& cd, int* k) {
  if (cd.size() != shape.size() || shape.empty()) return false;
  const int n = static_cast<int>(shape.size());
  int kk = 0;
  while (kk < n - 1 && cd[static_cast<size_t>(kk)] == 1) ++kk;
  // dims before kk are 1; kk may be cut; dims after kk must be whole.
  for (int i = kk + 1; i < n; ++i)
    if (static_cast<int64_t>(cd[static_cast<size_t>(i)]) != shape[static_cast<size_t>(i)]) return false;
  *k = kk;
  return true;
}

void ChunkPosition(const std::vector<int64_t>& shape, const ChunkLayout& L, int64_t i,
                   std::vector<hsize_t>* offset, int64_t* byte_begin, int64_t* byte_len) {
  const int n = static_cast<int>(shape.size());
  const size_t ks = static_cast<size_t>(L.k);
  const int64_t r = static_cast<int64_t>(L.chunk_dims[ks]);
  const int64_t per_k = (shape[ks] + r - 1) / r;
  const int64_t row = L.chunk_bytes / r;  // bytes of one index step along dim k
  int64_t outer = i / per_k;
  const int64_t j = i % per_k;
  offset->assign(static_cast<size_t>(n), 0);
  (*offset)[ks] = static_cast<hsize_t>(j * r);
  // Row-major outer index -> coordinates of dims before k.
  for (int d = L.k - 1; d >= 0; --d) {
    (*offset)[static_cast<size_t>(d)] = static_cast<hsize_t>(outer % shape[static_cast<size_t>(d)]);
    outer /= shape[static_cast<size_t>(d)];
  }
  const int64_t outer_index = i / per_k;
  *byte_begin = outer_index * shape[ks] * row + j * r * row;
  *byte_len = std::min(r, shape[ks] - j * r) * row;
}

}  // namespace oomguard::ckpt
