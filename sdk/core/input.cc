#include "sdk/core/input.h"

#include <algorithm>
#include <streambuf>

namespace oomguard::internal {

LineRead ReadLineCapped(std::istream& in, size_t max_bytes, std::string* line) {
  line->clear();
  std::streambuf* sb = in.rdbuf();
  bool any = false;
  for (;;) {
    const auto c = sb->sbumpc();
    if (std::char_traits<char>::eq_int_type(c, std::char_traits<char>::eof())) {
      in.setstate(std::ios::eofbit);
      return any ? LineRead::kLine : LineRead::kEnd;
    }
    any = true;
    if (c == '\n') return LineRead::kLine;
    line->push_back(static_cast<char>(c));
    if (line->size() > max_bytes) return LineRead::kTooLong;
  }
}

bool ReadAllCapped(std::istream& in, size_t max_bytes, std::string* out) {
  out->clear();
  char buf[1 << 16];
  for (;;) {
    in.read(buf, sizeof(buf));
    const auto n = static_cast<size_t>(in.gcount());
    if (n == 0) return true;
    if (out->size() + n > max_bytes) return false;
    out->append(buf, n);
  }
}

}  // namespace oomguard::internal
