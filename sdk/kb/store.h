// Store: one connection to a knowledge base (an SQLite file or a PostgreSQL
// server), with the schema, its migrations and every statement the knowledge
// base runs.
//
// File format (schema version 5; PostgreSQL has the same tables, pg_store.cc):
//   schema_version(version)                    one row
//   incidents(id PRIMARY KEY, indexed columns..., body)  body: the JSON exchange record
//   priors(workload PRIMARY KEY, micro_batch, updated_unix_ms)
//   prior_models(workload PRIMARY KEY, model, updated_unix_ms)  model: SizeModel as
//                                              JSON ({"fixed_bytes", "unit_bytes", ...})
//   sink_drops(time_unix_ms, pid, dropped)     incidents lost to full queues
//   notes(fingerprint PRIMARY KEY, text, author, updated_unix_ms)  (version 4)
//   incidents.search: kb::SearchText of the incident, for text filters, and
//   the indexes the browser's queries read (version 5)
// The indexed columns duplicate fields of body for filtering and grouping;
// body is the source of truth, so new Incident fields need no migration.
//
// Readers (OpenReadOnly) never create, migrate or write a file and never
// leave a -wal or -shm file beside it, so that a user who may only read a
// knowledge base can browse it, and one who may also write the directory
// does not leave files the owner's writer then cannot open. When no -wal
// file exists (no writer has it open, the last one checkpointed it), the
// database file holds every committed incident and is read as an immutable
// file; a read that saw the file change underneath is read again. When a
// -wal exists, SQLite's own read-only WAL reader is used (with a -shm it
// cannot write, it keeps the index in memory). One narrow race remains: a
// writer that closes (removing its -wal and -shm) between a reader's check
// and its first read makes SQLite recreate them for the reader.
//
// Thread-safety: none. One Store is used by one thread at a time (the
// KnowledgeBase gives the writer thread its own Store and guards the other
// with a mutex). Several Stores, in one or many processes, may share a file.
#ifndef OOMGUARD_SDK_KB_STORE_H_
#define OOMGUARD_SDK_KB_STORE_H_

#include <sqlite3.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "oomguard/knowledge_base.h"

namespace oomguard::kb {

// ParsePhase for what a file holds, including names earlier builds wrote:
// "vote", their phase of a coordination failure, is kComm now. Defined in
// incident_json.cc, which reads the body; the grouping reads the column.
std::optional<Phase> ParseStoredPhase(std::string_view name);

inline constexpr int kSchemaVersion = 5;

// One training run as its incidents show it.
struct RunSummary {
  std::string run_id;
  std::string workload;  // of the newest incident
  int64_t incidents = 0;
  int64_t failed = 0;  // outcome "failed"
  int64_t first_unix_ms = 0;
  int64_t last_unix_ms = 0;
  int64_t first_step = 0;
  int64_t last_step = 0;
  std::vector<std::string> hosts;  // sorted, distinct
};

// A prior update produced by KnowledgeBase::RecordCleanMicroBatch or
// RecordModel.
struct PriorUpdate {
  std::string workload;
  int64_t micro_batch = 0;         // 0: no size to update
  // true: overwrite (or create) the prior; false: raise an existing prior
  // only. A session that met no real OOM has learned no limit: its clean
  // sizes say what ran, not what does not fit, so they never create one.
  bool replace = false;
  std::optional<SizeModel> model;  // replaces the stored model when set
  // When the job learned it (0: when written). A store applies an update
  // only over a prior learned no later, so an update that waited in a spool
  // never undoes a newer one, and one sent twice changes nothing the second
  // time.
  int64_t learned_unix_ms = 0;
};

// The stored form of a model, and back (nullopt for text that is not one).
std::string SizeModelToJson(const SizeModel& model);
std::optional<SizeModel> SizeModelFromJson(const std::string& text);

// The knowledge base's store: one connection to an SQLite file or to a
// PostgreSQL server. Every query (filters, groups, stats, priors, notes) is
// written once here, in SQL both dialects run; a backend supplies the
// connection (Run, transactions), the DDL of its migrations and its error
// mapping. Statements use ?N placeholders; the PostgreSQL backend turns
// them into $N.
class Store {
 public:
  // A postgresql:// (or postgres://) URL selects PostgreSQL, anything else
  // is an SQLite file. See KnowledgeBase::Open for the error codes. Refuses an SQLite file
  // that holds other tables and no schema_version (someone else's database),
  // a file this user cannot write, and -wal/-shm files beside it that this
  // user cannot write (writes would fail later, one incident at a time).
  // `offline_ok` (PostgreSQL only): a server that cannot be reached is no
  // error; the store connects (and migrates) on its first use.
  static StatusOr<std::unique_ptr<Store>> Open(const std::string& path, int busy_timeout_ms, bool create,
                                               bool offline_ok = false);
  // Opens for reading only (see above). kNotFound when missing;
  // kFailedPrecondition for an empty file, an SQLite database that is not a
  // knowledge base, a schema newer than this build, or a -wal without its
  // -shm; kDataLoss for a file that is not an SQLite database.
  static StatusOr<std::unique_ptr<Store>> OpenReadOnly(const std::string& path, int busy_timeout_ms);
  virtual ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // One transaction: incidents are upserted by id, priors applied, drops noted.
  Status Write(const std::vector<Incident>& incidents, const std::vector<PriorUpdate>& priors, int64_t dropped);

  StatusOr<std::vector<Incident>> Query(const IncidentQuery& q);
  // How many incidents pass the filters of `q` (its limit and offset ignored).
  StatusOr<int64_t> Count(const IncidentQuery& q);
  // Groups of the incidents passing the filters of `filters` (limit and
  // offset ignored); most frequent first, ties newest first.
  StatusOr<std::vector<IncidentGroup>> Groups(const IncidentQuery& filters = {});
  // The distinct (fingerprint, run id) pairs passing the filters: what a
  // merge of several stores needs to count a group's runs exactly.
  StatusOr<std::vector<std::pair<std::string, std::string>>> GroupRuns(const IncidentQuery& filters);
  // Incident counts by rank, ascending rank.
  StatusOr<std::vector<std::pair<int, int64_t>>> RankCounts();
  // Every run with a run id (in no particular order).
  StatusOr<std::vector<RunSummary>> Runs();
  StatusOr<KnowledgeBaseStats> Stats();
  StatusOr<std::optional<int64_t>> Prior(const std::string& workload);
  StatusOr<std::optional<SizeModel>> PriorModel(const std::string& workload);
  // Sets (or, with empty text, removes) the note of a fingerprint group.
  Status SetNote(const GroupNote& note);
  StatusOr<std::vector<GroupNote>> Notes();

  // The file, or the URL with its password replaced (safe to print).
  const std::string& path() const { return path_; }
  bool read_only() const { return read_only_; }
  // A server (PostgreSQL): writes may fail for a while and succeed later.
  virtual bool remote() const { return false; }
  // A server's answer to "did anything change?": differs after any commit
  // that inserted or updated an incident or a note. A file has none ("": its
  // readers look at the file itself).
  virtual StatusOr<std::string> ChangeStamp() { return std::string(); }

  using Param = std::variant<std::string, int64_t, double>;
  // One result row of a backend; columns from 0.
  class Row {
   public:
    virtual ~Row() = default;
    virtual std::string Text(int col) const = 0;
    virtual int64_t Int(int col) const = 0;
    virtual bool Null(int col) const = 0;
  };

 protected:

  Store(std::string path, bool read_only) : path_(std::move(path)), read_only_(read_only) {}
  // Runs one statement with ?N placeholders bound to params[N-1], calling
  // on_row for each row. `what` names the operation in errors.
  virtual Status Run(const std::string& sql, const std::vector<Param>& params,
                     const std::function<void(const Row&)>& on_row, const char* what) = 0;
  virtual Status Begin() = 0;  // a write transaction
  virtual Status Commit() { return Run("COMMIT", {}, nullptr, "commit"); }
  virtual void Rollback() = 0;
  // Runs `read` (the read queries); see the SQLite reader for why it may rerun.
  virtual Status Reading(const std::function<void()>& read) {
    read();
    return Status::Ok();
  }

  std::string path_;
  bool read_only_ = false;
  int version_ = kSchemaVersion;  // of the store; a reader may see an older one

 private:
  StatusOr<std::vector<Incident>> QueryOnce(const IncidentQuery& q);
  StatusOr<std::vector<IncidentGroup>> GroupsOnce(const IncidentQuery& filters);
  StatusOr<std::vector<RunSummary>> RunsOnce();
  StatusOr<KnowledgeBaseStats> StatsOnce();
};

// The SQLite file (store.cc, store_reader.cc).
class SqliteStore final : public Store {
 public:
  static StatusOr<std::unique_ptr<Store>> Open(const std::string& path, int busy_timeout_ms, bool create);
  static StatusOr<std::unique_ptr<Store>> OpenReadOnly(const std::string& path, int busy_timeout_ms);
  ~SqliteStore() override;

 protected:
  Status Run(const std::string& sql, const std::vector<Param>& params, const std::function<void(const Row&)>& on_row,
             const char* what) override;
  Status Begin() override;
  void Rollback() override;
  Status Reading(const std::function<void()>& read) override;

 private:
  SqliteStore(std::string path, sqlite3* db) : Store(std::move(path), false), db_(db) {}
  Status Migrate();
  // (Re)opens the read-only connection, choosing immutable or WAL reading.
  Status ConnectReadOnly();
  Status ReadVersion(int* version);
  Status Exec(const char* sql, const char* what);
  // A Status for the connection's last error, naming the file and the operation.
  Status Error(int rc, const char* what) const;

  sqlite3* db_;
  bool immutable_ = false;  // read-only, opened with immutable=1 (no -wal existed)
  int busy_timeout_ms_ = 0;
  std::string signature_;  // read-only: the file as it was when connected
};

// True for a postgresql:// or postgres:// URL.
bool IsServerUrl(std::string_view spec);
// The URL with its password (user:PASSWORD@ or password=...) replaced by
// "***"; anything else unchanged.
std::string RedactUrl(const std::string& spec);

// The PostgreSQL server (pg_store.cc).
StatusOr<std::unique_ptr<Store>> OpenPgStore(const std::string& url, int busy_timeout_ms, bool create,
                                             bool read_only, bool offline_ok);

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_STORE_H_
