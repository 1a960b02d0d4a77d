// The PostgreSQL backend of Store (store.h), through libpq: the connection,
// the schema's DDL and migrations in PostgreSQL's dialect, and the mapping of
// its errors. The statements themselves are Store's, shared with SQLite.
//
// The URL is libpq's (postgresql://user:password@host:port/db?sslmode=...,
// or ?host=/socket/dir): TLS and every other connection parameter pass
// through it. The password never leaves this file: path() is the URL with
// the password replaced, and libpq's messages are scrubbed of it.
//
// A connection that breaks (the server restarted) is reopened on the next
// transaction or read; the failed operation reports kUnavailable, which the
// knowledge base's writer answers by spooling (knowledge_base.cc).
#include <libpq-fe.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "sdk/kb/store.h"

namespace oomguard::kb {
namespace {

// Migrations in PostgreSQL's dialect: entry i brings the schema from version
// i to i + 1, the same versions (and tables) as SQLite's (store.cc).
const char* const kPgMigrations[] = {
    // 0 -> 1: incidents.
    "CREATE TABLE incidents ("
    "  id TEXT PRIMARY KEY,"
    "  run_id TEXT NOT NULL DEFAULT '',"
    "  time_unix_ms BIGINT NOT NULL DEFAULT 0,"
    "  host TEXT NOT NULL DEFAULT '',"
    "  rank INTEGER NOT NULL DEFAULT 0,"
    "  step BIGINT NOT NULL DEFAULT 0,"
    "  phase TEXT NOT NULL DEFAULT '',"
    "  kind TEXT NOT NULL DEFAULT '',"
    "  workload TEXT NOT NULL DEFAULT '',"
    "  pattern TEXT NOT NULL DEFAULT '',"
    "  confidence DOUBLE PRECISION NOT NULL DEFAULT 0,"
    "  fingerprint TEXT NOT NULL DEFAULT '',"
    "  outcome TEXT NOT NULL DEFAULT '',"
    "  body TEXT NOT NULL);"
    "CREATE INDEX incidents_time ON incidents(time_unix_ms DESC, id);"
    "CREATE INDEX incidents_fingerprint ON incidents(fingerprint, time_unix_ms DESC);"
    "CREATE INDEX incidents_pattern ON incidents(pattern);"
    "CREATE INDEX incidents_run ON incidents(run_id, time_unix_ms DESC);"
    "CREATE INDEX incidents_workload ON incidents(workload, time_unix_ms DESC);",
    // 1 -> 2: learned priors and the record of dropped incidents.
    "CREATE TABLE priors ("
    "  workload TEXT PRIMARY KEY,"
    "  micro_batch BIGINT NOT NULL,"
    "  updated_unix_ms BIGINT NOT NULL);"
    "CREATE TABLE sink_drops ("
    "  time_unix_ms BIGINT NOT NULL,"
    "  pid BIGINT NOT NULL,"
    "  dropped BIGINT NOT NULL);",
    // 2 -> 3: the predictive controller's model beside the size prior.
    "CREATE TABLE prior_models ("
    "  workload TEXT PRIMARY KEY,"
    "  model TEXT NOT NULL,"
    "  updated_unix_ms BIGINT NOT NULL);",
    // 3 -> 4: a team's notes on fingerprint groups.
    "CREATE TABLE notes ("
    "  fingerprint TEXT PRIMARY KEY,"
    "  text TEXT NOT NULL,"
    "  author TEXT NOT NULL DEFAULT '',"
    "  updated_unix_ms BIGINT NOT NULL);",
    // 4 -> 5: the browser's queries on the server (no full load): the
    // searchable text (kb::SearchText; written with each incident, filled
    // here for older rows) and indexes for groups, stats, ranks and runs.
    "ALTER TABLE incidents ADD COLUMN search TEXT NOT NULL DEFAULT '';"
    "UPDATE incidents SET search = lower(concat_ws(chr(31), id, run_id, host,"
    "  COALESCE(body::jsonb->>'message', ''), COALESCE(body::jsonb->>'exception_type', ''), pattern, workload,"
    "  phase, kind, outcome, fingerprint, COALESCE(body::jsonb->>'evidence', '')));"
    "CREATE INDEX incidents_pattern_newest ON incidents(pattern, time_unix_ms DESC, id);"
    "CREATE INDEX incidents_outcome_newest ON incidents(outcome, time_unix_ms DESC, id);"
    "CREATE INDEX incidents_groups ON incidents(fingerprint, time_unix_ms, run_id, id);"
    "CREATE INDEX incidents_kind ON incidents(kind);"
    "CREATE INDEX incidents_rank ON incidents(rank);"
    "CREATE INDEX incidents_run_hosts ON incidents(run_id, host);"
    // Covers the runs' totals and each run's newest incident (Store::Runs).
    "CREATE INDEX incidents_runs ON incidents(run_id, time_unix_ms DESC, id, step, outcome, workload);",
};
static_assert(sizeof(kPgMigrations) / sizeof(kPgMigrations[0]) == kSchemaVersion);

// Serialises migrations of one database across processes (a transaction-level
// advisory lock: released at COMMIT or ROLLBACK).
constexpr const char* kMigrationLock = "SELECT pg_advisory_xact_lock(7340031226891469)";

// The password of a URL ("" when none), as written in it.
std::string UrlPassword(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos) return "";
  const size_t auth = scheme + 3;
  const size_t end = url.find_first_of("/?", auth);
  const std::string authority = url.substr(auth, end == std::string::npos ? std::string::npos : end - auth);
  const size_t at = authority.rfind('@');
  if (at != std::string::npos) {
    const size_t colon = authority.find(':');
    if (colon != std::string::npos && colon < at) return authority.substr(colon + 1, at - colon - 1);
  }
  const size_t q = url.find('?');
  if (q == std::string::npos) return "";
  for (size_t p = q + 1; p < url.size();) {
    size_t amp = url.find('&', p);
    if (amp == std::string::npos) amp = url.size();
    if (url.compare(p, 9, "password=") == 0) return url.substr(p + 9, amp - p - 9);
    p = amp + 1;
  }
  return "";
}

class PgRow final : public Store::Row {
 public:
  PgRow(PGresult* res, int row) : res_(res), row_(row) {}
  std::string Text(int col) const override {
    return std::string(PQgetvalue(res_, row_, col), static_cast<size_t>(PQgetlength(res_, row_, col)));
  }
  int64_t Int(int col) const override { return std::strtoll(PQgetvalue(res_, row_, col), nullptr, 10); }
  bool Null(int col) const override { return PQgetisnull(res_, row_, col) == 1; }

 private:
  PGresult* res_;
  int row_;
};

void IgnoreNotice(void*, const char*) {}

class PgStore final : public Store {
 public:
  PgStore(const std::string& url, int busy_timeout_ms, bool create, bool read_only)
      : Store(RedactUrl(url), read_only), url_(url), password_(UrlPassword(url)),
        busy_timeout_ms_(busy_timeout_ms), create_(create) {}
  ~PgStore() override {
    if (conn_ != nullptr) PQfinish(conn_);
  }
  bool remote() const override { return true; }

  // Rows' xmin (the transaction that wrote the row version) rises with
  // every insert and update; with the counts, deletes show too. A scan of
  // the table: about 10 ms per 100,000 incidents, once per poll.
  StatusOr<std::string> ChangeStamp() override {
    std::string stamp;
    OOMGUARD_RETURN_IF_ERROR(Run(
        std::string("SELECT (SELECT COUNT(*) || ':' || COALESCE(MAX(xmin::text::bigint), 0) FROM incidents)") +
            (version_ >= 4 ? " || '/' || (SELECT COUNT(*) || ':' || COALESCE(MAX(xmin::text::bigint), 0) FROM notes)"
                           : "") +
            " || '/' || (SELECT COALESCE(MAX(xmin::text::bigint), 0) FROM priors)",
        {}, [&](const Row& r) { stamp = r.Text(0); }, "change stamp"));
    return stamp;
  }

  // Connects (again) and checks or migrates the schema.
  Status Ready() {
    if (conn_ != nullptr && ready_ && PQstatus(conn_) == CONNECTION_OK) return Status::Ok();
    if (conn_ != nullptr) PQfinish(conn_);
    ready_ = false;
    const char* keys[] = {"connect_timeout", "application_name", "dbname", nullptr};
    const char* values[] = {"5", "oomguard", url_.c_str(), nullptr};
    conn_ = PQconnectdbParams(keys, values, 1);
    if (conn_ == nullptr) return Status::ResourceExhausted("knowledge base " + path_ + ": out of memory connecting");
    if (PQstatus(conn_) != CONNECTION_OK)
      return Status::Unavailable("knowledge base " + path_ + ": cannot connect: " + Scrub(PQerrorMessage(conn_)));
    PQsetNoticeProcessor(conn_, IgnoreNotice, nullptr);
    std::string setup = "SET lock_timeout = " + std::to_string(busy_timeout_ms_);
    if (read_only_) setup += "; SET default_transaction_read_only = on";
    OOMGUARD_RETURN_IF_ERROR(Simple(setup.c_str(), "configure the session"));
    OOMGUARD_RETURN_IF_ERROR(Migrate());
    ready_ = true;
    return Status::Ok();
  }

 protected:
  Status Run(const std::string& sql, const std::vector<Param>& params, const std::function<void(const Row&)>& on_row,
             const char* what) override {
    if (!in_transaction_) OOMGUARD_RETURN_IF_ERROR(Ready());
    std::string text;  // ?N -> $N
    text.reserve(sql.size());
    for (char c : sql) text += c == '?' ? '$' : c;
    std::vector<std::string> values;
    values.reserve(params.size());
    for (const Param& p : params) {
      if (const auto* s = std::get_if<std::string>(&p)) {
        values.push_back(*s);
      } else if (const auto* i = std::get_if<int64_t>(&p)) {
        values.push_back(std::to_string(*i));
      } else {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%.17g", std::get<double>(p));
        values.push_back(buf);
      }
    }
    std::vector<const char*> ptrs;
    for (const std::string& v : values) ptrs.push_back(v.c_str());
    PGresult* res = PQexecParams(conn_, text.c_str(), static_cast<int>(ptrs.size()), nullptr, ptrs.data(), nullptr,
                                 nullptr, 0);
    Status s = Check(res, what);
    if (s.ok() && on_row) {
      const int n = PQntuples(res);
      for (int r = 0; r < n; ++r) on_row(PgRow(res, r));
    }
    PQclear(res);
    return s;
  }

  Status Begin() override {
    OOMGUARD_RETURN_IF_ERROR(Ready());
    OOMGUARD_RETURN_IF_ERROR(Simple("BEGIN", "begin write"));
    in_transaction_ = true;
    return Status::Ok();
  }
  Status Commit() override {
    Status s = Simple("COMMIT", "commit write");
    in_transaction_ = false;
    return s;
  }
  void Rollback() override {
    in_transaction_ = false;
    if (conn_ != nullptr && PQstatus(conn_) == CONNECTION_OK) PQclear(PQexec(conn_, "ROLLBACK"));
  }

 private:
  // libpq's message without the password and the trailing newline.
  std::string Scrub(std::string msg) const {
    // Searching on after each replacement: a password such as "*" must not
    // find itself again in the "***" put in its place.
    if (!password_.empty())
      for (size_t at = msg.find(password_); at != std::string::npos; at = msg.find(password_, at + 3))
        msg.replace(at, password_.size(), "***");
    while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
    return msg;
  }

  Status Simple(const char* sql, const char* what) {
    PGresult* res = PQexec(conn_, sql);
    Status s = Check(res, what);
    PQclear(res);
    return s;
  }

  Status Check(PGresult* res, const char* what) {
    const ExecStatusType st = res == nullptr ? PGRES_FATAL_ERROR : PQresultStatus(res);
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) return Status::Ok();
    const char* code = res == nullptr ? nullptr : PQresultErrorField(res, PG_DIAG_SQLSTATE);
    const std::string sqlstate = code == nullptr ? "" : code;
    const std::string msg = "knowledge base " + path_ + ": " + what + ": " + Scrub(PQerrorMessage(conn_));
    if (PQstatus(conn_) != CONNECTION_OK) {
      ready_ = false;  // reconnect on the next use
      return Status::Unavailable(msg + " (connection lost; retried later)");
    }
    auto cls = [&](const char* c) { return sqlstate.compare(0, 2, c) == 0; };
    // Connection, shutdown, resources, lock timeouts, serialisation: transient.
    if (cls("08") || cls("57") || cls("53") || sqlstate == "55P03" || sqlstate == "40001" || sqlstate == "40P01")
      return Status::Unavailable(msg);
    if (sqlstate == "42501")
      return Status::FailedPrecondition(msg + " (the role in the URL lacks this privilege; see "
                                              "docs/knowledge_base.md, roles)");
    if (sqlstate == "25006") return Status::FailedPrecondition(msg);
    return Status::Internal(msg + (sqlstate.empty() ? "" : " [SQLSTATE " + sqlstate + "]"));
  }

  Status ReadVersion(int* version) {
    *version = 0;
    bool has = false;
    OOMGUARD_RETURN_IF_ERROR(RunDirect("SELECT to_regclass('schema_version') IS NOT NULL", "read schema",
                                       [&](const Row& r) { has = r.Text(0) == "t"; }));
    if (!has) {
      std::string tables;
      OOMGUARD_RETURN_IF_ERROR(RunDirect(
          "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
          " ORDER BY table_name LIMIT 3",
          "read schema", [&](const Row& r) { tables += (tables.empty() ? "" : ", ") + r.Text(0); }));
      // A first migration that committed between the two statements: look again.
      if (!tables.empty())
        OOMGUARD_RETURN_IF_ERROR(RunDirect("SELECT to_regclass('schema_version') IS NOT NULL", "read schema",
                                           [&](const Row& r) { has = r.Text(0) == "t"; }));
      if (!tables.empty() && !has)
        return Status::FailedPrecondition("knowledge base " + path_ +
                                          ": the database holds tables such as " + tables +
                                          " and no schema_version: not an oomguard knowledge base; it is left as it is");
      if (!has) return Status::Ok();
    }
    OOMGUARD_RETURN_IF_ERROR(RunDirect("SELECT version FROM schema_version", "read schema version",
                                       [&](const Row& r) { *version = static_cast<int>(r.Int(0)); }));
    if (*version > kSchemaVersion)
      return Status::FailedPrecondition("knowledge base " + path_ + ": schema version " + std::to_string(*version) +
                                        " is newer than this oomguard understands (" +
                                        std::to_string(kSchemaVersion) + "); upgrade oomguard");
    return Status::Ok();
  }

  // Run without the reconnect of Run (used while connecting).
  Status RunDirect(const char* sql, const char* what, const std::function<void(const Row&)>& on_row) {
    const bool was = in_transaction_;
    in_transaction_ = true;
    Status s = Run(sql, {}, on_row, what);
    in_transaction_ = was;
    return s;
  }

  Status Migrate() {
    int version = 0;
    OOMGUARD_RETURN_IF_ERROR(ReadVersion(&version));
    if (read_only_) {
      if (version == 0)
        return Status::FailedPrecondition("knowledge base " + path_ +
                                          ": the database has no oomguard schema yet (reading never creates one; "
                                          "a job or `oomguard kb import` does)");
      version_ = version;
      return Status::Ok();
    }
    version_ = kSchemaVersion;
    if (version == kSchemaVersion) return Status::Ok();  // the common case: no lock, no DDL privilege needed
    if (version == 0 && !create_)
      return Status::NotFound("knowledge base " + path_ + ": the database has no oomguard schema");
    OOMGUARD_RETURN_IF_ERROR(Simple("BEGIN", "begin migration"));
    in_transaction_ = true;
    auto fail = [&](Status s) {
      Rollback();
      return s;
    };
    Status s = Simple(kMigrationLock, "lock for migration");
    if (!s.ok()) return fail(s);
    // Another process may have migrated while we waited for the lock.
    if (!(s = ReadVersion(&version)).ok()) return fail(s);
    if (version == 0) {
      s = Simple("CREATE TABLE IF NOT EXISTS schema_version(version INTEGER NOT NULL);"
                 "DELETE FROM schema_version; INSERT INTO schema_version VALUES(0)",
                 "create schema_version");
      if (!s.ok()) return fail(s);
    }
    for (int v = version; v < kSchemaVersion; ++v)
      if (!(s = Simple(kPgMigrations[v], "migrate schema (needs the owner role)")).ok()) return fail(s);
    const std::string set = "UPDATE schema_version SET version=" + std::to_string(kSchemaVersion);
    if (!(s = Simple(set.c_str(), "record schema version")).ok()) return fail(s);
    return Commit();
  }

  const std::string url_;       // with the password: only ever given to libpq
  const std::string password_;  // scrubbed from messages
  const int busy_timeout_ms_;
  const bool create_;
  PGconn* conn_ = nullptr;
  bool ready_ = false;
  bool in_transaction_ = false;
};

}  // namespace

std::string RedactUrl(const std::string& spec) {
  if (!IsServerUrl(spec)) return spec;
  const std::string password = UrlPassword(spec);
  if (password.empty()) return spec;
  std::string out = spec;
  // The userinfo's password, and a password= parameter.
  const size_t auth = out.find("://") + 3;
  const size_t end = out.find_first_of("/?", auth);
  const size_t at = out.rfind('@', end == std::string::npos ? std::string::npos : end);
  if (at != std::string::npos && at >= auth) {
    const size_t colon = out.find(':', auth);
    if (colon != std::string::npos && colon < at) out.replace(colon + 1, at - colon - 1, "***");
  }
  for (size_t p = out.find("password=", out.find('?') == std::string::npos ? out.size() : out.find('?'));
       p != std::string::npos; p = out.find("password=", p + 1)) {
    if (p == 0 || (out[p - 1] != '?' && out[p - 1] != '&')) continue;
    size_t amp = out.find('&', p);
    out.replace(p + 9, (amp == std::string::npos ? out.size() : amp) - p - 9, "***");
  }
  return out;
}

StatusOr<std::unique_ptr<Store>> OpenPgStore(const std::string& url, int busy_timeout_ms, bool create,
                                             bool read_only, bool offline_ok) {
  if (busy_timeout_ms < 0) return Status::InvalidArgument("KnowledgeBaseOptions.busy_timeout_ms must be >= 0");
  auto store = std::make_unique<PgStore>(url, busy_timeout_ms, create, read_only);
  Status s = store->Ready();
  if (!s.ok() && !(offline_ok && s.code() == StatusCode::kUnavailable)) return s;
  return std::unique_ptr<Store>(std::move(store));
}

}  // namespace oomguard::kb
