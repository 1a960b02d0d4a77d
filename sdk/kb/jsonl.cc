#include "sdk/kb/jsonl.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

#include "oomguard/knowledge_base.h"
#include "sdk/core/input.h"

namespace oomguard::kb {

Status ForEachJsonlLine(std::istream& in, const std::string& name, BadLine bad,
                        const std::function<Status(const std::string& line)>& on_line, int64_t* skipped) {
  *skipped = 0;
  std::string line;
  int64_t n = 0;
  using internal::LineRead;
  for (LineRead r; (r = internal::ReadLineCapped(in, kMaxJsonlLineBytes, &line)) != LineRead::kEnd;) {
    ++n;
    if (r == LineRead::kTooLong) {
      if (bad == BadLine::kError)
        return Status::InvalidArgument(name + ":" + std::to_string(n) +
                                       ": line is longer than 1 MiB (stopped reading it there)");
      // The rest of the long line, up to its end, is no line of its own.
      in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
      ++*skipped;
      continue;
    }
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    Status s = on_line(line);
    if (!s.ok()) {
      if (bad == BadLine::kError) return Status::InvalidArgument(name + ":" + std::to_string(n) + ": " + s.message());
      ++*skipped;
    }
  }
  if (in.bad()) return Status::Unavailable(name + ": read error");
  return Status::Ok();
}

StatusOr<JsonlIncidents> ReadIncidentsJsonl(std::istream& in, const std::string& name, BadLine bad) {
  JsonlIncidents out;
  OOMGUARD_RETURN_IF_ERROR(ForEachJsonlLine(
      in, name, bad,
      [&](const std::string& line) -> Status {
        auto inc = IncidentFromJson(line);
        if (!inc.ok()) return inc.status();
        out.incidents.push_back(std::move(inc).value());
        return Status::Ok();
      },
      &out.skipped));
  return out;
}

StatusOr<JsonlIncidents> ReadIncidentsJsonlFile(const std::string& path, BadLine bad) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open: " + std::strerror(errno));
  return ReadIncidentsJsonl(in, path, bad);
}

}  // namespace oomguard::kb
