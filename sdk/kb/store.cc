// Store (store.h): the SQLite schema, its migrations and the statements the
// knowledge base runs. The JSON forms it stores (incidents, SizeModel) are in
// incident_json.cc.
#include "sdk/kb/store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include "sdk/core/ids.h"

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

}  // namespace

Status Store::Error(int rc, const char* what) const {
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

Status Store::Exec(const char* sql, const char* what) {
  int rc = sqlite3_exec(db_, sql, nullptr, nullptr, nullptr);
  return rc == SQLITE_OK ? Status::Ok() : Error(rc, what);
}

StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& path, int busy_timeout_ms, bool create) {
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
  std::unique_ptr<Store> store(new Store(path, db));
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
  return store;
}

Store::~Store() { sqlite3_close_v2(db_); }

Status Store::ReadVersion(int* version) {
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

Status Store::Migrate() {
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

Status Store::Write(const std::vector<Incident>& incidents, const std::vector<PriorUpdate>& priors,
                    int64_t dropped) {
  if (incidents.empty() && priors.empty() && dropped == 0) return Status::Ok();
  if (read_only_) return Status::FailedPrecondition("knowledge base " + path_ + " is open for reading only");
  OOMGUARD_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "begin write"));
  auto fail = [&](Status s) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    return s;
  };
  if (!incidents.empty()) {
    Stmt ins(db_,
             "INSERT OR REPLACE INTO incidents(id, run_id, time_unix_ms, host, rank, step, phase, kind, workload,"
             " pattern, confidence, fingerprint, outcome, body) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)");
    if (ins.prepare_rc() != SQLITE_OK) return fail(Error(ins.prepare_rc(), "prepare insert"));
    for (const Incident& inc : incidents) {
      sqlite3_reset(ins.get());
      ins.Bind(1, inc.id);
      ins.Bind(2, inc.run_id);
      ins.Bind(3, inc.time_unix_ms);
      ins.Bind(4, inc.host);
      ins.Bind(5, static_cast<int64_t>(inc.rank));
      ins.Bind(6, inc.step);
      ins.Bind(7, PhaseName(inc.phase));
      ins.Bind(8, IncidentKindName(inc.kind));
      ins.Bind(9, inc.workload);
      ins.Bind(10, inc.pattern);
      ins.Bind(11, inc.confidence);
      ins.Bind(12, inc.fingerprint);
      ins.Bind(13, IncidentOutcomeName(inc.outcome));
      ins.Bind(14, IncidentToJson(inc));
      int rc = ins.Step();
      if (rc != SQLITE_DONE) return fail(Error(rc, "insert incident"));
    }
  }
  if (!priors.empty()) {
    Stmt up(db_,
            "INSERT INTO priors(workload, micro_batch, updated_unix_ms) VALUES(?1, ?2, ?3)"
            " ON CONFLICT(workload) DO UPDATE SET micro_batch = excluded.micro_batch,"
            " updated_unix_ms = excluded.updated_unix_ms");
    if (up.prepare_rc() != SQLITE_OK) return fail(Error(up.prepare_rc(), "prepare prior"));
    Stmt raise(db_,
               "UPDATE priors SET micro_batch = ?2, updated_unix_ms = ?3 WHERE workload = ?1 AND micro_batch < ?2");
    if (raise.prepare_rc() != SQLITE_OK) return fail(Error(raise.prepare_rc(), "prepare prior raise"));
    Stmt model(db_,
               "INSERT INTO prior_models(workload, model, updated_unix_ms) VALUES(?1, ?2, ?3)"
               " ON CONFLICT(workload) DO UPDATE SET model = excluded.model,"
               " updated_unix_ms = excluded.updated_unix_ms");
    if (model.prepare_rc() != SQLITE_OK) return fail(Error(model.prepare_rc(), "prepare prior model"));
    for (const PriorUpdate& p : priors) {
      if (p.micro_batch > 0) {
        Stmt& st = p.replace ? up : raise;
        sqlite3_reset(st.get());
        st.Bind(1, p.workload);
        st.Bind(2, p.micro_batch);
        st.Bind(3, internal::NowUnixMs());
        int rc = st.Step();
        if (rc != SQLITE_DONE) return fail(Error(rc, "update prior"));
      }
      if (p.model) {
        sqlite3_reset(model.get());
        model.Bind(1, p.workload);
        model.Bind(2, SizeModelToJson(*p.model));
        model.Bind(3, internal::NowUnixMs());
        int rc = model.Step();
        if (rc != SQLITE_DONE) return fail(Error(rc, "update prior model"));
      }
    }
  }
  if (dropped > 0) {
    Stmt d(db_, "INSERT INTO sink_drops(time_unix_ms, pid, dropped) VALUES(?,?,?)");
    d.Bind(1, internal::NowUnixMs());
    d.Bind(2, static_cast<int64_t>(::getpid()));
    d.Bind(3, dropped);
    int rc = d.Step();
    if (rc != SQLITE_DONE) return fail(Error(rc, "record drops"));
  }
  Status s = Exec("COMMIT", "commit write");
  if (!s.ok()) return fail(s);
  return Status::Ok();
}

StatusOr<std::vector<Incident>> Store::QueryOnce(const IncidentQuery& q) {
  std::string sql = "SELECT body FROM incidents WHERE 1=1";
  if (!q.pattern.empty()) sql += " AND pattern = ?1";
  if (q.rank) sql += " AND rank = ?2";
  if (!q.run_id.empty()) sql += " AND run_id = ?3";
  if (!q.workload.empty()) sql += " AND workload = ?4";
  if (!q.fingerprint.empty()) sql += " AND fingerprint = ?5";
  if (!q.id_prefix.empty()) sql += " AND substr(id, 1, length(?6)) = ?6";
  if (q.since_unix_ms > 0) sql += " AND time_unix_ms >= ?7";
  sql += " ORDER BY time_unix_ms DESC, id";
  if (q.limit > 0) sql += " LIMIT ?8";
  Stmt st(db_, sql.c_str());
  if (st.prepare_rc() != SQLITE_OK) return Error(st.prepare_rc(), "query");
  if (!q.pattern.empty()) st.Bind(1, q.pattern);
  if (q.rank) st.Bind(2, static_cast<int64_t>(*q.rank));
  if (!q.run_id.empty()) st.Bind(3, q.run_id);
  if (!q.workload.empty()) st.Bind(4, q.workload);
  if (!q.fingerprint.empty()) st.Bind(5, q.fingerprint);
  if (!q.id_prefix.empty()) st.Bind(6, q.id_prefix);
  if (q.since_unix_ms > 0) st.Bind(7, q.since_unix_ms);
  if (q.limit > 0) st.Bind(8, q.limit);
  std::vector<Incident> out;
  int rc;
  while ((rc = st.Step()) == SQLITE_ROW) {
    StatusOr<Incident> inc = IncidentFromJson(st.Text(0));
    if (!inc.ok())
      return Status::DataLoss("knowledge base " + path_ + ": a stored incident does not parse: " +
                              inc.status().message());
    out.push_back(std::move(inc).value());
  }
  if (rc != SQLITE_DONE) return Error(rc, "query");
  return out;
}

StatusOr<std::vector<IncidentGroup>> Store::GroupsOnce() {
  Stmt st(db_,
          "SELECT fingerprint, pattern, kind, phase, workload, COUNT(*), COUNT(DISTINCT run_id),"
          " MIN(time_unix_ms), MAX(time_unix_ms),"
          " (SELECT id FROM incidents j WHERE j.fingerprint = i.fingerprint ORDER BY time_unix_ms DESC LIMIT 1)"
          " FROM incidents i GROUP BY fingerprint ORDER BY COUNT(*) DESC, MAX(time_unix_ms) DESC");
  if (st.prepare_rc() != SQLITE_OK) return Error(st.prepare_rc(), "groups");
  std::vector<IncidentGroup> out;
  int rc;
  while ((rc = st.Step()) == SQLITE_ROW) {
    IncidentGroup g;
    g.fingerprint = st.Text(0);
    g.pattern = st.Text(1);
    // The columns hold the names IncidentToJson writes (incident.h).
    g.kind = ParseIncidentKind(st.Text(2)).value_or(IncidentKind::kUnknown);
    g.phase = ParseStoredPhase(st.Text(3)).value_or(Phase::kUnknown);
    g.workload = st.Text(4);
    g.count = st.Int(5);
    g.runs = st.Int(6);
    g.first_seen_unix_ms = st.Int(7);
    g.last_seen_unix_ms = st.Int(8);
    g.last_id = st.Text(9);
    out.push_back(std::move(g));
  }
  if (rc != SQLITE_DONE) return Error(rc, "groups");
  return out;
}

StatusOr<KnowledgeBaseStats> Store::StatsOnce() {
  KnowledgeBaseStats s;
  s.schema_version = version_;
  auto counts = [&](const char* col, std::vector<std::pair<std::string, int64_t>>* out) -> Status {
    std::string sql = std::string("SELECT ") + col + ", COUNT(*) FROM incidents GROUP BY " + col +
                      " ORDER BY COUNT(*) DESC, " + col;
    Stmt st(db_, sql.c_str());
    if (st.prepare_rc() != SQLITE_OK) return Error(st.prepare_rc(), "stats");
    int rc;
    while ((rc = st.Step()) == SQLITE_ROW) out->emplace_back(st.Text(0), st.Int(1));
    return rc == SQLITE_DONE ? Status::Ok() : Error(rc, "stats");
  };
  OOMGUARD_RETURN_IF_ERROR(counts("pattern", &s.by_pattern));
  OOMGUARD_RETURN_IF_ERROR(counts("outcome", &s.by_outcome));
  OOMGUARD_RETURN_IF_ERROR(counts("kind", &s.by_kind));
  for (const auto& [k, n] : s.by_pattern) s.incidents += n;
  if (version_ < 2) return s;  // a reader of a version-1 file: no priors, no drops yet
  {
    Stmt st(db_, "SELECT COALESCE(SUM(dropped), 0) FROM sink_drops");
    if (st.prepare_rc() != SQLITE_OK) return Error(st.prepare_rc(), "stats");
    if (st.Step() == SQLITE_ROW) s.dropped_recorded = st.Int(0);
  }
  // A reader of a version-2 file: sizes, no models yet.
  Stmt st(db_, version_ < 3 ? "SELECT p.workload, p.micro_batch, p.updated_unix_ms, NULL FROM priors p"
                              " ORDER BY p.workload"
                            : "SELECT p.workload, p.micro_batch, p.updated_unix_ms, m.model FROM priors p"
                              " LEFT JOIN prior_models m ON m.workload = p.workload ORDER BY p.workload");
  if (st.prepare_rc() != SQLITE_OK) return Error(st.prepare_rc(), "stats");
  int rc;
  while ((rc = st.Step()) == SQLITE_ROW) {
    MicroBatchPrior p{st.Text(0), st.Int(1), st.Int(2), std::nullopt};
    if (sqlite3_column_type(st.get(), 3) != SQLITE_NULL) p.model = SizeModelFromJson(st.Text(3));
    s.priors.push_back(std::move(p));
  }
  if (rc != SQLITE_DONE) return Error(rc, "stats");
  return s;
}

StatusOr<std::optional<int64_t>> Store::PriorOnce(const std::string& workload) {
  if (version_ < 2) return std::optional<int64_t>();
  Stmt st(db_, "SELECT micro_batch FROM priors WHERE workload = ?");
  if (st.prepare_rc() != SQLITE_OK) return Error(st.prepare_rc(), "read prior");
  st.Bind(1, workload);
  int rc = st.Step();
  if (rc == SQLITE_ROW) return std::optional<int64_t>(st.Int(0));
  if (rc == SQLITE_DONE) return std::optional<int64_t>();
  return Error(rc, "read prior");
}

// Readers go through Reading (store_reader.cc), which rereads when the file
// changed underneath an immutable connection; a writer's store reads once.
StatusOr<std::vector<Incident>> Store::Query(const IncidentQuery& q) {
  std::optional<StatusOr<std::vector<Incident>>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = QueryOnce(q); }));
  return std::move(*r);
}

StatusOr<std::vector<IncidentGroup>> Store::Groups() {
  std::optional<StatusOr<std::vector<IncidentGroup>>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = GroupsOnce(); }));
  return std::move(*r);
}

StatusOr<KnowledgeBaseStats> Store::Stats() {
  std::optional<StatusOr<KnowledgeBaseStats>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = StatsOnce(); }));
  return std::move(*r);
}

StatusOr<std::optional<int64_t>> Store::Prior(const std::string& workload) {
  std::optional<StatusOr<std::optional<int64_t>>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = PriorOnce(workload); }));
  return std::move(*r);
}

StatusOr<std::optional<SizeModel>> Store::PriorModel(const std::string& workload) {
  std::optional<StatusOr<std::optional<SizeModel>>> r;
  OOMGUARD_RETURN_IF_ERROR(Reading([&] { r = PriorModelOnce(workload); }));
  return std::move(*r);
}

StatusOr<std::optional<SizeModel>> Store::PriorModelOnce(const std::string& workload) {
  if (version_ < 3) return std::optional<SizeModel>();
  Stmt st(db_, "SELECT model FROM prior_models WHERE workload = ?");
  if (st.prepare_rc() != SQLITE_OK) return Error(st.prepare_rc(), "read prior model");
  st.Bind(1, workload);
  int rc = st.Step();
  // A model that does not parse (written by a later build, say) is no prior.
  if (rc == SQLITE_ROW) return SizeModelFromJson(st.Text(0));
  if (rc == SQLITE_DONE) return std::optional<SizeModel>();
  return Error(rc, "read prior model");
}

}  // namespace oomguard::kb
