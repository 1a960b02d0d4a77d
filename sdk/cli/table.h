// Aligned text tables for the CLI's human output.
// Thread-safety: a Table is a value; not shared between threads.
#ifndef OOMGUARD_SDK_CLI_TABLE_H_
#define OOMGUARD_SDK_CLI_TABLE_H_

#include <cstdio>
#include <string>
#include <vector>

#include "sdk/core/format.h"

namespace oomguard::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}
  // REQUIRES: cells.size() == number of headers.
  void AddRow(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  // Columns padded to their widest cell (cells longer than max_cell are cut with "...").
  void Print(std::FILE* out, size_t max_cell = 60) const;
  size_t size() const { return rows_.size(); }

 private:
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

// "2024-05-01 12:00:03" (UTC) or "-" for 0.
std::string FormatTime(int64_t unix_ms);
// "1.5 GiB".
using internal::FormatBytes;  // "2.1 GiB"

}  // namespace oomguard::cli

#endif  // OOMGUARD_SDK_CLI_TABLE_H_
