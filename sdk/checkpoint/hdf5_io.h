// Thin RAII and locking over the HDF5 C API for the checkpoint component.
//
// Every HDF5 call in the SDK runs while holding Hdf5Lock: the library is
// process-global state (even the thread-safe build serialises internally),
// and holding one lock lets the compression threads run outside it. The lock
// also silences HDF5's automatic error printing for the SDK's calls only (the
// host program's setting is restored on unlock); errors come back as Status.
#ifndef OOMGUARD_SDK_CHECKPOINT_HDF5_IO_H_
#define OOMGUARD_SDK_CHECKPOINT_HDF5_IO_H_

#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "oomguard/checkpoint.h"
#include "oomguard/status.h"

namespace oomguard::ckpt {

class Hdf5Lock {
 public:
  Hdf5Lock();
  ~Hdf5Lock();
  Hdf5Lock(const Hdf5Lock&) = delete;
  Hdf5Lock& operator=(const Hdf5Lock&) = delete;

 private:
  std::unique_lock<std::recursive_mutex> lock_;
  H5E_auto2_t old_func_ = nullptr;
  void* old_data_ = nullptr;
};

// Owns one hid_t and closes it with the matching H5*close. REQUIRES: the
// destructor runs while Hdf5Lock is held.
class H5Handle {
 public:
  H5Handle() = default;
  explicit H5Handle(hid_t id) : id_(id) {}
  ~H5Handle() { reset(); }
  H5Handle(H5Handle&& o) noexcept : id_(o.id_) { o.id_ = H5I_INVALID_HID; }
  H5Handle& operator=(H5Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      o.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset();

 private:
  hid_t id_ = H5I_INVALID_HID;
};

// Registers the zstd filter in this process (idempotent). REQUIRES: lock held.
Status EnsureZstdRegistered();

// The HDF5 file type of a dtype (a copy the caller owns).
H5Handle FileType(DType t);

// Attribute helpers. REQUIRES: lock held. The readers return nullopt unless
// the attribute holds exactly one value of the right class (a string of at
// most max_bytes; an integer), so a file from elsewhere cannot make them
// allocate or write more than that.
Status WriteStringAttr(hid_t obj, const char* name, const std::string& value);
Status WriteInt64Attr(hid_t obj, const char* name, int64_t value);
std::optional<std::string> ReadStringAttr(hid_t obj, const char* name, size_t max_bytes = 4096);
std::optional<int64_t> ReadInt64Attr(hid_t obj, const char* name);
// A 1-D array of little-endian uint64 values. The reader returns nullopt
// unless the attribute is a 1-D array of exactly `count` 8-byte integers
// whose storage the file can back (at most `file_bytes`).
Status WriteUint64ArrayAttr(hid_t obj, const char* name, const std::vector<uint64_t>& values);
std::optional<std::vector<uint64_t>> ReadUint64ArrayAttr(hid_t obj, const char* name, uint64_t count,
                                                         uint64_t file_bytes);

// A name from a file as it may appear in a message: control bytes (a
// terminal escape in a hostile dataset name) are shown as \xNN, and very
// long names are cut.
std::string PrintableName(std::string_view s);

// Groups below the root a shard may nest: a state path ("model/fc1.weight")
// is a group per '/'. Checkpointer::AddTensor refuses deeper paths, so every
// shard a writer makes stays within it.
inline constexpr int kMaxGroupDepth = 64;
// Links a shard may hold; a model with more tensors than this is not a
// checkpoint this format was made for, and a walk must end somewhere.
inline constexpr int64_t kMaxLinks = int64_t{1} << 20;

// What a walk over every link of a file found, or the first thing it refused.
struct ObjectWalk {
  std::string error;                  // empty: every link is a hard link to a group or a dataset
  std::vector<std::string> datasets;  // "/model/fc1.weight", in the order found
};
// Walks every link from the root group, depth first, without recursion and
// without HDF5's own visitors (which recurse per level and slow down with
// depth: a 20,000-level file overflowed the stack). Refuses, before going
// further: groups nested deeper than kMaxGroupDepth, more than kMaxLinks
// links, a link that is not a hard link (soft, external, user-defined: named
// with its target), an object reached by a second link (a group linked
// into itself or twice would make the walk endless or exponential), and
// objects other than groups and datasets. REQUIRES: Hdf5Lock held.
ObjectWalk WalkObjects(hid_t file);

// How a tensor is cut into chunks that are contiguous runs of its row-major
// bytes: chunk dims are (1, ..., 1, r, d[k+1], ..., d[n-1]). The last chunk
// along dim k may be partial; on disk it is padded to the full chunk size.
struct ChunkLayout {
  std::vector<hsize_t> chunk_dims;  // empty: not chunked (scalar or empty tensor)
  int64_t chunk_bytes = 0;          // bytes of one full chunk
  int64_t count = 0;                // number of chunks
  int k = 0;                        // the dim cut into runs of r
};
ChunkLayout PlanChunks(const std::vector<int64_t>& shape, size_t elem_size, int64_t target_bytes);
// Whether `chunk_dims` has the contiguous shape above for `shape`; fills k.
bool IsContiguousLayout(const std::vector<int64_t>& shape, const std::vector<hsize_t>& chunk_dims, int* k);
// Chunk i's element offset (for H5Dwrite_chunk) and its byte range within
// the tensor (partial for an edge chunk).
void ChunkPosition(const std::vector<int64_t>& shape, const ChunkLayout& layout, int64_t i,
                   std::vector<hsize_t>* offset, int64_t* byte_begin, int64_t* byte_len);

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_HDF5_IO_H_
