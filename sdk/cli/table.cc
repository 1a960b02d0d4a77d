#include "sdk/cli/table.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

void AppendHex(std::string* out, const char* prefix, uint32_t v, int digits) {
  static const char* hex = "0123456789abcdef";
  *out += prefix;
  for (int d = digits - 1; d >= 0; --d) *out += hex[(v >> (4 * d)) & 15];
}

// The code point of the UTF-8 sequence at s[i], its length in *len; 0 with
// *len = 0 when the bytes there are not well-formed UTF-8.
uint32_t DecodeUtf8(std::string_view s, size_t i, size_t* len) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  *len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
  if (*len == 0 || i + *len > s.size()) return *len = 0;
  uint32_t cp = c & (0x7Fu >> *len);
  for (size_t k = 1; k < *len; ++k) {
    const unsigned char d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) return *len = 0;
    cp = (cp << 6) | (d & 0x3F);
  }
  const bool overlong = (*len == 3 && cp < 0x800) || (*len == 4 && cp < 0x10000);
  if (overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return *len = 0;
  return cp;
}

}  // namespace

std::string TerminalSafe(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7F)
        AppendHex(&out, "\\x", c, 2);
      else
        out += static_cast<char>(c);
      ++i;
      continue;
    }
    size_t len = 0;
    const uint32_t cp = DecodeUtf8(s, i, &len);
    if (len == 0) {
      AppendHex(&out, "\\x", c, 2);  // not UTF-8: a lone C1 byte may still act as one
      ++i;
      continue;
    }
    // C1 controls (CSI is U+009B) and the bidirectional overrides that make
    // text display in another order than it is stored.
    const bool control = (cp >= 0x80 && cp <= 0x9F) || (cp >= 0x202A && cp <= 0x202E) ||
                         (cp >= 0x2066 && cp <= 0x2069) || cp == 0x200E || cp == 0x200F;
    if (control)
      AppendHex(&out, "\\u", cp, 4);
    else
      out.append(s.substr(i, len));
    i += len;
  }
  return out;
}

void Table::Print(std::FILE* out, size_t max_cell) const {
  std::vector<size_t> widths(headers_.size());
  for (size_t c = 0; c < headers_.size(); ++c) widths[c] = Width(headers_[c]);
  for (const auto& r : rows_)
    for (size_t c = 0; c < r.size() && c < widths.size(); ++c)
      widths[c] = std::max(widths[c], Width(Cut(TerminalSafe(r[c]), max_cell)));
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s;
    for (size_t c = 0; c < widths.size(); ++c) {
      std::string cell = c < cells.size() ? Cut(TerminalSafe(cells[c]), max_cell) : "";
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
