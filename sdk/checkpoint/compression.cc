#include "sdk/checkpoint/compression.h"

#include <charconv>

namespace oomguard::ckpt {

std::string ShardCompressionName(std::optional<int> zstd_level) {
  return zstd_level ? "zstd-" + std::to_string(*zstd_level) : "none";
}

namespace {
std::optional<int> ParseLevel(std::string_view name) {
  if (name.substr(0, 5) != "zstd-") return std::nullopt;
  const std::string_view digits = name.substr(5);
  int level = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), level);
  if (ec != std::errc() || end != digits.data() + digits.size() || !IsZstdLevel(level)) return std::nullopt;
  return level;
}
}  // namespace

std::optional<int> ZstdLevelOf(std::string_view name) { return ParseLevel(name); }

bool IsCompressionName(std::string_view name) { return name == "none" || ParseLevel(name).has_value(); }

}  // namespace oomguard::ckpt
