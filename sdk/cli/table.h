// Aligned text tables for the CLI's human output.
// Thread-safety: a Table is a value; not shared between threads.
#ifndef OOMGUARD_SDK_CLI_TABLE_H_
#define OOMGUARD_SDK_CLI_TABLE_H_

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "sdk/core/format.h"

namespace oomguard::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}
  // REQUIRES: cells.size() == number of headers.
  void AddRow(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  // Columns padded to their widest cell (cells longer than max_cell are cut
  // with "..."); every cell passes through TerminalSafe.
  void Print(std::FILE* out, size_t max_cell = 60) const;
  size_t size() const { return rows_.size(); }

 private:
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

// `s` made safe to print on a terminal: C0 and C1 control characters, DEL
// and bidirectional overrides are shown as \xNN or \uNNNN, and bytes that
// are not UTF-8 as \xNN, so that an incident imported from elsewhere cannot
// clear, move over or forge what the terminal shows. Other text is kept.
std::string TerminalSafe(std::string_view s);

// `j` (an nlohmann json or ordered_json) as text, `indent` as in dump().
// Strings from elsewhere (a dataset name with byte 0xFF, a message cut
// inside a UTF-8 character) may not be UTF-8: such bytes become U+FFFD
// instead of an exception that would abort the command.
template <typename Json>
std::string JsonText(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', false, Json::error_handler_t::replace);
}

// "2024-05-01 12:00:03" (UTC) or "-" for 0.
std::string FormatTime(int64_t unix_ms);
// "1.5 GiB".
using internal::FormatBytes;  // "2.1 GiB"

}  // namespace oomguard::cli

#endif  // OOMGUARD_SDK_CLI_TABLE_H_
