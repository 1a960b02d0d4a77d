// Store (store.h): the statements the knowledge base runs, on either backend,
// and the SQLite backend (its schema, migrations and connection). The JSON
// forms it stores (incidents, SizeModel) are in incident_json.cc; the
// PostgreSQL backend is pg_store.cc.
#include "sdk/kb/store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <map>
#include <thread>

#include "sdk/core/ids.h"
#include "sdk/kb/file_set.h"

namespace oomguard::kb {
namespace {

// Migrations, applied in order inside one IMMEDIATE transaction. Entry i
// brings the schema from version i to i + 1. Never edit a released entry:
// append a new one.
const char* const kMigrations[] = {
    // 0 -> 1: incidents.
    "CREATE TABLE incidents ("
    "  id TEXT PRIMARY KEY,"
    "  run_id TEXT NOT NULL DEFAULT '',"
    "  time_unix_ms INTEGER NOT NULL DEFAULT 0,"
    "  host TEXT NOT NULL DEFAULT '',"
    "  rank INTEGER NOT NULL DEFAULT 0,"
    "  step INTEGER NOT NULL DEFAULT 0,"
    "  phase TEXT NOT NULL DEFAULT '',"
    "  kind TEXT NOT NULL DEFAULT '',"
    "  workload TEXT NOT NULL DEFAULT '',"
    "  pattern TEXT NOT NULL DEFAULT '',"
    "  confidence REAL NOT NULL DEFAULT 0,"
    "  fingerprint TEXT NOT NULL DEFAULT '',"
    "  outcome TEXT NOT NULL DEFAULT '',"
    "  body TEXT NOT NULL);"
    "CREATE INDEX incidents_time ON incidents(time_unix_ms);"
    "CREATE INDEX incidents_fingerprint ON incidents(fingerprint);"
    "CREATE INDEX incidents_pattern ON incidents(pattern);"
    "CREATE INDEX incidents_run ON incidents(run_id);",
    // 1 -> 2: learned priors and the record of dropped incidents.
    "CREATE TABLE priors ("
    "  workload TEXT PRIMARY KEY,"
    "  micro_batch INTEGER NOT NULL,"
    "  updated_unix_ms INTEGER NOT NULL);"
    "CREATE TABLE sink_drops ("
    "  time_unix_ms INTEGER NOT NULL,"
    "  pid INTEGER NOT NULL,"
    "  dropped INTEGER NOT NULL);",
    // 2 -> 3: the predictive controller's model beside the size prior. A
    // table of its own, with the model as JSON, so that older rows need
    // nothing and new fields no migration.
    "CREATE TABLE prior_models ("
    "  workload TEXT PRIMARY KEY,"
    "  model TEXT NOT NULL,"
    "  updated_unix_ms INTEGER NOT NULL);",
    // 3 -> 4: a team's notes on fingerprint groups.
    "CREATE TABLE notes ("
    "  fingerprint TEXT PRIMARY KEY,"
    "  text TEXT NOT NULL,"
    "  author TEXT NOT NULL DEFAULT '',"
    "  updated_unix_ms INTEGER NOT NULL);",
    // 4 -> 5: the browser's queries on the store itself (no full load): the
    // searchable text (kb::SearchText; written with each incident, filled
    // here for older rows) and indexes that let groups, stats, ranks and runs
    // read an index instead of every row.
    "ALTER TABLE incidents ADD COLUMN search TEXT NOT NULL DEFAULT '';"
    "UPDATE incidents SET search = lower(id || char(31) || run_id || char(31) || host || char(31) ||"
    "  COALESCE(json_extract(body, '$.message'), '') || char(31) ||"
    "  COALESCE(json_extract(body, '$.exception_type'), '') || char(31) || pattern || char(31) ||"
    "  workload || char(31) || phase || char(31) || kind || char(31) || outcome || char(31) ||"
    "  fingerprint || char(31) || COALESCE(json_extract(body, '$.evidence'), ''));"
    // The page's order (newest first, ties by id) read straight from an
    // index, alone and under the filters the page offers.
    "CREATE INDEX incidents_newest ON incidents(time_unix_ms DESC, id);"
    "CREATE INDEX incidents_pattern_newest ON incidents(pattern, time_unix_ms DESC, id);"
    "CREATE INDEX incidents_workload_newest ON incidents(workload, time_unix_ms DESC, id);"
    "CREATE INDEX incidents_outcome_newest ON incidents(outcome, time_unix_ms DESC, id);"
    "CREATE INDEX incidents_groups ON incidents(fingerprint, time_unix_ms, run_id, id);"
    "CREATE INDEX incidents_kind ON incidents(kind);"
    "CREATE INDEX incidents_rank ON incidents(rank);"
    "CREATE INDEX incidents_run_hosts ON incidents(run_id, host);"
    // Covers the runs' totals and each run's newest incident (Store::Runs).
    "CREATE INDEX incidents_runs ON incidents(run_id, time_unix_ms DESC, id, step, outcome, workload);",
};
static_assert(sizeof(kMigrations) / sizeof(kMigrations[0]) == kSchemaVersion);

// RAII prepared statement with 1-based binding helpers.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr); }
  ~Stmt() { sqlite3_finalize(s_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  int prepare_rc() const { return rc_; }
  sqlite3_stmt* get() { return s_; }
  void Bind(int i, std::string_view v) { sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT); }
  void Bind(int i, int64_t v) { sqlite3_bind_int64(s_, i, v); }
  void Bind(int i, double v) { sqlite3_bind_double(s_, i, v); }
  int Step() { return sqlite3_step(s_); }
  std::string Text(int col) {
    const unsigned char* t = sqlite3_column_text(s_, col);
    return t == nullptr ? std::string() : std::string(reinterpret_cast<const char*>(t),
                                                      static_cast<size_t>(sqlite3_column_bytes(s_, col)));
  }
  int64_t Int(int col) { return sqlite3_column_int64(s_, col); }

 private:
  sqlite3_stmt* s_ = nullptr;
  int rc_ = SQLITE_OK;
};

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

class SqliteRow final : public Store::Row {
 public:
  explicit SqliteRow(Stmt* st) : st_(st) {}
  std::string Text(int col) const override { return st_->Text(col); }
  int64_t Int(int col) const override { return st_->Int(col); }
  bool Null(int col) const override { return sqlite3_column_type(st_->get(), col) == SQLITE_NULL; }

 private:
  Stmt* st_;
};

constexpr const char* kIncidentColumns =
    "id, run_id, time_unix_ms, host, rank, step, phase, kind, workload, pattern, confidence, fingerprint, outcome, "
    "body, search";

}  // namespace

// ---- the statements, one for both backends ----

Store::~Store() = default;

bool IsServerUrl(std::string_view spec) {
  return spec.substr(0, 13) == "postgresql://" || spec.substr(0, 11) == "postgres://";
}

StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& path, int busy_timeout_ms, bool create,
                                             bool offline_ok) {
  if (IsServerUrl(path)) return OpenPgStore(path, busy_timeout_ms, create, false, offline_ok);
  return SqliteStore::Open(path, busy_timeout_ms, create);
}

StatusOr<std::unique_ptr<Store>> Store::OpenReadOnly(const std::string& path, int busy_timeout_ms) {
  if (IsServerUrl(path)) return OpenPgStore(path, busy_timeout_ms, false, true, false);
  return SqliteStore::OpenReadOnly(path, busy_timeout_ms);
}

Status Store::Write(const std::vector<Incident>& incidents, const std::vector<PriorUpdate>& priors,
                    int64_t dropped) {
  if (incidents.empty() && priors.empty() && dropped == 0) return Status::Ok();
  if (read_only_) return Status::FailedPrecondition("knowledge base " + path_ + " is open for reading only");
  OOMGUARD_RETURN_IF_ERROR(Begin());
  auto fail = [&](Status s) {
    Rollback();
    return s;
  };
  // An upsert by id: a record sent twice (a spool resent after a crash) is
  // one row, and UpdateOutcome replaces the record it completes.
  static const std::string kUpsert =
      std::string("INSERT INTO incidents(") + kIncidentColumns +
      ") VALUES(?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15) ON CONFLICT(id) DO UPDATE SET"
      " run_id = excluded.run_id, time_unix_ms = excluded.time_unix_ms, host = excluded.host,"
      " rank = excluded.rank, step = excluded.step, phase = excluded.phase, kind = excluded.kind,"
      " workload = excluded.workload, pattern = excluded.pattern, confidence = excluded.confidence,"
      " fingerprint = excluded.fingerprint, outcome = excluded.outcome, body = excluded.body,"
      " search = excluded.search";
  for (const Incident& inc : incidents) {
    Status s = Run(kUpsert,
                   {inc.id, inc.run_id, inc.time_unix_ms, inc.host, static_cast<int64_t>(inc.rank), inc.step,
                    std::string(PhaseName(inc.phase)), std::string(IncidentKindName(inc.kind)), inc.workload,
                    inc.pattern, inc.confidence, inc.fingerprint, std::string(IncidentOutcomeName(inc.outcome)),
                    IncidentToJson(inc), SearchText(inc)},
                   nullptr, "insert incident");
    if (!s.ok()) return fail(s);
  }
  for (const PriorUpdate& p : priors) {
    // Applied only over what was learned no later (PriorUpdate.learned_unix_ms).
    // updated_unix_ms is the time of the newest limit (a replace: an OOM met
    // it); a raise (a clean session) keeps the larger size and leaves that
    // time alone, so raises commute (the largest wins in any order, as when
    // several jobs flush at once) while a raise learned before the newest
    // limit never undoes it.
    const int64_t learned = p.learned_unix_ms > 0 ? p.learned_unix_ms : internal::NowUnixMs();
    if (p.micro_batch > 0) {
      const char* sql = p.replace ? "INSERT INTO priors(workload, micro_batch, updated_unix_ms) VALUES(?1, ?2, ?3)"
                                    " ON CONFLICT(workload) DO UPDATE SET micro_batch = excluded.micro_batch,"
                                    " updated_unix_ms = excluded.updated_unix_ms"
                                    " WHERE priors.updated_unix_ms <= excluded.updated_unix_ms"
                                  : "UPDATE priors SET micro_batch = ?2"
                                    " WHERE workload = ?1 AND micro_batch < ?2 AND updated_unix_ms <= ?3";
      Status s = Run(sql, {p.workload, p.micro_batch, learned}, nullptr, "update prior");
      if (!s.ok()) return fail(s);
    }
    if (p.model) {
      Status s = Run("INSERT INTO prior_models(workload, model, updated_unix_ms) VALUES(?1, ?2, ?3)"
                     " ON CONFLICT(workload) DO UPDATE SET model = excluded.model,"
                     " updated_unix_ms = excluded.updated_unix_ms"
                     " WHERE prior_models.updated_unix_ms <= excluded.updated_unix_ms",
                     {p.workload, SizeModelToJson(*p.model), learned}, nullptr, "update prior model");
      if (!s.ok()) return fail(s);
    }
  }
  if (dropped > 0) {
    Status s = Run("INSERT INTO sink_drops(time_unix_ms, pid, dropped) VALUES(?1, ?2, ?3)",
                   {internal::NowUnixMs(), static_cast<int64_t>(::getpid()), dropped}, nullptr, "record drops");
    if (!s.ok()) return fail(s);
  }
  Status s = Commit();
  if (!s.ok()) return fail(s);
  return Status::Ok();
}

namespace {

// The WHERE clause of a query and its parameters (?1...).
// A LIKE pattern matching `text` anywhere (ESCAPE '\\').
std::string LikeAnywhere(std::string_view text) {
  std::string out = "%";
  for (char c : text) {
    if (c == '%' || c == '_' || c == '\\') out += '\\';
    out += c;
  }
  return out + "%";
}

// The WHERE clause of a query and its parameters (?1...). A store of schema
// 4 or older (read, never migrated, by a reader) has no search column: its
// text search reads the record itself (slower, and it also finds the
// fields' names).
std::string Where(const IncidentQuery& q, std::vector<std::variant<std::string, int64_t, double>>* params,
                  int version) {
  std::string sql = " WHERE 1=1";
  auto add = [&](const char* cond, auto value) {
    params->push_back(value);
    const std::string n = "?" + std::to_string(params->size());
    std::string c = cond;
    for (size_t at; (at = c.find('@')) != std::string::npos;) c.replace(at, 1, n);
    sql += c;
  };
  if (!q.pattern.empty()) add(" AND pattern = @", q.pattern);
  if (q.rank) add(" AND rank = @", static_cast<int64_t>(*q.rank));
  if (!q.run_id.empty()) add(" AND run_id = @", q.run_id);
  if (!q.workload.empty()) add(" AND workload = @", q.workload);
  if (!q.fingerprint.empty()) add(" AND fingerprint = @", q.fingerprint);
  if (!q.id_prefix.empty()) add(" AND substr(id, 1, length(@)) = @", q.id_prefix);
  if (!q.id.empty()) add(" AND id = @", q.id);
  if (!q.outcome.empty()) add(" AND outcome = @", q.outcome);
  if (q.since_unix_ms > 0) add(" AND time_unix_ms >= @", q.since_unix_ms);
  if (!q.text.empty())
    add(version >= 5 ? " AND search LIKE @ ESCAPE '\\'" : " AND lower(body) LIKE @ ESCAPE '\\'",
        LikeAnywhere(LowerAscii(q.text)));
  return sql;
}

}  // namespace

StatusOr<std::vector<Incident>> Store::QueryOnce(const IncidentQuery& q) {
  std::vector<Param> params;
  std::string sql = "SELECT body FROM incidents" + Where(q, &params, version_) + " ORDER BY time_unix_ms DESC, id";
  if (q.limit > 0 || q.offset > 0) {
    // SQLite needs a LIMIT before an OFFSET; -1 is none there, and NULL is none in PostgreSQL.
    params.push_back(q.limit > 0 ? q.limit : int64_t{1} << 62);
    sql += " LIMIT ?" + std::to_string(params.size());
  }
  if (q.offset > 0) {
    params.push_back(q.offset);
    sql += " OFFSET ?" + std::to_string(params.size());
  }
  std::vector<Incident> out;
  Status bad;
  OOMGUARD_RETURN_IF_ERROR(Run(sql, params, [&](const Row& r) {
    if (!bad.ok()) return;
    StatusOr<Incident> inc = IncidentFromJson(r.Text(0));
    if (!inc.ok()) {
      bad = Status::DataLoss("knowledge base " + path_ + ": a stored incident does not parse: " +
                             inc.status().message());
      return;
    }
    out.push_back(std::move(inc).value());
  }, "query"));
  if (!bad.ok()) return bad;
  return out;
}

StatusOr<int64_t> Store::Count(const IncidentQuery& q) {
  std::vector<Param> params;
  const std::string sql = "SELECT COUNT(*) FROM incidents" + Where(q, &params, version_);
  int64_t n = 0;
  Status s;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { s = Run(sql, params, [&](const Row& r) { n = r.Int(0); }, "count"); }));
  OOMGUARD_RETURN_IF_ERROR(s);
  return n;
}

StatusOr<std::vector<IncidentGroup>> Store::GroupsOnce(const IncidentQuery& q) {
  // Counted from the (fingerprint, time, run, id) index alone; the group's
  // pattern, kind, phase and workload (one value per group: the fingerprint
  // hashes them) come from its newest incident. The filters apply to both
  // parts (the same ?N in the subquery, where they name j's columns).
  std::vector<Param> params;
  const std::string where = Where(q, &params, version_);
  std::vector<IncidentGroup> out;
  OOMGUARD_RETURN_IF_ERROR(Run(
      "SELECT g.fingerprint, x.pattern, x.kind, x.phase, x.workload, g.n, g.runs, g.first_ms, g.last_ms, x.id"
      " FROM (SELECT fingerprint, COUNT(*) AS n, COUNT(DISTINCT run_id) AS runs, MIN(time_unix_ms) AS first_ms,"
      " MAX(time_unix_ms) AS last_ms FROM incidents" + where + " GROUP BY fingerprint) g"
      " JOIN incidents x ON x.id = (SELECT j.id FROM incidents j" + where +
      " AND j.fingerprint = g.fingerprint ORDER BY j.time_unix_ms DESC, j.id LIMIT 1)"
      " ORDER BY g.n DESC, g.last_ms DESC, g.fingerprint",
      params, [&](const Row& r) {
        IncidentGroup g;
        g.fingerprint = r.Text(0);
        g.pattern = r.Text(1);
        // The columns hold the names IncidentToJson writes (incident.h).
        g.kind = ParseIncidentKind(r.Text(2)).value_or(IncidentKind::kUnknown);
        g.phase = ParseStoredPhase(r.Text(3)).value_or(Phase::kUnknown);
        g.workload = r.Text(4);
        g.count = r.Int(5);
        g.runs = r.Int(6);
        g.first_seen_unix_ms = r.Int(7);
        g.last_seen_unix_ms = r.Int(8);
        g.last_id = r.Text(9);
        out.push_back(std::move(g));
      },
      "groups"));
  return out;
}

StatusOr<std::vector<std::pair<std::string, std::string>>> Store::GroupRuns(const IncidentQuery& q) {
  std::vector<Param> params;
  const std::string sql = "SELECT DISTINCT fingerprint, run_id FROM incidents" + Where(q, &params, version_);
  std::vector<std::pair<std::string, std::string>> out;
  Status s;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] {
    out.clear();
    s = Run(sql, params, [&](const Row& r) { out.emplace_back(r.Text(0), r.Text(1)); }, "group runs");
  }));
  OOMGUARD_RETURN_IF_ERROR(s);
  return out;
}

StatusOr<std::vector<std::pair<int, int64_t>>> Store::RankCounts() {
  std::vector<std::pair<int, int64_t>> out;
  Status s;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] {
    out.clear();
    s = Run("SELECT rank, COUNT(*) FROM incidents GROUP BY rank ORDER BY rank", {},
            [&](const Row& r) { out.emplace_back(static_cast<int>(r.Int(0)), r.Int(1)); }, "ranks");
  }));
  OOMGUARD_RETURN_IF_ERROR(s);
  return out;
}

StatusOr<std::vector<RunSummary>> Store::RunsOnce() {
  std::vector<RunSummary> out;
  std::map<std::string, size_t> at;
  OOMGUARD_RETURN_IF_ERROR(Run(
      // The workload of each run's newest incident (ties: the smallest id, the store's order).
      "SELECT run_id, COUNT(*), SUM(CASE WHEN outcome = 'failed' THEN 1 ELSE 0 END), MIN(time_unix_ms),"
      " MAX(time_unix_ms), MIN(step), MAX(step), (SELECT j.workload FROM incidents j WHERE j.run_id = i.run_id"
      " ORDER BY j.time_unix_ms DESC, j.id LIMIT 1) FROM incidents i WHERE run_id <> '' GROUP BY run_id",
      {}, [&](const Row& r) {
        RunSummary run;
        run.run_id = r.Text(0);
        run.incidents = r.Int(1);
        run.failed = r.Int(2);
        run.first_unix_ms = r.Int(3);
        run.last_unix_ms = r.Int(4);
        run.first_step = r.Int(5);
        run.last_step = r.Int(6);
        run.workload = r.Text(7);
        at[run.run_id] = out.size();
        out.push_back(std::move(run));
      },
      "runs"));
  // Each run's hosts (the (run_id, host) index).
  OOMGUARD_RETURN_IF_ERROR(Run(
      "SELECT DISTINCT run_id, host FROM incidents WHERE run_id <> '' ORDER BY run_id, host", {},
      [&](const Row& r) {
        if (auto it = at.find(r.Text(0)); it != at.end()) out[it->second].hosts.push_back(r.Text(1));
      },
      "runs"));
  return out;
}

StatusOr<KnowledgeBaseStats> Store::StatsOnce() {
  KnowledgeBaseStats s;
  s.schema_version = version_;
  auto counts = [&](const char* col, std::vector<std::pair<std::string, int64_t>>* out) -> Status {
    std::string sql = std::string("SELECT ") + col + ", COUNT(*) FROM incidents GROUP BY " + col +
                      " ORDER BY COUNT(*) DESC, " + col;
    return Run(sql, {}, [&](const Row& r) { out->emplace_back(r.Text(0), r.Int(1)); }, "stats");
  };
  OOMGUARD_RETURN_IF_ERROR(counts("pattern", &s.by_pattern));
  OOMGUARD_RETURN_IF_ERROR(counts("outcome", &s.by_outcome));
  OOMGUARD_RETURN_IF_ERROR(counts("kind", &s.by_kind));
  for (const auto& [k, n] : s.by_pattern) s.incidents += n;
  if (version_ < 2) return s;  // a reader of a version-1 file: no priors, no drops yet
  OOMGUARD_RETURN_IF_ERROR(Run("SELECT COALESCE(SUM(dropped), 0) FROM sink_drops", {},
                               [&](const Row& r) { s.dropped_recorded = r.Int(0); }, "stats"));
  // A reader of a version-2 file: sizes, no models yet.
  OOMGUARD_RETURN_IF_ERROR(Run(
      version_ < 3 ? "SELECT p.workload, p.micro_batch, p.updated_unix_ms, NULL FROM priors p ORDER BY p.workload"
                   : "SELECT p.workload, p.micro_batch, p.updated_unix_ms, m.model FROM priors p"
                     " LEFT JOIN prior_models m ON m.workload = p.workload ORDER BY p.workload",
      {}, [&](const Row& r) {
        MicroBatchPrior p{r.Text(0), r.Int(1), r.Int(2), std::nullopt};
        if (!r.Null(3)) p.model = SizeModelFromJson(r.Text(3));
        s.priors.push_back(std::move(p));
      },
      "stats"));
  return s;
}

// Readers go through Reading (the SQLite reader rereads when the file
// changed underneath an immutable connection); other stores read once.
StatusOr<std::vector<Incident>> Store::Query(const IncidentQuery& q) {
  std::optional<StatusOr<std::vector<Incident>>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = QueryOnce(q); }));
  return std::move(*r);
}

StatusOr<std::vector<IncidentGroup>> Store::Groups(const IncidentQuery& filters) {
  std::optional<StatusOr<std::vector<IncidentGroup>>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = GroupsOnce(filters); }));
  return std::move(*r);
}

StatusOr<std::vector<RunSummary>> Store::Runs() {
  std::optional<StatusOr<std::vector<RunSummary>>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = RunsOnce(); }));
  return std::move(*r);
}

StatusOr<KnowledgeBaseStats> Store::Stats() {
  std::optional<StatusOr<KnowledgeBaseStats>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = StatsOnce(); }));
  return std::move(*r);
}

StatusOr<std::optional<int64_t>> Store::Prior(const std::string& workload) {
  std::optional<int64_t> out;
  if (version_ < 2) return out;
  Status s;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] {
    out.reset();
    s = Run("SELECT micro_batch FROM priors WHERE workload = ?1", {workload},
            [&](const Row& r) { out = r.Int(0); }, "read prior");
  }));
  OOMGUARD_RETURN_IF_ERROR(s);
  return out;
}

StatusOr<std::optional<SizeModel>> Store::PriorModel(const std::string& workload) {
  std::optional<SizeModel> out;
  if (version_ < 3) return out;
  Status s;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] {
    out.reset();
    // A model that does not parse (written by a later build, say) is no prior.
    s = Run("SELECT model FROM prior_models WHERE workload = ?1", {workload},
            [&](const Row& r) { out = SizeModelFromJson(r.Text(0)); }, "read prior model");
  }));
  OOMGUARD_RETURN_IF_ERROR(s);
  return out;
}

Status Store::SetNote(const GroupNote& note) {
  if (read_only_) return Status::FailedPrecondition("knowledge base " + path_ + " is open for reading only");
  if (note.fingerprint.empty()) return Status::InvalidArgument("a note needs the fingerprint of its group");
  if (note.text.size() > 4096) return Status::InvalidArgument("a note is at most 4096 bytes");
  if (version_ < 4) return Status::FailedPrecondition("knowledge base " + path_ + " has no notes (schema " +
                                                      std::to_string(version_) + "); open it once to migrate");
  if (note.text.empty())
    return Run("DELETE FROM notes WHERE fingerprint = ?1", {note.fingerprint}, nullptr, "remove note");
  return Run("INSERT INTO notes(fingerprint, text, author, updated_unix_ms) VALUES(?1, ?2, ?3, ?4)"
             " ON CONFLICT(fingerprint) DO UPDATE SET text = excluded.text, author = excluded.author,"
             " updated_unix_ms = excluded.updated_unix_ms",
             {note.fingerprint, note.text, note.author,
              note.updated_unix_ms > 0 ? note.updated_unix_ms : internal::NowUnixMs()},
             nullptr, "write note");
}

StatusOr<std::vector<GroupNote>> Store::Notes() {
  std::vector<GroupNote> out;
  if (version_ < 4) return out;
  Status s;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] {
    out.clear();
    s = Run("SELECT fingerprint, text, author, updated_unix_ms FROM notes ORDER BY fingerprint", {},
            [&](const Row& r) { out.push_back({r.Text(0), r.Text(1), r.Text(2), r.Int(3)}); }, "read notes");
  }));
  OOMGUARD_RETURN_IF_ERROR(s);
  return out;
}

// ---- SQLite ----

Status SqliteStore::Run(const std::string& sql, const std::vector<Param>& params,
                        const std::function<void(const Row&)>& on_row, const char* what) {
  Stmt st(db_, sql.c_str());
  if (st.prepare_rc() != SQLITE_OK) return Error(st.prepare_rc(), what);
  for (size_t i = 0; i < params.size(); ++i) {
    const int at = static_cast<int>(i + 1);
    std::visit([&](const auto& v) { st.Bind(at, v); }, params[i]);
  }
  SqliteRow row(&st);
  int rc;
  while ((rc = st.Step()) == SQLITE_ROW)
    if (on_row) on_row(row);
  return rc == SQLITE_DONE ? Status::Ok() : Error(rc, what);
}

Status SqliteStore::Begin() { return Exec("BEGIN IMMEDIATE", "begin write"); }

void SqliteStore::Rollback() { sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr); }

Status SqliteStore::Error(int rc, const char* what) const {
  std::string msg = "knowledge base " + path_ + ": " + what + ": " +
                    (db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(rc));
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return Status::Unavailable(msg + " (another process holds the lock; retry later)");
    case SQLITE_NOTADB:
    case SQLITE_CORRUPT:
      return Status::DataLoss(msg + " (the file is not an intact oomguard knowledge base)");
    case SQLITE_CANTOPEN:
    case SQLITE_PERM:
    case SQLITE_READONLY:
      return Status::FailedPrecondition(msg);
    case SQLITE_FULL:
    case SQLITE_IOERR:
      return Status::Unavailable(msg);
    default:
      return Status::Internal(msg);
  }
}

Status SqliteStore::Exec(const char* sql, const char* what) {
  int rc = sqlite3_exec(db_, sql, nullptr, nullptr, nullptr);
  return rc == SQLITE_OK ? Status::Ok() : Error(rc, what);
}

StatusOr<std::unique_ptr<Store>> SqliteStore::Open(const std::string& path, int busy_timeout_ms, bool create) {
  if (path.empty()) return Status::InvalidArgument("knowledge base path is empty");
  if (busy_timeout_ms < 0) return Status::InvalidArgument("KnowledgeBaseOptions.busy_timeout_ms must be >= 0");
  if (!create && !FileExists(path))
    return Status::NotFound("knowledge base " + path + ": no such file");
  // -wal/-shm files this user cannot write (left by another user's process)
  // would let the open succeed and then fail every write: say so now.
  for (const char* suffix : {"-wal", "-shm"}) {
    const std::string companion = path + suffix;
    // Another process closing the last connection removes them: a companion
    // gone between the two calls (ENOENT) is no obstacle.
    if (FileExists(companion) && ::access(companion.c_str(), W_OK) != 0 && errno != ENOENT)
      return Status::FailedPrecondition("knowledge base " + path + ": " + companion +
                                        " is not writable by this user (another user's process left it?); "
                                        "writes would fail. Remove it when no process has the file open, or "
                                        "write as the user who owns it");
  }
  sqlite3* db = nullptr;
  int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX | (create ? SQLITE_OPEN_CREATE : 0);
  int rc = sqlite3_open_v2(path.c_str(), &db, flags, nullptr);
  std::unique_ptr<SqliteStore> store(new SqliteStore(path, db));
  if (rc != SQLITE_OK) return store->Error(rc, "open");
  sqlite3_busy_timeout(db, busy_timeout_ms);
  sqlite3_extended_result_codes(db, 1);
  // SQLite opens a file it may not write read-only without a word.
  if (sqlite3_db_readonly(db, "main") == 1)
    return Status::FailedPrecondition("knowledge base " + path +
                                      " is read-only for this user: recording incidents needs write access "
                                      "(reading it, e.g. `oomguard kb list`, does not)");
  // Someone else's database gets no tables of ours, and is not switched to WAL.
  int version = 0;
  OOMGUARD_RETURN_IF_ERROR(store->ReadVersion(&version));
  (void)version;  // migrated below, after the switch to WAL

  // Switching to WAL needs a brief exclusive lock; SQLite does not always run
  // the busy handler for it, so retry within the busy timeout ourselves.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(busy_timeout_ms);
  for (;;) {
    rc = sqlite3_exec(db, "PRAGMA journal_mode=WAL", nullptr, nullptr, nullptr);
    if ((rc & 0xff) != SQLITE_BUSY || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (rc != SQLITE_OK) return store->Error(rc, "enable WAL");
  // NORMAL is durable across application crashes in WAL mode; only a power
  // loss may lose the last transactions, which is acceptable for incidents.
  OOMGUARD_RETURN_IF_ERROR(store->Exec("PRAGMA synchronous=NORMAL", "set synchronous"));
  OOMGUARD_RETURN_IF_ERROR(store->Migrate());
  return std::unique_ptr<Store>(std::move(store));
}

SqliteStore::~SqliteStore() { sqlite3_close_v2(db_); }

Status SqliteStore::ReadVersion(int* version) {
  *version = 0;
  Stmt has(db_, "SELECT 1 FROM sqlite_master WHERE type='table' AND name='schema_version'");
  if (has.prepare_rc() != SQLITE_OK) return Error(has.prepare_rc(), "read schema");
  int rc = has.Step();
  if (rc == SQLITE_DONE) {
    // No schema_version: a new file, or someone else's database.
    Stmt other(db_, "SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' LIMIT 3");
    if (other.prepare_rc() != SQLITE_OK) return Error(other.prepare_rc(), "read schema");
    std::string tables;
    while ((rc = other.Step()) == SQLITE_ROW) tables += (tables.empty() ? "" : ", ") + other.Text(0);
    if (rc != SQLITE_DONE) return Error(rc, "read schema");
    if (!tables.empty())
      return Status::FailedPrecondition("knowledge base " + path_ +
                                        " is an SQLite database but not an oomguard knowledge base (it holds "
                                        "tables such as " +
                                        tables + " and no schema_version); it is left as it is");
    return Status::Ok();
  }
  if (rc != SQLITE_ROW) return Error(rc, "read schema");
  Stmt v(db_, "SELECT version FROM schema_version");
  if (v.prepare_rc() != SQLITE_OK) return Error(v.prepare_rc(), "read schema version");
  rc = v.Step();
  if (rc == SQLITE_ROW)
    *version = static_cast<int>(v.Int(0));
  else if (rc != SQLITE_DONE)
    return Error(rc, "read schema version");
  if (*version > kSchemaVersion)
    return Status::FailedPrecondition("knowledge base " + path_ + ": schema version " +
                                      std::to_string(*version) +
                                      " is newer than this oomguard understands (" +
                                      std::to_string(kSchemaVersion) + "); upgrade oomguard");
  return Status::Ok();
}

Status SqliteStore::Migrate() {
  auto read_version = [&](int* version) { return ReadVersion(version); };
  int version = 0;
  // Read first without a write lock: an up-to-date file (the common case, and
  // read-only files) needs no transaction.
  OOMGUARD_RETURN_IF_ERROR(read_version(&version));
  if (version == kSchemaVersion) return Status::Ok();

  OOMGUARD_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "begin migration"));
  auto fail = [&](Status s) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    return s;
  };
  // Another process may have migrated while we waited for the lock.
  Status s = read_version(&version);
  if (!s.ok()) return fail(s);
  if (version == 0) {
    s = Exec("CREATE TABLE IF NOT EXISTS schema_version(version INTEGER NOT NULL);"
             "DELETE FROM schema_version; INSERT INTO schema_version VALUES(0);",
             "create schema_version");
    if (!s.ok()) return fail(s);
  }
  for (int v = version; v < kSchemaVersion; ++v) {
    s = Exec(kMigrations[v], "migrate schema");
    if (!s.ok()) return fail(s);
  }
  std::string set = "UPDATE schema_version SET version=" + std::to_string(kSchemaVersion);
  s = Exec(set.c_str(), "record schema version");
  if (!s.ok()) return fail(s);
  s = Exec("COMMIT", "commit migration");
  if (!s.ok()) return fail(s);
  return Status::Ok();
}

}  // namespace oomguard::kb
