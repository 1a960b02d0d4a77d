// How a shard is compressed: the names recorded in shards and manifests.
//
// Thread-safety: pure functions.
#ifndef OOMGUARD_SDK_CHECKPOINT_COMPRESSION_H_
#define OOMGUARD_SDK_CHECKPOINT_COMPRESSION_H_

#include <optional>
#include <string>
#include <string_view>

namespace oomguard::ckpt {

// zstd levels a checkpoint may use: [-7, -1] (fast) and [1, 22]; 0 would
// silently mean zstd's default level 3.
inline bool IsZstdLevel(int level) { return (level >= -7 && level <= -1) || (level >= 1 && level <= 22); }

// "none", or "zstd-<level>".
std::string ShardCompressionName(std::optional<int> zstd_level);
// The level of a "zstd-<level>" name; nullopt for "none". REQUIRES:
// IsCompressionName(name).
std::optional<int> ZstdLevelOf(std::string_view name);
// Whether `name` is "none" or "zstd-<level>" with a level IsZstdLevel accepts.
bool IsCompressionName(std::string_view name);

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_COMPRESSION_H_
