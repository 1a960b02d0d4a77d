#include "sdk/server/browser_api.h"

#include <charconv>
#include <map>
#include <nlohmann/json.hpp>

#include "oomguard/knowledge_base.h"
#include "sdk/core/ids.h"
#include "sdk/kb/file_set.h"
#include "sdk/kb/similarity.h"
#include "sdk/server/assets.h"
#include "sdk/server/browser_data.h"
#include "sdk/server/metrics.h"

namespace oomguard::server {
namespace {

using nlohmann::json;

// The page loads only its own script and style; data arrives through fetch
// from the same origin. Defence in depth: the page never turns data into
// markup, and this policy would keep an injected inline script from running.
constexpr const char* kCsp =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

HttpResponse Json(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.content_type = "application/json; charset=utf-8";
  r.body = std::move(body);
  return r;
}

HttpResponse Error(int status, const std::string& message) {
  return Json(status, Dump({{"error", message}, {"status", status}}));
}

// A parameter value quoted for an error message: bounded, so a huge value is
// not echoed back whole.
std::string Quote(std::string_view v) {
  constexpr size_t kMax = 64;
  return "'" + std::string(v.substr(0, kMax)) + (v.size() > kMax ? "...'" : "'");
}

struct Params {
  std::map<std::string, std::string> values;
  std::string error;  // set when the query string is unacceptable
};

Params ParseQuery(std::string_view query, const ApiLimits& limits) {
  Params p;
  size_t count = 0;
  while (!query.empty()) {
    size_t amp = query.find('&');
    std::string_view part = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (part.empty()) continue;
    if (++count > limits.max_params) {
      p.error = "too many parameters (at most " + std::to_string(limits.max_params) + ")";
      return p;
    }
    size_t eq = part.find('=');
    std::string key, value;
    if (!PercentDecode(part.substr(0, eq), &key) ||
        !PercentDecode(eq == std::string_view::npos ? std::string_view() : part.substr(eq + 1), &value)) {
      p.error = "parameter " + Quote(part) + ": bad percent-encoding";
      return p;
    }
    if (key.size() > 64) {
      p.error = "parameter name " + Quote(key) + " is too long";
      return p;
    }
    if (value.size() > limits.max_param_bytes) {
      p.error = "parameter '" + key + "' is longer than " + std::to_string(limits.max_param_bytes) + " bytes";
      return p;
    }
    if (!p.values.emplace(key, value).second) {
      p.error = "parameter '" + key + "' is given more than once";
      return p;
    }
  }
  return p;
}

// Rejects any parameter outside `allowed`, naming it.
std::string CheckAllowed(const Params& p, std::initializer_list<std::string_view> allowed) {
  for (const auto& [k, v] : p.values) {
    bool ok = false;
    for (std::string_view a : allowed) ok = ok || k == a;
    if (!ok) return "unknown parameter " + Quote(k);
  }
  return "";
}

bool ParseInt(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

// The CLI's filters (sdk/kb/file_set.h semantics) from query parameters.
std::string ParseFilters(const Params& p, IncidentQuery* q) {
  auto get = [&](const char* k) -> const std::string* {
    auto it = p.values.find(k);
    return it == p.values.end() || it->second.empty() ? nullptr : &it->second;
  };
  if (auto* v = get("pattern")) q->pattern = *v;
  if (auto* v = get("run")) q->run_id = *v;
  if (auto* v = get("workload")) q->workload = *v;
  if (auto* v = get("fingerprint")) q->fingerprint = *v;
  if (auto* v = get("rank")) {
    int64_t r = 0;
    if (!ParseInt(*v, 0, INT32_MAX, &r))
      return "parameter 'rank': " + Quote(*v) + " is not a rank (0, 1, ...)";
    q->rank = static_cast<int>(r);
  }
  if (auto* v = get("since")) {
    auto since = kb::ParseSince(*v, internal::NowUnixMs());
    if (!since.ok()) return "parameter 'since': " + since.status().message();
    q->since_unix_ms = *since;
  }
  return "";
}

json GroupJson(const IncidentGroup& g) {
  return {{"fingerprint", g.fingerprint},
          {"pattern", g.pattern},
          {"kind", IncidentKindName(g.kind)},
          {"phase", PhaseName(g.phase)},
          {"workload", g.workload},
          {"count", g.count},
          {"runs", g.runs},
          {"first_seen_unix_ms", g.first_seen_unix_ms},
          {"last_seen_unix_ms", g.last_seen_unix_ms},
          {"last_id", g.last_id}};
}

json Counts(const std::vector<std::pair<std::string, int64_t>>& v) {
  json a = json::array();
  for (const auto& [name, n] : v) a.push_back({{"name", name}, {"count", n}});
  return a;
}

HttpResponse Unavailable(const Status& s) { return Error(503, "the knowledge base did not answer: " + s.message()); }

HttpResponse ListIncidents(BrowserData& data, const Params& p, const ApiLimits& limits) {
  std::string err =
      CheckAllowed(p, {"pattern", "rank", "run", "since", "workload", "fingerprint", "q", "offset", "limit"});
  IncidentQuery q;
  q.limit = 50;
  if (err.empty()) err = ParseFilters(p, &q);
  if (!err.empty()) return Error(400, err);
  if (auto it = p.values.find("q"); it != p.values.end()) q.text = it->second;
  int64_t v = 0;
  if (auto it = p.values.find("offset"); it != p.values.end()) {
    if (!ParseInt(it->second, 0, INT64_MAX / 2, &v))
      return Error(400, "parameter 'offset': " + Quote(it->second) + " is not a non-negative integer");
    q.offset = v;
  }
  if (auto it = p.values.find("limit"); it != p.values.end()) {
    if (!ParseInt(it->second, 1, static_cast<int64_t>(limits.max_page), &v))
      return Error(400, "parameter 'limit': " + Quote(it->second) + " must be between 1 and " +
                            std::to_string(limits.max_page));
    q.limit = v;
  }
  auto page = data.List(q);
  if (!page.ok()) return Unavailable(page.status());
  // Items are the stored exchange records, concatenated as they are: no
  // second parse and dump per row (this is the hot path of the page).
  std::string body = "{\"total\":" + std::to_string(page->total) + ",\"offset\":" + std::to_string(q.offset) +
                     ",\"limit\":" + std::to_string(q.limit) + ",\"items\":[";
  body.reserve(body.size() + page->items.size() * 1024);
  for (size_t k = 0; k < page->items.size(); ++k) {
    if (k > 0) body += ',';
    body += IncidentToJson(page->items[k]);
  }
  body += "]}";
  return Json(200, std::move(body));
}

HttpResponse Asset(std::string_view name) {
  const EmbeddedAsset* a = FindAsset(name);
  if (a == nullptr) return Error(404, "no such page");
  HttpResponse r;
  r.content_type = std::string(AssetContentType(name));
  r.body = std::string(a->data);
  r.headers.emplace_back("Cache-Control", "no-cache");
  return r;
}

}  // namespace

std::string_view AssetContentType(std::string_view name) {
  auto ends = [&](std::string_view ext) {
    return name.size() >= ext.size() && name.substr(name.size() - ext.size()) == ext;
  };
  if (ends(".html")) return "text/html; charset=utf-8";
  if (ends(".js")) return "text/javascript; charset=utf-8";
  if (ends(".css")) return "text/css; charset=utf-8";
  if (ends(".svg")) return "image/svg+xml";
  return "application/octet-stream";
}

bool PercentDecode(std::string_view in, std::string* out) {
  out->clear();
  out->reserve(in.size());
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < in.size(); ++i) {
    char c = in[i];
    if (c == '+') {
      out->push_back(' ');
    } else if (c == '%') {
      if (i + 2 >= in.size()) return false;
      int h = hex(in[i + 1]), l = hex(in[i + 2]);
      if (h < 0 || l < 0) return false;
      out->push_back(static_cast<char>(h * 16 + l));
      i += 2;
    } else {
      out->push_back(c);
    }
  }
  return true;
}

std::string StatsJson(const BrowserTotals& t) {
  const kb::FileSetStats& s = t.stats;
  json files = json::array();
  for (const auto& f : s.files)
    files.push_back({{"db", f.path},
                     {"schema_version", f.schema_version},
                     {"incidents", f.incidents},
                     {"dropped", f.dropped}});
  json priors = json::array();
  for (const auto& p : s.priors)
    priors.push_back(
        {{"workload", p.workload}, {"micro_batch", p.micro_batch}, {"updated_unix_ms", p.updated_unix_ms}});
  json ranks = json::array();
  for (const auto& [rank, n] : t.by_rank) ranks.push_back({{"rank", rank}, {"count", n}});
  return Dump({{"incidents", s.incidents},
               {"dropped", s.dropped},
               {"runs", t.runs},
               {"groups", t.groups},
               {"last_incident_unix_ms", t.last_incident_unix_ms},
               {"loaded_unix_ms", t.loaded_unix_ms},
               {"by_pattern", Counts(s.by_pattern)},
               {"by_outcome", Counts(s.by_outcome)},
               {"by_kind", Counts(s.by_kind)},
               {"by_rank", ranks},
               {"files", files},
               {"priors", priors}});
}

std::string PatternsJson(const std::vector<std::pair<std::string, int64_t>>& by_pattern) {
  std::map<std::string, int64_t> counts(by_pattern.begin(), by_pattern.end());
  json arr = json::array();
  for (const PatternInfo& p : PatternCatalogue()) {
    auto it = counts.find(p.name);
    arr.push_back({{"name", p.name},
                   {"title", p.title},
                   {"signal", p.signal},
                   {"rule", p.rule},
                   {"remedies", p.remedies},
                   {"count", it == counts.end() ? 0 : it->second}});
  }
  return Dump(arr);
}

std::string GroupsJson(const std::vector<IncidentGroup>& groups) {
  json arr = json::array();
  for (const auto& g : groups) arr.push_back(GroupJson(g));
  return Dump(arr);
}

std::string RunsJson(const std::vector<RunSummary>& runs) {
  json arr = json::array();
  for (const RunSummary& r : runs)
    arr.push_back({{"run_id", r.run_id},
                   {"workload", r.workload},
                   {"incidents", r.incidents},
                   {"failed", r.failed},
                   {"first_unix_ms", r.first_unix_ms},
                   {"last_unix_ms", r.last_unix_ms},
                   {"first_step", r.first_step},
                   {"last_step", r.last_step},
                   {"hosts", r.hosts}});
  return Dump(arr);
}

std::string RunJson(std::string_view run_id, const std::vector<Incident>& members) {
  if (members.empty()) return "";
  json points = json::array();
  for (const Incident& i : members)
    points.push_back({{"id", i.id},
                      {"step", i.step},
                      {"time_unix_ms", i.time_unix_ms},
                      {"rank", i.rank},
                      {"micro_before", i.micro_before},
                      {"micro_after", i.micro_after},
                      {"pattern", i.pattern},
                      {"action", i.action},
                      {"outcome", i.outcome}});
  return Dump({{"run_id", run_id}, {"points", points}});
}

// The case library's nearest past incidents to one (kb similar), for the
// incident page.
std::string SimilarJson(const Incident& target, const std::vector<Incident>& pool) {
  json arr = json::array();
  for (const auto& s : kb::FindSimilar(target, pool, 5))
    arr.push_back({{"id", s.incident->id},
                   {"score", s.score},
                   {"why", s.why},
                   {"pattern", s.incident->pattern},
                   {"time_unix_ms", s.incident->time_unix_ms},
                   {"run_id", s.incident->run_id},
                   {"evidence", s.incident->evidence},
                   {"resolution", kb::ResolutionOf(*s.incident)}});
  return Dump(arr);
}

BrowserApi::BrowserApi(std::shared_ptr<BrowserData> data, ApiLimits limits)
    : data_(std::move(data)), limits_(limits) {}

BrowserApi::BrowserApi(SnapshotFn snapshot, ApiLimits limits)
    : BrowserApi(std::make_shared<IndexData>(std::move(snapshot)), limits) {}

void BrowserApi::EnableNoteWrites(std::string token, NoteWriter write) {
  token_ = std::move(token);
  write_note_ = std::move(write);
}

namespace {

json NoteJson(const GroupNote& n) {
  return {{"fingerprint", n.fingerprint}, {"text", n.text}, {"author", n.author},
          {"updated_unix_ms", n.updated_unix_ms}};
}

// Compares in time independent of where the texts first differ (the length is no secret).
bool SameSecret(std::string_view a, std::string_view b) {
  if (a.size() != b.size() || b.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

HttpResponse BrowserApi::Handle(std::string_view method, std::string_view target,
                                std::string_view authorization) const {
  constexpr std::string_view kNotes = "/api/notes";
  HttpResponse r = [&]() -> HttpResponse {
    const bool post_note = method == "POST" && target.substr(0, kNotes.size() + 1) == "/api/notes/";
    if (method != "GET" && method != "HEAD" && !post_note) {
      HttpResponse e = Error(405, "only GET and HEAD are served, and POST to /api/notes/<fingerprint>");
      e.headers.emplace_back("Allow", "GET, HEAD");
      return e;
    }
    if (target.size() > limits_.max_target_bytes)
      return Error(414, "request target longer than " + std::to_string(limits_.max_target_bytes) + " bytes");
    if (target.empty() || target[0] != '/') return Error(400, "request target must be a path");
    size_t qm = target.find('?');
    std::string_view raw_path = target.substr(0, qm);
    Params params =
        ParseQuery(qm == std::string_view::npos ? std::string_view() : target.substr(qm + 1), limits_);
    if (!params.error.empty()) return Error(400, params.error);
    std::string path;
    if (!PercentDecode(raw_path, &path) || path.find('\0') != std::string::npos)
      return Error(400, "bad percent-encoding in the path");

    if (post_note) {
      // The one write: a team's note on a fingerprint group, with the token.
      if (write_note_ == nullptr)
        return Error(403, "notes are read-only here: start `oomguard kb serve` with --notes-token-file to "
                          "let the page write them");
      constexpr std::string_view kBearer = "Bearer ";
      if (authorization.substr(0, kBearer.size()) != kBearer ||
          !SameSecret(authorization.substr(kBearer.size()), token_))
        return Error(401, "writing a note needs the token given to `oomguard kb serve` (Authorization: Bearer)");
      if (auto e = CheckAllowed(params, {"text", "author"}); !e.empty()) return Error(400, e);
      GroupNote note;
      note.fingerprint = path.substr(kNotes.size() + 1);
      if (note.fingerprint.empty() || note.fingerprint.size() > 64)
        return Error(400, "a note needs the fingerprint of its group in the path");
      if (auto it = params.values.find("text"); it != params.values.end()) note.text = it->second;
      if (auto it = params.values.find("author"); it != params.values.end()) note.author = it->second;
      if (!note.text.empty()) {
        IncidentQuery of_group;
        of_group.fingerprint = note.fingerprint;
        of_group.limit = 1;
        auto members = data_->List(of_group);
        if (!members.ok()) return Unavailable(members.status());
        if (members->total == 0) return Error(404, "no incident has fingerprint " + Quote(note.fingerprint));
      }
      Status s = write_note_(note);
      if (!s.ok())
        return Error(s.code() == StatusCode::kInvalidArgument ? 400 : 503, "the note was not written: " + s.message());
      return Json(200, Dump(json{{"written", true}, {"note", note.text.empty() ? json(nullptr) : NoteJson(note)}}));
    }

    // Static files: a fixed list of names; nothing maps a path to the disk.
    if (path == "/" || path == "/index.html") return Asset("index.html");
    if (path == "/app.js" || path == "/app.css") return Asset(std::string_view(path).substr(1));

    BrowserData& data = *data_;
    auto no_params = [&]() -> std::string { return CheckAllowed(params, {}); };
    std::string_view p = path;
    constexpr std::string_view kIncidents = "/api/incidents", kRuns = "/api/runs";
    if (p == kIncidents || p == "/api/incidents/") return ListIncidents(data, params, limits_);
    if (p.substr(0, kIncidents.size() + 1) == "/api/incidents/") {
      if (auto e = no_params(); !e.empty()) return Error(400, e);
      std::string_view id = p.substr(kIncidents.size() + 1);
      constexpr std::string_view kSimilar = "/similar";
      const bool similar = id.size() > kSimilar.size() && id.substr(id.size() - kSimilar.size()) == kSimilar;
      if (similar) id.remove_suffix(kSimilar.size());
      auto inc = data.Find(std::string(id));
      if (!inc.ok()) return Unavailable(inc.status());
      if (!*inc) return Error(404, "no incident with id " + Quote(id));
      if (similar) {
        auto pool = data.SimilarPool(**inc);
        if (!pool.ok()) return Unavailable(pool.status());
        return Json(200, SimilarJson(**inc, *pool));
      }
      return Json(200, IncidentToJson(**inc));
    }
    if (p == kRuns) {
      if (auto e = no_params(); !e.empty()) return Error(400, e);
      auto runs = data.Runs();
      if (!runs.ok()) return Unavailable(runs.status());
      return Json(200, RunsJson(*runs));
    }
    if (p.substr(0, kRuns.size() + 1) == "/api/runs/") {
      if (auto e = no_params(); !e.empty()) return Error(400, e);
      std::string_view run = p.substr(kRuns.size() + 1);
      auto members = data.Run(std::string(run));
      if (!members.ok()) return Unavailable(members.status());
      std::string body = RunJson(run, *members);
      if (body.empty()) return Error(404, "no run with id " + Quote(run));
      return Json(200, std::move(body));
    }
    if (p == "/api/groups") {
      std::string err = CheckAllowed(params, {"pattern", "rank", "run", "since", "workload"});
      IncidentQuery q;
      if (err.empty()) err = ParseFilters(params, &q);
      if (!err.empty()) return Error(400, err);
      auto groups = data.Groups(q);
      if (!groups.ok()) return Unavailable(groups.status());
      return Json(200, GroupsJson(*groups));
    }
    if (p == kNotes) {
      if (auto e = no_params(); !e.empty()) return Error(400, e);
      auto notes = data.Notes();
      if (!notes.ok()) return Unavailable(notes.status());
      json all = json::object();
      for (const auto& [fp, n] : *notes) all[fp] = NoteJson(n);
      return Json(200, Dump(all));
    }
    if (p.substr(0, kNotes.size() + 1) == "/api/notes/") {
      if (auto e = no_params(); !e.empty()) return Error(400, e);
      auto notes = data.Notes();
      if (!notes.ok()) return Unavailable(notes.status());
      auto it = notes->find(std::string(p.substr(kNotes.size() + 1)));
      if (it == notes->end()) return Error(404, "no note on group " + Quote(p.substr(kNotes.size() + 1)));
      return Json(200, Dump(NoteJson(it->second)));
    }
    if (p == "/api/patterns" || p == "/api/stats" || p == "/metrics") {
      if (p != "/metrics")
        if (auto e = no_params(); !e.empty()) return Error(400, e);
      auto totals = data.Totals();
      if (!totals.ok()) return Unavailable(totals.status());
      if (p == "/api/patterns") return Json(200, PatternsJson(totals->stats.by_pattern));
      if (p == "/api/stats") return Json(200, StatsJson(*totals));
      HttpResponse m;
      m.content_type = "text/plain; version=0.0.4; charset=utf-8";
      m.body = PrometheusText(*totals);
      return m;
    }
    return Error(404, "no such path " + Quote(path));
  }();
  r.headers.emplace_back("Content-Security-Policy", kCsp);
  r.headers.emplace_back("X-Content-Type-Options", "nosniff");
  r.headers.emplace_back("Referrer-Policy", "no-referrer");
  if (r.content_type.rfind("application/json", 0) == 0) r.headers.emplace_back("Cache-Control", "no-store");
  return r;
}

}  // namespace oomguard::server
