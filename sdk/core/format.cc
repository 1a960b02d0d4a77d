#include "sdk/core/format.h"

#include <cmath>
#include <cstdio>

namespace oomguard::internal {
namespace {

std::string Format(double v, bool fixed2) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (unit < 4 && std::fabs(v) >= 1024.0) {
    v /= 1024.0;
    ++unit;
  }
  char buf[64];
  if (fixed2) {
    std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[unit]);
  } else {
    std::snprintf(buf, sizeof(buf), unit == 0 ? "%.0f %s" : "%.1f %s", v, kUnits[unit]);
  }
  return buf;
}

}  // namespace

std::string FormatBytes(double bytes) { return Format(bytes, false); }
std::string FormatBytesFixed2(double bytes) { return Format(bytes, true); }

}  // namespace oomguard::internal
