// `oomguard diagnose FILE...` and `oomguard kb import-log FILE... --db DB`:
// raw training logs, tracebacks, dmesg and scheduler output in; every OOM
// event out, each with its pattern, evidence and remedies. import-log also
// stores them (idempotently: an event's id comes from its text and line), so
// the logs of past jobs become the team's case library.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/cli/command.h"
#include "sdk/core/input.h"
#include "sdk/cli/table.h"
#include "sdk/kb/file_set.h"
#include "sdk/kb/log_parser.h"
#include "sdk/kb/similarity.h"

namespace oomguard::cli {
namespace {

using nlohmann::json;

constexpr size_t kMaxFileBytes = size_t{256} << 20;

struct DiagnoseArgs {
  std::vector<std::string> files;
  std::string db;
  std::string workload;
  std::string run;
  bool json = false;
  int remedies = 3;
  std::vector<std::string> library;  // diagnose --db: knowledge bases to find similar past incidents in
  int similar = 3;
};

struct Failure {
  std::string message;
};

// Reads and parses every file before anything is printed or stored: a bad
// file fails the whole command and names itself.
std::vector<Incident> ParseFiles(const DiagnoseArgs& a, std::vector<std::pair<std::string, size_t>>* per_file) {
  std::vector<Incident> all;
  for (const std::string& path : a.files) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) throw Failure{path + ": cannot open: " + std::strerror(errno)};
    if (S_ISDIR(st.st_mode)) throw Failure{path + ": is a directory, not a log file"};
    // The size a pipe reports is 0: the limit holds on what is read.
    if (st.st_size > static_cast<off_t>(kMaxFileBytes))
      throw Failure{path + ": " + std::to_string(st.st_size >> 20) + " MiB is larger than the 256 MiB a log may have"};
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Failure{path + ": cannot open: " + std::strerror(errno)};
    std::string text;
    if (!internal::ReadAllCapped(in, kMaxFileBytes, &text))
      throw Failure{path + ": more than the 256 MiB a log may have (stopped reading there)"};
    if (in.bad()) throw Failure{path + ": read error"};
    kb::LogParseOptions o;
    o.source_name = path;
    o.workload = a.workload;
    o.run_id = a.run;
    o.default_time_unix_ms = static_cast<int64_t>(st.st_mtime) * 1000;
    auto parsed = kb::ParseOomLog(text, o);
    if (!parsed.ok()) throw Failure{parsed.status().message()};
    per_file->emplace_back(path, parsed->size());
    for (Incident& inc : *parsed) {
      ClassifyInPlace(&inc);
      all.push_back(std::move(inc));
    }
  }
  return all;
}

std::string Conf(double c) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.2f", c);
  return buf;
}

json EventJson(const Incident& i) {
  json j = {{"id", i.id},           {"source", i.source},         {"pattern", i.pattern},
            {"confidence", i.confidence}, {"evidence", i.evidence}, {"remedies", i.remedies},
            {"kind", IncidentKindName(i.kind)}, {"phase", PhaseName(i.phase)}, {"message", i.message},
            {"fingerprint", i.fingerprint}};
  if (IsKnown(i, "rank")) j["rank"] = i.rank;
  if (IsKnown(i, "step")) j["step"] = i.step;
  if (!i.host.empty()) j["host"] = i.host;
  if (i.requested_bytes > 0) j["requested_bytes"] = i.requested_bytes;
  return j;
}

// Every incident of the case library (diagnose --db), or none without one.
std::vector<Incident> LoadLibrary(const DiagnoseArgs& a) {
  if (a.library.empty()) return {};
  auto set = kb::KnowledgeBaseSet::Open(a.library);
  if (!set.ok()) throw Failure{set.status().ToString()};
  auto all = set->Query(IncidentQuery{});
  if (!all.ok()) throw Failure{all.status().ToString()};
  return std::move(all).value();
}

json SimilarJson(const std::vector<kb::SimilarIncident>& near) {
  json arr = json::array();
  for (const auto& s : near)
    arr.push_back({{"id", s.incident->id}, {"score", s.score}, {"why", s.why}, {"pattern", s.incident->pattern},
                   {"run_id", s.incident->run_id}, {"resolution", kb::ResolutionOf(*s.incident)}});
  return arr;
}

void PrintSimilar(const std::vector<kb::SimilarIncident>& near) {
  for (size_t k = 0; k < near.size(); ++k) {
    const Incident& i = *near[k].incident;
    std::printf("   %s %.2f %s %s (%s): %s\n", k == 0 ? "similar " : "        ", near[k].score,
                TerminalSafe(i.id).c_str(), i.pattern.c_str(), near[k].why.c_str(),
                TerminalSafe(kb::ResolutionOf(i)).c_str());
  }
}

void PrintEvent(size_t n, const Incident& i, int remedies) {
  std::string where = i.source;
  if (IsKnown(i, "rank")) where += "  rank " + std::to_string(i.rank);
  if (!i.host.empty()) where += "  host " + i.host;
  if (IsKnown(i, "step")) where += "  step " + std::to_string(i.step);
  where += "  " + std::string(IncidentKindName(i.kind)) + " memory, phase " + std::string(PhaseName(i.phase));
  std::string first = i.message.substr(0, i.message.find('\n'));
  if (first.size() > 200) first = first.substr(0, 197) + "...";
  // Text from imported logs: control characters escaped before it reaches a terminal.
  std::printf("#%zu %s\n", n, TerminalSafe(where).c_str());
  std::printf("   pattern   %s (confidence %s)\n", i.pattern.c_str(), Conf(i.confidence).c_str());
  std::printf("   message   %s\n", TerminalSafe(first).c_str());
  std::printf("   evidence  %s\n", TerminalSafe(i.evidence).c_str());
  for (int k = 0; k < remedies && k < static_cast<int>(i.remedies.size()); ++k)
    std::printf("   %s %d. %s\n", k == 0 ? "remedies" : "        ", k + 1, i.remedies[static_cast<size_t>(k)].c_str());
  std::printf("\n");
}

void CmdDiagnose(const DiagnoseArgs& a) {
  std::vector<std::pair<std::string, size_t>> per_file;
  std::vector<Incident> incs = ParseFiles(a, &per_file);
  const std::vector<Incident> library = LoadLibrary(a);
  auto near = [&](const Incident& i) {
    return library.empty() ? std::vector<kb::SimilarIncident>{}
                           : kb::FindSimilar(i, library, static_cast<size_t>(a.similar));
  };
  if (a.json) {
    for (const auto& i : incs) {
      json j = EventJson(i);
      if (!a.library.empty()) j["similar"] = SimilarJson(near(i));
      std::printf("%s\n", JsonText(j).c_str());
    }
    return;
  }
  size_t n = 0;
  for (const auto& [path, count] : per_file) {
    std::printf("%s: %zu OOM event%s\n\n", TerminalSafe(path).c_str(), count, count == 1 ? "" : "s");
    for (size_t k = 0; k < count; ++k, ++n) {
      PrintEvent(n + 1, incs[n], a.remedies);
      if (!a.library.empty()) {
        const auto similar = near(incs[n]);
        if (similar.empty()) std::printf("   similar   (none in the knowledge base)\n");
        PrintSimilar(similar);
        std::printf("\n");
      }
    }
  }
}

void CmdImportLog(const DiagnoseArgs& a) {
  if (a.db.find_first_of("*?[") != std::string::npos)
    throw Failure{"import-log writes one file: give --db without wildcards"};
  std::vector<std::pair<std::string, size_t>> per_file;
  std::vector<Incident> incs = ParseFiles(a, &per_file);
  auto kb = KnowledgeBase::Open(a.db);
  if (!kb.ok()) throw Failure{kb.status().ToString()};
  // Which events the file already holds: the ids are content-derived, so a
  // second import of the same log finds them all.
  std::set<std::string> known;
  for (const Incident& i : incs) {
    IncidentQuery q;
    q.id_prefix = i.id;
    auto r = (*kb)->Query(q);
    if (!r.ok()) throw Failure{r.status().ToString()};
    for (const Incident& old : *r) known.insert(old.id);
  }
  size_t added = 0;
  for (const Incident& i : incs) added += known.count(i.id) == 0 ? 1 : 0;
  Status s = (*kb)->Insert(incs);
  if (!s.ok()) throw Failure{s.ToString()};
  if (a.json) {
    json events = json::array();
    for (const auto& i : incs) events.push_back(EventJson(i));
    std::printf("%s\n",
                JsonText(json({{"db", a.db}, {"events", incs.size()}, {"added", added}, {"incidents", events}}), 2)
                    .c_str());
    return;
  }
  Table t({"SOURCE", "PATTERN", "CONF", "EVIDENCE"});
  for (const auto& i : incs) t.AddRow({i.source, i.pattern, Conf(i.confidence), i.evidence});
  t.Print(stdout, 110);
  std::printf("\n%zu OOM event(s) in %zu file(s): %zu added to %s, %zu already there\n", incs.size(), a.files.size(),
              added, a.db.c_str(), incs.size() - added);
}

void Run(const char* name, void (*fn)(const DiagnoseArgs&), const DiagnoseArgs& a, CommandResult* result) {
  try {
    fn(a);
    result->exit_code = 0;
  } catch (const Failure& f) {
    std::fprintf(stderr, "oomguard %s: %s\n", name, f.message.c_str());
    result->exit_code = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oomguard %s: %s\n", name, e.what());
    result->exit_code = 1;
  }
  std::fflush(stdout);
}

}  // namespace

void AddDiagnoseCommands(CLI::App* app, CommandResult* result) {
  static DiagnoseArgs args;  // lives as long as the app (main parses once)
  CLI::App* diag = app->add_subcommand(
      "diagnose", "find every OOM in logs, tracebacks, dmesg or scheduler output and explain each (no database)");
  diag->add_option("files", args.files, "log files")->required()->check(CLI::ExistingFile);
  diag->add_flag("--json", args.json, "one JSON object per OOM event");
  diag->add_option("--remedies", args.remedies, "remedies to print per event")->check(CLI::Range(0, 20));
  diag->add_option("--db", args.library,
                   "knowledge bases (repeat it, or a glob) to find similar past incidents in, with what resolved them");
  diag->add_option("--similar", args.similar, "similar past incidents to print per event")->check(CLI::Range(1, 20));
  diag->callback([result] { Run("diagnose", CmdDiagnose, args, result); });

  CLI::App* kb = app->get_subcommand("kb");
  CLI::App* imp = kb->add_subcommand("import-log", "store (and classify) every OOM event found in log files");
  imp->add_option("files", args.files, "log files")->required()->check(CLI::ExistingFile);
  imp->add_option("--db", args.db, "knowledge-base file to write (created when missing)")->required();
  imp->add_option("--workload", args.workload, "workload signature to give the events");
  imp->add_option("--run", args.run, "run id to give the events (default: the file name)");
  imp->add_flag("--json", args.json, "machine-readable JSON output");
  imp->callback([result] { Run("kb import-log", CmdImportLog, args, result); });
}

}  // namespace oomguard::cli
