// BrowserData: what the browser's API reads, behind one interface with two
// sources.
//
// - StoreData: the knowledge bases themselves (SQLite files, PostgreSQL
//   servers), one SQL query per request: filters, paging, counts, groups,
//   runs and totals are answered by the store (kb::KnowledgeBaseSet), so
//   `kb serve` starts without reading every incident and 100,000 incidents
//   page as fast as 100 (bench/RESULTS.md). Totals, runs and the unfiltered
//   groups are kept until the stores change (their change stamp, looked at
//   at most every poll interval).
// - IndexData: an in-memory IncidentIndex (the self-contained HTML report,
//   which embeds everything, and tests).
//
// Several stores (--db repeated, a glob): every view is their merge. Pages
// are merged newest first (each store gives its first offset + limit rows,
// so a deep page costs its depth in every store), counts and totals add
// up, groups and runs are merged exactly (a run spanning two stores is one
// run), notes merge with the newest winning. An incident id held by two
// stores is listed twice (as the stores hold it); /api/incidents/<id> shows
// the newest copy.
//
// Thread-safety: StoreData serialises its calls (one mutex; the HTTP server
// runs one thread anyway). IndexData is immutable.
#ifndef OOMGUARD_SDK_SERVER_BROWSER_DATA_H_
#define OOMGUARD_SDK_SERVER_BROWSER_DATA_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "oomguard/status.h"
#include "sdk/kb/file_set.h"
#include "sdk/kb/store.h"
#include "sdk/server/incident_index.h"

namespace oomguard::server {

// The totals of /api/stats and /metrics.
struct BrowserTotals {
  kb::FileSetStats stats;
  std::vector<std::pair<int, int64_t>> by_rank;  // ascending rank
  int64_t runs = 0;
  int64_t groups = 0;
  int64_t last_incident_unix_ms = 0;  // 0: none
  // The newest incident whose recovery finished (recovered or rolled back).
  std::optional<Incident> last_recovered;
  int64_t loaded_unix_ms = 0;  // when these totals were read
};

class BrowserData {
 public:
  struct Page {
    int64_t total = 0;            // every match, not only this page
    std::vector<Incident> items;  // newest first
  };
  virtual ~BrowserData() = default;

  // The incidents passing `q`'s filters (and text), paged by q.offset and
  // q.limit (limit > 0).
  virtual StatusOr<Page> List(const IncidentQuery& q) = 0;
  virtual StatusOr<std::optional<Incident>> Find(const std::string& id) = 0;
  // The run's incidents by step (then time); empty when the run is unknown.
  virtual StatusOr<std::vector<Incident>> Run(const std::string& run_id) = 0;
  virtual StatusOr<std::vector<RunSummary>> Runs() = 0;  // newest activity first
  virtual StatusOr<std::vector<IncidentGroup>> Groups(const IncidentQuery& filters) = 0;
  virtual StatusOr<BrowserTotals> Totals() = 0;
  virtual StatusOr<std::map<std::string, GroupNote>> Notes() = 0;
  // The incidents the "similar" view compares `target` with.
  virtual StatusOr<std::vector<Incident>> SimilarPool(const Incident& target) = 0;
};

class IndexData final : public BrowserData {
 public:
  using SnapshotFn = std::function<std::shared_ptr<const IncidentIndex>()>;
  explicit IndexData(SnapshotFn snapshot) : snapshot_(std::move(snapshot)) {}

  StatusOr<Page> List(const IncidentQuery& q) override;
  StatusOr<std::optional<Incident>> Find(const std::string& id) override;
  StatusOr<std::vector<Incident>> Run(const std::string& run_id) override;
  StatusOr<std::vector<RunSummary>> Runs() override;
  StatusOr<std::vector<IncidentGroup>> Groups(const IncidentQuery& filters) override;
  StatusOr<BrowserTotals> Totals() override;
  StatusOr<std::map<std::string, GroupNote>> Notes() override;
  StatusOr<std::vector<Incident>> SimilarPool(const Incident& target) override;

 private:
  SnapshotFn snapshot_;
};

class StoreData final : public BrowserData {
 public:
  // How many incidents SimilarPool reads: the newest of the target's
  // pattern and the newest overall (text-alike cases of other patterns).
  static constexpr int64_t kSimilarPool = 2000;

  // Opens the stores named by --db specs (globs allowed) for reading only;
  // an error here is the caller's to report. poll_ms: how often, at most,
  // to ask the stores whether they changed (the cached totals, runs and
  // groups are dropped when they did); <= 0: on every request.
  static StatusOr<std::unique_ptr<StoreData>> Open(const std::vector<std::string>& specs, int poll_ms);

  StatusOr<Page> List(const IncidentQuery& q) override;
  StatusOr<std::optional<Incident>> Find(const std::string& id) override;
  StatusOr<std::vector<Incident>> Run(const std::string& run_id) override;
  StatusOr<std::vector<RunSummary>> Runs() override;
  StatusOr<std::vector<IncidentGroup>> Groups(const IncidentQuery& filters) override;
  StatusOr<BrowserTotals> Totals() override;
  StatusOr<std::map<std::string, GroupNote>> Notes() override;
  StatusOr<std::vector<Incident>> SimilarPool(const Incident& target) override;

  // The specs as expanded (globs resolved; servers' URLs with their passwords).
  const std::vector<std::string>& specs() const { return specs_; }
  // What each store is called in messages (no passwords).
  const std::vector<std::string>& names() const { return names_; }

 private:
  StoreData(std::vector<std::string> specs, std::vector<std::string> names, int poll_ms)
      : specs_(std::move(specs)), names_(std::move(names)), poll_ms_(poll_ms) {}
  // Runs `read` on the open stores (opened again when needed), after
  // dropping the caches if the stores changed. SQLite files are closed again
  // after each call: a reader holding a connection would keep a writer that
  // closes from removing its -wal, and a file replaced by `mv new.db kb.db`
  // must be opened again; servers stay connected.
  Status With(const std::function<Status(kb::KnowledgeBaseSet&)>& read);

  const std::vector<std::string> specs_;
  const std::vector<std::string> names_;
  const int poll_ms_;
  std::mutex mu_;  // guards everything below
  std::optional<kb::KnowledgeBaseSet> set_;
  bool any_file_ = false;
  std::string stamp_;
  std::chrono::steady_clock::time_point stamp_checked_{};
  std::optional<BrowserTotals> totals_;
  std::optional<std::vector<RunSummary>> runs_;
  std::optional<std::vector<IncidentGroup>> groups_;  // unfiltered
};

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_BROWSER_DATA_H_
