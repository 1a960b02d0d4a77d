// The log importer's reader: finds every out-of-memory event in raw text
// (training logs, tracebacks, dmesg, Slurm and Kubernetes events, pasted
// issue reports) and turns each into an Incident with all the evidence the
// text holds, so a team can turn the logs of past jobs into its case library
// (`oomguard kb import-log`, `oomguard diagnose`).
//
// One event per OOM: the lines that report the same failure (a traceback and
// its chained re-raise, TensorFlow's allocator warnings and its error, NCCL's
// repeated WARN lines, a message wrapped over lines) merge; a change of rank
// or of kind (device vs host), training progress in between, or a long gap
// starts a new one. Each incident carries:
//   message   the OOM line(s) with their figures, launcher prefixes removed
//   context   the surrounding text (traceback, log lines, description)
//   source    "name:line" of the OOM line
//   phase/step/steps_ok_before/rank/host  as far as the text shows them;
//             what it does not show is listed in Incident::unknown
// and an id derived from its text and line, so importing the same log twice
// yields the same incidents (the store replaces them: nothing is added).
//
// Thread-safety: pure function.
#ifndef OOMGUARD_SDK_KB_LOG_PARSER_H_
#define OOMGUARD_SDK_KB_LOG_PARSER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "oomguard/incident.h"
#include "oomguard/status.h"

namespace oomguard::kb {

struct LogParseOptions {
  std::string source_name;   // file name used in Incident::source and as the run id ("train.log")
  std::string run_id;        // overrides the run id (default: source_name)
  std::string workload;      // copied to every incident
  int64_t default_time_unix_ms = 0;  // when a line carries no timestamp (the CLI passes the file's mtime)
  int context_lines_before = 60;     // lines of context kept before an OOM line
  int context_lines_after = 15;      // ... and after it
  size_t max_events = 10000;         // more is an error: the text is not a log of OOMs
};

// kInvalidArgument when the text is binary (NUL bytes), larger than 256 MiB,
// or holds more than max_events OOM events; the message says which.
StatusOr<std::vector<Incident>> ParseOomLog(std::string_view text, const LogParseOptions& options);

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_LOG_PARSER_H_
