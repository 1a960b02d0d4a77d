// Incidents from JSONL (one JSON exchange record per line): the one reader
// behind `oomguard kb import` / `kb classify`, the spool's files and tests.
//
// Blank lines (and a trailing '\r') are skipped. A line longer than
// kMaxJsonlLineBytes is not read whole. What a bad line does is the
// caller's choice: kError stops at it (a file a person hands over: say
// which line), kSkip passes over it and counts it (the spool: a line torn by
// a crash mid-append was never fully spooled).
//
// Thread-safety: plain functions.
#ifndef OOMGUARD_SDK_KB_JSONL_H_
#define OOMGUARD_SDK_KB_JSONL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <istream>
#include <string>
#include <vector>

#include "oomguard/incident.h"
#include "oomguard/status.h"

namespace oomguard::kb {

inline constexpr size_t kMaxJsonlLineBytes = size_t{1} << 20;

enum class BadLine { kError, kSkip };

struct JsonlIncidents {
  std::vector<Incident> incidents;
  int64_t skipped = 0;  // bad lines passed over (kSkip)
};

// The line loop under the readers: calls on_line for each non-blank line
// (without '\n' or a trailing '\r'); a non-OK answer marks the line bad (its
// message is used in the error). *skipped counts bad lines passed over.
Status ForEachJsonlLine(std::istream& in, const std::string& name, BadLine bad,
                        const std::function<Status(const std::string& line)>& on_line, int64_t* skipped);

// Reads every line of `in`; `name` names the input in errors
// ("NAME:LINE: why", kInvalidArgument; a read error is kUnavailable).
StatusOr<JsonlIncidents> ReadIncidentsJsonl(std::istream& in, const std::string& name, BadLine bad);
// The same for a file; kNotFound when it cannot be opened.
StatusOr<JsonlIncidents> ReadIncidentsJsonlFile(const std::string& path, BadLine bad);

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_JSONL_H_
