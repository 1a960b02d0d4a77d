// BrowserApi: everything the knowledge-base browser answers, as a function
// from (method, target) to a response. No sockets here: HttpServer feeds it
// requests, tests and the benchmark call it directly.
//
//   GET /                      the page (assets/index.html); /app.js, /app.css
//   GET /api/incidents         ?pattern=&rank=&run=&since=&workload=&fingerprint=&q=&offset=&limit=
//                              -> {"total":N,"offset":O,"limit":L,"items":[incident...]}
//   GET /api/incidents/{id}    one incident (the JSON exchange record)
//   GET /api/runs              runs with their incident counts
//   GET /api/runs/{run}        the run's incidents by step (micro-batch timeline)
//   GET /api/groups            incidents grouped by fingerprint (?pattern=&rank=&run=&since=)
//   GET /api/patterns          the pattern catalogue with each pattern's count
//   GET /api/stats             totals by pattern, kind, outcome and rank; files; priors
//   GET /metrics               Prometheus text format
//
// Errors are JSON {"error": "...", "status": N}: 400 names the bad parameter,
// 404 an unknown id or path, 405 a method other than GET/HEAD, 414 a target
// over the limit. Every response carries a Content-Security-Policy that
// allows only the page's own script and style, and nosniff.
//
// Every view is read from a BrowserData (browser_data.h): `kb serve` asks
// the stores (SQL per request), the report and tests an in-memory index.
// A store that does not answer is a 503 naming it.
//
// Thread-safety: Handle may be called from several threads at once (the
// BrowserData serialises what it must).
#ifndef OOMGUARD_SDK_SERVER_BROWSER_API_H_
#define OOMGUARD_SDK_SERVER_BROWSER_API_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "sdk/server/browser_data.h"
#include "sdk/server/incident_index.h"

namespace oomguard::server {

struct HttpResponse {
  int status = 200;
  std::string content_type;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // besides Content-Type and Content-Length
};

struct ApiLimits {
  size_t max_target_bytes = 4096;  // whole request target, before decoding
  size_t max_params = 32;
  size_t max_param_bytes = 256;  // one decoded value
  size_t max_page = 1000;        // largest `limit` of /api/incidents
};

class BrowserApi {
 public:
  // Answers from `data` (StoreData: SQL per request; IndexData: memory).
  explicit BrowserApi(std::shared_ptr<BrowserData> data, ApiLimits limits = {});
  // Answers from in-memory snapshots (IndexData over `snapshot`).
  using SnapshotFn = std::function<std::shared_ptr<const IncidentIndex>()>;
  explicit BrowserApi(SnapshotFn snapshot, ApiLimits limits = {});

  // `method` as sent ("GET"); `target` the request target ("/api/incidents?q=x").
  // HEAD gets GET's status and headers; the caller drops the body.
  // `authorization`: the Authorization header, for the one write (notes).
  HttpResponse Handle(std::string_view method, std::string_view target,
                      std::string_view authorization = {}) const;

  // Lets POST /api/notes/<fingerprint>?text=...&author=... write a group's
  // note through `write` when the request carries "Authorization: Bearer
  // <token>" (token: at least 16 characters). Without this call every POST
  // is a 403: reading needs no token, writing does. A token in a header
  // also keeps other sites' pages out: a cross-origin request with it needs
  // a CORS preflight this server never grants.
  using NoteWriter = std::function<Status(const GroupNote&)>;
  void EnableNoteWrites(std::string token, NoteWriter write);

 private:
  std::shared_ptr<BrowserData> data_;
  ApiLimits limits_;
  std::string token_;
  NoteWriter write_note_;
};

// The JSON documents of the API, shared with the HTML report (which embeds
// them so the page can run without a server).
std::string StatsJson(const BrowserTotals& totals);
std::string PatternsJson(const std::vector<std::pair<std::string, int64_t>>& by_pattern);
std::string GroupsJson(const std::vector<IncidentGroup>& groups);
std::string RunsJson(const std::vector<RunSummary>& runs);
// The run's incidents (by step); "" when there are none (an unknown run).
std::string RunJson(std::string_view run_id, const std::vector<Incident>& members);

// Decodes %XX and '+' of a query-string component; false on a bad escape.
bool PercentDecode(std::string_view in, std::string* out);

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_BROWSER_API_H_
