#include "sdk/checkpoint/shard_digest.h"

#include <algorithm>

#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/xxh.h"

namespace oomguard::ckpt {

std::string PartitionFile(std::vector<FileRegion> chunks, uint64_t file_bytes, std::vector<FileRegion>* out) {
  std::sort(chunks.begin(), chunks.end(),
            [](const FileRegion& a, const FileRegion& b) { return a.offset < b.offset; });
  out->clear();
  out->reserve(2 * chunks.size() + 1);
  uint64_t at = 0;
  for (const FileRegion& c : chunks) {
    if (c.offset > file_bytes || c.length > file_bytes - c.offset)
      return "a chunk at byte " + std::to_string(c.offset) + " lies beyond the end of the file";
    if (c.offset < at)
      return "two chunks overlap at byte " + std::to_string(c.offset) + " (corrupt chunk index)";
    if (c.offset > at) out->push_back({at, c.offset - at, false});
    out->push_back({c.offset, c.length, true});
    at = c.offset + c.length;
  }
  if (at < file_bytes) out->push_back({at, file_bytes - at, false});
  return "";
}

uint64_t CombineDigest(const std::vector<FileRegion>& regions, const std::vector<uint64_t>& hashes) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (size_t i = 0; i < regions.size(); ++i) {
    uint8_t rec[24];
    const uint64_t v[3] = {regions[i].offset, regions[i].length, hashes[i]};
    for (int k = 0; k < 3; ++k)
      for (int b = 0; b < 8; ++b) rec[8 * k + b] = static_cast<uint8_t>(v[k] >> (8 * b));
    XXH3_64bits_update(st, rec, sizeof(rec));
  }
  const uint64_t d = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return d;
}

StatusOr<ShardFileDigest> DigestShardFile(const std::string& path) {
  auto reader = ShardReader::Open(path);
  if (!reader.ok()) return reader.status();
  ShardReader& r = **reader;
  if (r.version() != 2) return Status::DataLoss(path + ": format '" + r.format() + "' has no digest");
  auto paths = r.DatasetPaths();
  if (!paths.ok()) return paths.status();
  // Every stored chunk HDF5 lists, whatever the layout or filters: for a
  // shard the writer wrote these are exactly the loader's regions, and a
  // shard that is not one fails the loader's own checks before its digest
  // matters.
  std::vector<FileRegion> chunks;
  {
    Hdf5Lock lock;
    for (const std::string& ds : *paths) {
      H5Handle d(H5Dopen2(r.hdf5_file(), ds.c_str(), H5P_DEFAULT));
      H5Handle dcpl(d.valid() ? H5Dget_create_plist(d.get()) : H5I_INVALID_HID);
      if (!dcpl.valid() || H5Pget_layout(dcpl.get()) != H5D_CHUNKED) continue;
      H5Handle space(H5Dget_space(d.get()));  // this HDF5 refuses H5S_ALL here
      hsize_t n = 0;
      if (!space.valid() || H5Dget_num_chunks(d.get(), space.get(), &n) < 0)
        return Status::DataLoss(path + ": cannot list the chunks of " + ds);
      for (hsize_t i = 0; i < n; ++i) {
        unsigned mask = 0;
        haddr_t addr = HADDR_UNDEF;
        hsize_t size = 0;
        if (H5Dget_chunk_info(d.get(), space.get(), i, nullptr, &mask, &addr, &size) < 0 ||
            addr == HADDR_UNDEF)
          return Status::DataLoss(path + ": cannot locate chunk " + std::to_string(i) + " of " + ds);
        chunks.push_back({addr + r.base_address(), size, true});
      }
    }
  }
  auto mapped = r.Mapped();
  if (!mapped.ok()) return mapped.status();
  std::vector<FileRegion> regions;
  const std::string bad = PartitionFile(std::move(chunks), mapped->size(), &regions);
  if (!bad.empty()) return Status::DataLoss(path + ": " + bad);
  std::vector<uint64_t> hashes(regions.size());
  for (size_t i = 0; i < regions.size(); ++i)
    hashes[i] = XXH3_64bits(mapped->data() + regions[i].offset, regions[i].length);
  ShardFileDigest out;
  out.bytes = static_cast<int64_t>(mapped->size());
  out.digest = Hex64(CombineDigest(regions, hashes));
  out.compression = r.compression();
  {
    Hdf5Lock lock;
    if (auto why = ReadStringAttr(r.hdf5_file(), kCompressionAutoAttr, 4096)) out.compression_auto = *why;
  }
  return out;
}

}  // namespace oomguard::ckpt
