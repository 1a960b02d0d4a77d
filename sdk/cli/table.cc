#include "sdk/cli/table.h"

#include <algorithm>
#include <cmath>
#include <ctime>

namespace oomguard::cli {
namespace {

// Display width in code points (good enough for the ASCII and occasional UTF-8 we print).
size_t Width(const std::string& s) {
  size_t w = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++w;
  return w;
}

std::string Cut(const std::string& s, size_t max) {
  if (Width(s) <= max) return s;
  std::string out;
  size_t w = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if ((c & 0xC0) != 0x80 && ++w > max - 3) break;
    out.push_back(s[i]);
  }
  return out + "...";
}

}  // namespace

void Table::Print(std::FILE* out, size_t max_cell) const {
  std::vector<size_t> widths(headers_.size());
  for (size_t c = 0; c < headers_.size(); ++c) widths[c] = Width(headers_[c]);
  for (const auto& r : rows_)
    for (size_t c = 0; c < r.size() && c < widths.size(); ++c)
      widths[c] = std::max(widths[c], Width(Cut(r[c], max_cell)));
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s;
    for (size_t c = 0; c < widths.size(); ++c) {
      std::string cell = c < cells.size() ? Cut(cells[c], max_cell) : "";
      s += cell;
      if (c + 1 < widths.size()) s += std::string(widths[c] - Width(cell) + 2, ' ');
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();
    std::fprintf(out, "%s\n", s.c_str());
  };
  line(headers_);
  for (const auto& r : rows_) line(r);
}

std::string FormatTime(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}


}  // namespace oomguard::cli
