// Reading what other people wrote (JSONL exports, training logs), from files
// or pipes, without ever holding more than a limit: a file's reported size
// says nothing about a pipe (`yes | oomguard diagnose /dev/stdin`), and one
// line of a 1 GiB file must not be read whole to learn that it is too long.
// Used by the CLI and by the knowledge base's JSONL reader (sdk/kb/jsonl.h).
// Thread-safety: plain functions on the caller's stream.
#ifndef OOMGUARD_SDK_CORE_INPUT_H_
#define OOMGUARD_SDK_CORE_INPUT_H_

#include <cstddef>
#include <istream>
#include <string>

namespace oomguard::internal {

enum class LineRead { kLine, kEnd, kTooLong };

// The next line of `in`, without its '\n', into *line. kEnd when nothing is
// left; kTooLong, with *line holding the first max_bytes + 1 bytes, as soon
// as the line passes max_bytes (the rest of it is not read).
LineRead ReadLineCapped(std::istream& in, size_t max_bytes, std::string* line);

// All of `in` into *out; false, after reading max_bytes + 1 bytes at most,
// when there is more than max_bytes.
bool ReadAllCapped(std::istream& in, size_t max_bytes, std::string* out);

}  // namespace oomguard::internal

#endif  // OOMGUARD_SDK_CORE_INPUT_H_
