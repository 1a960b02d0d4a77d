// `oomguard kb ...`: browse, import, classify and export incident knowledge
// bases. Read commands take several --db (repeatable; a glob reads every file
// it matches, e.g. one file per host) and merge them.
#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/cli/command.h"
#include "sdk/kb/jsonl.h"
#include "sdk/cli/table.h"
#include "sdk/core/ids.h"
#include "sdk/kb/file_set.h"
#include "sdk/kb/store.h"
#include "sdk/kb/similarity.h"

namespace oomguard::cli {
namespace {

using nlohmann::json;

struct KbArgs {
  std::vector<std::string> dbs;
  bool json = false;
  std::string pattern, run, since, id, file;
  std::string from;           // import: another knowledge base to copy
  std::string note, author;   // note
  bool clear = false;
  int rank = -1;
  int64_t limit = 50;
  int64_t offset = 0;
  int64_t similar_limit = 5;
};

// A command's failure: printed once by Run, exit code 1.
struct Failure {
  std::string message;
};

// The shared multi-file reader (sdk/kb/file_set.h): the browser reads with the same code.
kb::KnowledgeBaseSet OpenAll(const KbArgs& a) {
  auto set = kb::KnowledgeBaseSet::Open(a.dbs);
  if (!set.ok())
    throw Failure{set.status().code() == StatusCode::kInvalidArgument ? set.status().message()
                                                                      : set.status().ToString()};
  return std::move(set).value();
}

IncidentQuery MakeQuery(const KbArgs& a, bool with_limit) {
  IncidentQuery q;
  q.pattern = a.pattern;
  if (a.rank >= 0) q.rank = a.rank;
  q.run_id = a.run;
  auto since = kb::ParseSince(a.since, internal::NowUnixMs());
  if (!since.ok()) throw Failure{"--since " + since.status().message()};
  q.since_unix_ms = *since;
  q.limit = with_limit ? a.limit : 0;
  q.offset = with_limit ? a.offset : 0;
  return q;
}

// Newest first across every file.
std::vector<Incident> QueryAll(const KbArgs& a, bool with_limit) {
  IncidentQuery q = MakeQuery(a, with_limit);
  auto r = OpenAll(a).Query(q);
  if (!r.ok()) throw Failure{r.status().ToString()};
  return std::move(r).value();
}

json IncidentJson(const Incident& inc) { return json::parse(IncidentToJson(inc)); }

json NoteJson(const GroupNote& n) {
  return {{"text", n.text}, {"author", n.author}, {"updated_unix_ms", n.updated_unix_ms}};
}

std::string Conf(double c) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.2f", c);
  return buf;
}

void Print(const json& j) { std::printf("%s\n", JsonText(j, 2).c_str()); }

void CmdList(const KbArgs& a) {
  auto incs = QueryAll(a, true);
  if (a.json) {
    json arr = json::array();
    for (const auto& inc : incs) arr.push_back(IncidentJson(inc));
    Print(arr);
    return;
  }
  Table t({"TIME (UTC)", "ID", "HOST", "RANK", "STEP", "PHASE", "KIND", "PATTERN", "CONF", "MICRO", "OUTCOME",
           "WORKLOAD"});
  for (const auto& i : incs)
    t.AddRow({FormatTime(i.time_unix_ms), i.id, i.host, std::to_string(i.rank), std::to_string(i.step),
              std::string(PhaseName(i.phase)), std::string(IncidentKindName(i.kind)), i.pattern, Conf(i.confidence),
              std::to_string(i.micro_before) + "->" + std::to_string(i.micro_after),
              std::string(IncidentOutcomeName(i.outcome)), i.workload});
  t.Print(stdout, 40);
  if (t.size() == 0) std::printf("(no incidents)\n");
}

// The incident `a.id` (a unique prefix) among `all`.
const Incident& FindOne(const std::vector<Incident>& all, const std::string& id) {
  const Incident* found = nullptr;
  std::string ids;
  size_t n = 0;
  for (const Incident& i : all) {
    if (i.id.rfind(id, 0) != 0) continue;
    found = &i;
    ids += " " + i.id;
    ++n;
  }
  if (n == 0) throw Failure{"no incident with id '" + id + "'"};
  if (n > 1) throw Failure{"'" + id + "' matches " + std::to_string(n) + " incidents:" + ids};
  return *found;
}

// The case library's answer for one incident: the nearest past incidents,
// what they were classified as, their notes (evidence) and what resolved them.
void CmdSimilar(const KbArgs& a) {
  if (a.id.empty()) throw Failure{"similar needs an incident ID (or a unique prefix)"};
  IncidentQuery q;
  kb::KnowledgeBaseSet set = OpenAll(a);
  auto r = set.Query(q);
  if (!r.ok()) throw Failure{r.status().ToString()};
  auto notes = set.Notes();
  if (!notes.ok()) throw Failure{notes.status().ToString()};
  auto note_of = [&](const Incident& i) {
    auto it = notes->find(i.fingerprint);
    return it == notes->end() ? std::string() : it->second.text;
  };
  const std::vector<Incident> all = std::move(r).value();
  const Incident& target = FindOne(all, a.id);
  const auto near = kb::FindSimilar(target, all, static_cast<size_t>(a.similar_limit));
  if (a.json) {
    json arr = json::array();
    for (const auto& s : near)
      arr.push_back({{"id", s.incident->id}, {"score", s.score}, {"why", s.why}, {"pattern", s.incident->pattern},
                     {"time_unix_ms", s.incident->time_unix_ms}, {"run_id", s.incident->run_id},
                     {"workload", s.incident->workload}, {"evidence", s.incident->evidence},
                     {"resolution", kb::ResolutionOf(*s.incident)}, {"team_note", note_of(*s.incident)}});
    Print({{"id", target.id}, {"pattern", target.pattern}, {"similar", arr}});
    return;
  }
  std::printf("%s  %s (confidence %s)\n", TerminalSafe(target.id).c_str(), target.pattern.c_str(),
              Conf(target.confidence).c_str());
  if (near.empty()) std::printf("(no similar incident in the knowledge base)\n");
  for (const auto& s : near) {
    const Incident& i = *s.incident;
    std::printf("\n%.2f  %s  %s  %s  run %s  %s\n", s.score, TerminalSafe(i.id).c_str(), FormatTime(i.time_unix_ms).c_str(),
                i.pattern.c_str(), TerminalSafe(i.run_id).c_str(), TerminalSafe(i.workload).c_str());
    std::printf("      alike     %s\n", s.why.c_str());
    std::printf("      notes     %s\n", TerminalSafe(i.evidence.substr(0, 300)).c_str());
    std::printf("      resolved  %s\n", TerminalSafe(kb::ResolutionOf(i)).c_str());
    if (const std::string n = note_of(i); !n.empty()) std::printf("      team note %s\n", TerminalSafe(n).c_str());
  }
}

void CmdShow(const KbArgs& a) {
  if (a.id.empty()) throw Failure{"show needs an incident ID (or a unique prefix)"};
  std::vector<Incident> found;
  IncidentQuery q;
  q.id_prefix = a.id;
  kb::KnowledgeBaseSet set = OpenAll(a);
  auto r = set.Query(q);
  if (!r.ok()) throw Failure{r.status().ToString()};
  found = std::move(r).value();
  if (found.empty()) throw Failure{"no incident with id '" + a.id + "'"};
  if (found.size() > 1) {
    std::string ids;
    for (const auto& f : found) ids += " " + f.id;
    throw Failure{"'" + a.id + "' matches " + std::to_string(found.size()) + " incidents:" + ids};
  }
  const Incident& i = found[0];
  const GroupNote* note = nullptr;
  auto notes = set.Notes();
  if (!notes.ok()) throw Failure{notes.status().ToString()};
  if (auto it = notes->find(i.fingerprint); it != notes->end()) note = &it->second;
  if (a.json) {
    json j = IncidentJson(i);
    if (note != nullptr) j["note"] = NoteJson(*note);
    Print(j);
    return;
  }
  // Fields may come from an imported file: nothing reaches the terminal raw.
  auto kv = [](const char* k, const std::string& v) {
    std::printf("%-16s %s\n", k, TerminalSafe(v).c_str());
  };
  kv("id", i.id);
  kv("time (UTC)", FormatTime(i.time_unix_ms));
  kv("run", i.run_id);
  kv("host / rank", i.host + " / " + std::to_string(i.rank) + " of " + std::to_string(i.world_size));
  kv("step", std::to_string(i.step) + " (micro-batch index " + std::to_string(i.micro_index) + ")");
  kv("phase / kind", std::string(PhaseName(i.phase)) + " / " + std::string(IncidentKindName(i.kind)));
  kv("exception", i.exception_type);
  kv("message", i.message);
  kv("requested", FormatBytes(i.requested_bytes));
  kv("memory", "total " + FormatBytes(i.memory.total) + ", free " + FormatBytes(i.memory.free) + ", allocated " +
                   FormatBytes(i.memory.allocated) + ", reserved " + FormatBytes(i.memory.reserved) + ", peak " +
                   FormatBytes(i.memory.peak_allocated) + ", inactive_split " +
                   FormatBytes(i.memory.inactive_split) + ", alloc retries " +
                   std::to_string(i.memory.num_alloc_retries));
  std::string peaks;
  for (int64_t p : i.step_peaks) peaks += (peaks.empty() ? "" : " ") + FormatBytes(p);
  kv("step peaks", peaks.empty() ? "-" : peaks);
  kv("clean before", std::to_string(i.steps_ok_before) + " steps");
  if (i.sample_cost_median > 0)
    kv("sample cost", Conf(i.sample_cost_this) + " (median " + Conf(i.sample_cost_median) + ")");
  for (const auto& r : i.ranks)
    kv("rank memory", "rank " + std::to_string(r.rank) + ": allocated " + FormatBytes(r.allocated) + ", reserved " +
                          FormatBytes(r.reserved) + ", peak " + FormatBytes(r.peak_allocated));
  std::string actions;
  for (LadderAction s : i.actions) actions += (actions.empty() ? "" : " -> ") + std::string(LadderActionName(s));
  kv("ladder", actions.empty() ? std::string(LadderActionName(i.action)) : actions);
  kv("micro-batch", std::to_string(i.micro_before) + " -> " + std::to_string(i.micro_after));
  kv("outcome", std::string(IncidentOutcomeName(i.outcome)) + " (" + Conf(i.recovery_ms) + " ms)");
  kv("workload", i.workload);
  if (!i.source.empty()) kv("source", i.source);
  if (!i.unknown.empty()) {
    std::string u;
    for (const auto& f : i.unknown) u += (u.empty() ? "" : ", ") + f;
    kv("unknown", u);
  }
  kv("pattern", i.pattern + " (confidence " + Conf(i.confidence) + ")");
  kv("evidence", i.evidence);
  kv("fingerprint", i.fingerprint);
  if (note != nullptr)
    kv("team note", note->text + " (" + (note->author.empty() ? "" : note->author + ", ") +
                        FormatTime(note->updated_unix_ms) + ")");
  std::printf("remedies:\n");
  for (size_t k = 0; k < i.remedies.size(); ++k)
    std::printf("  %zu. %s\n", k + 1, TerminalSafe(i.remedies[k]).c_str());
  // Imported log text, line by line, with control characters escaped.
  if (!i.context.empty()) {
    std::printf("context:\n");
    size_t at = 0;
    while (at <= i.context.size()) {
      const size_t nl = std::min(i.context.find('\n', at), i.context.size());
      std::printf("%s\n", TerminalSafe(std::string_view(i.context).substr(at, nl - at)).c_str());
      at = nl + 1;
    }
  }
}

void CmdStats(const KbArgs& a) {
  auto merged = OpenAll(a).Stats();
  if (!merged.ok()) throw Failure{merged.status().ToString()};
  const kb::FileSetStats& st = *merged;
  json files = json::array();
  for (const auto& f : st.files)
    files.push_back({{"db", f.path}, {"schema_version", f.schema_version}, {"incidents", f.incidents},
                     {"dropped", f.dropped}});
  std::map<std::string, int64_t> by_pattern(st.by_pattern.begin(), st.by_pattern.end());
  std::map<std::string, int64_t> by_outcome(st.by_outcome.begin(), st.by_outcome.end());
  std::map<std::string, int64_t> by_kind(st.by_kind.begin(), st.by_kind.end());
  const int64_t total = st.incidents, dropped = st.dropped;
  const std::vector<MicroBatchPrior>& priors = st.priors;
  if (a.json) {
    json pj = json::array();
    for (const auto& p : priors) {
      json model = nullptr;
      if (p.model) {
        model = {{"fixed_bytes", p.model->fixed_bytes},
                 {"unit_bytes", p.model->unit_bytes},
                 {"overhead_bytes", p.model->overhead_bytes},
                 {"overhead", p.model->overhead},
                 {"overhead_too_small", p.model->overhead_too_small},
                 {"noise_bytes", p.model->noise_bytes}};
      }
      pj.push_back({{"workload", p.workload},
                    {"micro_batch", p.micro_batch},
                    {"updated_unix_ms", p.updated_unix_ms},
                    {"model", model}});
    }
    Print({{"files", files}, {"incidents", total}, {"dropped", dropped}, {"by_pattern", by_pattern},
           {"by_outcome", by_outcome}, {"by_kind", by_kind}, {"priors", pj}});
    return;
  }
  std::printf("%" PRId64 " incidents in %zu file(s); %" PRId64 " dropped by full queues\n\n", total, files.size(),
              dropped);
  auto counts = [&](const char* head, const std::map<std::string, int64_t>& m) {
    std::vector<std::pair<std::string, int64_t>> v(m.begin(), m.end());
    std::sort(v.begin(), v.end(), [](auto& x, auto& y) { return x.second > y.second; });
    Table t({head, "COUNT", "SHARE"});
    for (auto& [k, n] : v) {
      char share[16];
      std::snprintf(share, sizeof(share), "%.0f%%", total > 0 ? 100.0 * static_cast<double>(n) / static_cast<double>(total) : 0.0);
      t.AddRow({k.empty() ? "(none)" : k, std::to_string(n), share});
    }
    t.Print(stdout);
    std::printf("\n");
  };
  counts("PATTERN", by_pattern);
  counts("OUTCOME", by_outcome);
  counts("KIND", by_kind);
  Table t({"WORKLOAD", "PRIOR MICRO-BATCH", "MEMORY MODEL", "UPDATED (UTC)"});
  for (const auto& p : priors) {
    // "fixed + per unit, allocator overhead": what the predictive controller fitted.
    std::string model = "-";
    if (p.model) {
      char share[32];
      std::snprintf(share, sizeof(share), "%.1f%%", 100.0 * p.model->overhead);
      model = FormatBytes(p.model->fixed_bytes) + " + " + FormatBytes(p.model->unit_bytes) +
              "/unit, overhead " + FormatBytes(p.model->overhead_bytes) + " + " + share;
    }
    t.AddRow({p.workload, std::to_string(p.micro_batch), model, FormatTime(p.updated_unix_ms)});
  }
  t.Print(stdout);
}

void CmdGroups(const KbArgs& a) {
  // Recounted from the incidents themselves so that runs spanning several
  // files (one per host) are counted once (sdk/kb/file_set.h).
  kb::KnowledgeBaseSet set = OpenAll(a);
  auto groups = set.Groups(MakeQuery(a, false));
  if (!groups.ok()) throw Failure{groups.status().ToString()};
  auto notes = set.Notes();
  if (!notes.ok()) throw Failure{notes.status().ToString()};
  const std::vector<IncidentGroup>& out = *groups;
  auto note_of = [&](const std::string& fp) -> const GroupNote* {
    auto it = notes->find(fp);
    return it == notes->end() ? nullptr : &it->second;
  };
  if (a.json) {
    json arr = json::array();
    for (const auto& g : out) {
      const GroupNote* n = note_of(g.fingerprint);
      arr.push_back({{"fingerprint", g.fingerprint}, {"pattern", g.pattern}, {"kind", IncidentKindName(g.kind)},
                     {"phase", PhaseName(g.phase)},
                     {"workload", g.workload}, {"count", g.count}, {"runs", g.runs},
                     {"first_seen_unix_ms", g.first_seen_unix_ms}, {"last_seen_unix_ms", g.last_seen_unix_ms},
                     {"last_id", g.last_id}, {"note", n != nullptr ? NoteJson(*n) : json(nullptr)}});
    }
    Print(arr);
    return;
  }
  Table t({"FINGERPRINT", "PATTERN", "KIND", "PHASE", "WORKLOAD", "COUNT", "RUNS", "FIRST SEEN", "LAST SEEN",
           "LAST ID", "NOTE"});
  for (const auto& g : out) {
    const GroupNote* n = note_of(g.fingerprint);
    t.AddRow({g.fingerprint, g.pattern, std::string(IncidentKindName(g.kind)), std::string(PhaseName(g.phase)),
              g.workload, std::to_string(g.count), std::to_string(g.runs),
              FormatTime(g.first_seen_unix_ms), FormatTime(g.last_seen_unix_ms), g.last_id,
              n != nullptr ? n->text : ""});
  }
  t.Print(stdout);
  if (out.empty()) std::printf("(no incidents)\n");
}

void CmdPatterns(const KbArgs& a) {
  if (a.json) {
    json arr = json::array();
    for (const auto& p : PatternCatalogue())
      arr.push_back({{"name", p.name}, {"title", p.title}, {"signal", p.signal}, {"rule", p.rule},
                     {"remedies", p.remedies}});
    Print(arr);
    return;
  }
  Table t({"PATTERN", "WHAT IT IS", "TOP REMEDY"});
  for (const auto& p : PatternCatalogue()) t.AddRow({p.name, p.title, p.remedies.empty() ? "" : p.remedies[0]});
  t.Print(stdout, 70);
  std::printf("\nThe rules and every remedy: docs/patterns.md (or --json).\n");
}

// Reads a JSONL file completely; the first bad line is an error that names it.
std::vector<Incident> ReadJsonl(const std::string& path) {
  auto r = kb::ReadIncidentsJsonlFile(path, kb::BadLine::kError);
  if (!r.ok()) throw Failure{r.status().message()};
  return std::move(r->incidents);
}

// The one knowledge base a writing command writes: --db, or $OOMGUARD_KB_URL.
std::string TargetDb(const KbArgs& a, const char* what) {
  auto dbs = kb::ExpandPaths(a.dbs);
  if (!dbs.ok()) throw Failure{dbs.status().message()};
  if (dbs->size() != 1 || (a.dbs.size() == 1 && !kb::IsServerUrl(a.dbs[0]) &&
                           a.dbs[0].find_first_of("*?[") != std::string::npos))
    throw Failure{std::string(what) + " writes one knowledge base: give exactly one --db without wildcards"};
  return (*dbs)[0];
}

void CmdImport(const KbArgs& a) {
  const std::string db = TargetDb(a, "import");
  if (a.file.empty() == a.from.empty()) throw Failure{"import takes a JSONL file or --from KB (one of them)"};
  std::vector<Incident> incs;
  std::string source;
  if (!a.from.empty()) {
    // Another knowledge base (an SQLite file into the server, or back): the
    // incidents as stored, classification included.
    KnowledgeBaseOptions ro;
    ro.read_only = true;
    auto src = KnowledgeBase::Open(a.from, ro);
    if (!src.ok()) throw Failure{src.status().ToString()};
    auto all = (*src)->Query(IncidentQuery{});
    if (!all.ok()) throw Failure{all.status().ToString()};
    incs = std::move(all).value();
    auto notes = (*src)->Notes();
    if (!notes.ok()) throw Failure{notes.status().ToString()};
    source = (*src)->path();
    auto kb = KnowledgeBase::Open(db);
    if (!kb.ok()) throw Failure{kb.status().ToString()};
    Status s = (*kb)->Insert(incs);
    if (!s.ok()) throw Failure{s.ToString()};
    for (const GroupNote& n : *notes)
      if (Status ns = (*kb)->SetNote(n); !ns.ok()) throw Failure{ns.ToString()};
  } else {
    // Parse everything first: a bad line means nothing of the file is imported.
    incs = ReadJsonl(a.file);
    for (auto& i : incs) i.pattern.clear();  // the knowledge base classifies what it imports
    source = a.file;
    auto kb = KnowledgeBase::Open(db);
    if (!kb.ok()) throw Failure{kb.status().ToString()};
    Status s = (*kb)->Insert(incs);
    if (!s.ok()) throw Failure{s.ToString()};
  }
  const std::string shown = kb::RedactUrl(db);
  if (a.json) {
    Print({{"db", shown}, {"imported", incs.size()}});
  } else {
    std::printf("imported %zu incident(s) from %s into %s\n", incs.size(), TerminalSafe(source).c_str(),
                TerminalSafe(shown).c_str());
  }
}

// A team's note on a fingerprint group, shown with every incident of it.
void CmdNote(const KbArgs& a) {
  const std::string db = TargetDb(a, "note");
  if (a.id.empty()) throw Failure{"note needs the FINGERPRINT of a group (see `oomguard kb groups`)"};
  if (a.clear == !a.note.empty()) throw Failure{"note takes the TEXT of the note, or --clear (one of them)"};
  auto kb = KnowledgeBase::Open(db);
  if (!kb.ok()) throw Failure{kb.status().ToString()};
  IncidentQuery q;
  q.fingerprint = a.id;
  auto n = (*kb)->Count(q);
  if (!n.ok()) throw Failure{n.status().ToString()};
  if (*n == 0 && !a.clear) throw Failure{"no incident has fingerprint '" + a.id + "' (see `oomguard kb groups`)"};
  std::string author = a.author;
  if (author.empty())
    if (const char* user = std::getenv("USER"); user != nullptr) author = user;
  Status s = (*kb)->SetNote({a.id, a.clear ? "" : a.note, author, 0});
  if (!s.ok()) throw Failure{s.code() == StatusCode::kInvalidArgument ? s.message() : s.ToString()};
  if (a.json) {
    Print({{"db", kb::RedactUrl(db)}, {"fingerprint", a.id}, {"note", a.clear ? json(nullptr) : json(a.note)},
           {"incidents", *n}});
  } else if (a.clear) {
    std::printf("removed the note of %s\n", TerminalSafe(a.id).c_str());
  } else {
    std::printf("noted on %s (%" PRId64 " incident(s)): %s\n", TerminalSafe(a.id).c_str(), *n,
                TerminalSafe(a.note).c_str());
  }
}

void CmdClassify(const KbArgs& a) {
  std::vector<Incident> incs = ReadJsonl(a.file);
  if (a.json) {
    for (const auto& i : incs) {
      Incident c = i;
      ClassifyInPlace(&c);
      json j = {{"id", c.id}, {"pattern", c.pattern}, {"confidence", c.confidence}, {"evidence", c.evidence},
                {"remedies", c.remedies}, {"fingerprint", c.fingerprint}};
      std::printf("%s\n", JsonText(j).c_str());
    }
    return;
  }
  Table t({"ID", "PATTERN", "CONF", "EVIDENCE"});
  for (const auto& i : incs) {
    Classification c = ClassifyIncident(i);
    t.AddRow({i.id, c.pattern, Conf(c.confidence), c.evidence});
  }
  t.Print(stdout, 100);
}

void CmdExport(const KbArgs& a) {
  for (const auto& i : QueryAll(a, false)) std::printf("%s\n", IncidentToJson(i).c_str());
}

void Run(const char* name, void (*fn)(const KbArgs&), const KbArgs& a, CommandResult* result) {
  try {
    fn(a);
    result->exit_code = 0;
  } catch (const Failure& f) {
    std::fprintf(stderr, "oomguard kb %s: %s\n", name, TerminalSafe(f.message).c_str());
    result->exit_code = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "oomguard kb %s: %s\n", name, TerminalSafe(e.what()).c_str());
    result->exit_code = 1;
  }
  std::fflush(stdout);
}

}  // namespace

void AddKbCommands(CLI::App* app, CommandResult* result) {
  // Shared by every kb subcommand; lives as long as the app (static: main parses once).
  static KbArgs args;
  CLI::App* kb = app->add_subcommand(
      "kb", "the incident knowledge base (SQLite files or a PostgreSQL server written by the SDK)");
  kb->require_subcommand(1);

  auto common = [&](CLI::App* c, bool needs_db) {
    if (needs_db) {
      CLI::Option* db = c->add_option("--db", args.dbs,
                                      "knowledge-base file or postgresql:// URL; repeat it or use a glob "
                                      "('kb/*.db') to read several (default: $OOMGUARD_KB_URL)");
      const char* url = std::getenv("OOMGUARD_KB_URL");
      if (url == nullptr || *url == '\0') db->required();
      // One value per --db: the positionals of import and note stay theirs.
      db->allow_extra_args(false);
    }
    c->add_flag("--json", args.json, "machine-readable JSON output");
  };
  auto filters = [&](CLI::App* c) {
    c->add_option("--pattern", args.pattern, "only this pattern (see `oomguard kb patterns`)");
    c->add_option("--rank", args.rank, "only this rank")->check(CLI::NonNegativeNumber);
    c->add_option("--run", args.run, "only this run id");
    c->add_option("--since", args.since, "only since: 30m, 12h, 7d, 2024-05-01 or unix milliseconds");
  };
  auto bind = [&](CLI::App* c, const char* name, void (*fn)(const KbArgs&)) {
    c->callback([name, fn, result] { Run(name, fn, args, result); });
  };

  CLI::App* list = kb->add_subcommand("list", "incidents, newest first");
  common(list, true);
  filters(list);
  list->add_option("--limit", args.limit, "at most this many (0: all)")->check(CLI::NonNegativeNumber);
  list->add_option("--offset", args.offset, "skip this many of the newest first (paging; a server answers only the page)")
      ->check(CLI::NonNegativeNumber);
  bind(list, "list", CmdList);

  CLI::App* show = kb->add_subcommand("show", "one incident with its evidence and remedies");
  common(show, true);
  show->add_option("id", args.id, "incident id or a unique prefix")->required();
  bind(show, "show", CmdShow);

  CLI::App* similar = kb->add_subcommand("similar", "the nearest past incidents to one, with their notes and what resolved them");
  common(similar, true);
  similar->add_option("id", args.id, "incident id or a unique prefix")->required();
  similar->add_option("--limit", args.similar_limit, "at most this many (default 5)")->check(CLI::NonNegativeNumber);
  bind(similar, "similar", CmdSimilar);

  CLI::App* stats = kb->add_subcommand("stats", "counts by pattern, outcome and kind; learned priors");
  common(stats, true);
  bind(stats, "stats", CmdStats);

  CLI::App* groups = kb->add_subcommand("groups", "recurring incidents grouped by fingerprint");
  common(groups, true);
  filters(groups);
  bind(groups, "groups", CmdGroups);

  CLI::App* patterns = kb->add_subcommand("patterns", "the pattern catalogue");
  common(patterns, false);
  bind(patterns, "patterns", CmdPatterns);

  CLI::App* imp = kb->add_subcommand(
      "import", "store (and classify) incidents from a JSONL file, or copy another knowledge base (--from)");
  common(imp, true);
  imp->add_option("file", args.file, "JSONL file, one incident per line");
  imp->add_option("--from", args.from,
                  "knowledge base to copy as stored, notes included (an SQLite file into a server, or back)");
  bind(imp, "import", CmdImport);

  CLI::App* cls = kb->add_subcommand("classify", "classify incidents from a JSONL file without storing them");
  common(cls, false);
  cls->add_option("file", args.file, "JSONL file, one incident per line")->required();
  bind(cls, "classify", CmdClassify);

  CLI::App* note = kb->add_subcommand("note", "attach a team's note to a fingerprint group (shown with its incidents)");
  common(note, true);
  note->add_option("fingerprint", args.id, "the group's fingerprint (see `oomguard kb groups`)")->required();
  note->add_option("text", args.note, "the note, e.g. 'fixed by expandable_segments'");
  note->add_option("--author", args.author, "who wrote it (default: $USER)");
  note->add_flag("--clear", args.clear, "remove the group's note");
  bind(note, "note", CmdNote);

  CLI::App* exp = kb->add_subcommand("export", "every incident as JSONL, newest first");
  common(exp, true);
  filters(exp);
  bind(exp, "export", CmdExport);
}

}  // namespace oomguard::cli
