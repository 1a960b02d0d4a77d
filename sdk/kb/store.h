// Store: one SQLite connection to a knowledge-base file, with the schema, its
// migrations and every statement the knowledge base runs.
//
// File format (schema version 3):
//   schema_version(version)                    one row
//   incidents(id PRIMARY KEY, indexed columns..., body)  body: the JSON exchange record
//   priors(workload PRIMARY KEY, micro_batch, updated_unix_ms)
//   prior_models(workload PRIMARY KEY, model, updated_unix_ms)  model: SizeModel as
//                                              JSON ({"fixed_bytes", "unit_bytes", ...})
//   sink_drops(time_unix_ms, pid, dropped)     incidents lost to full queues
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
#include <vector>

#include "oomguard/knowledge_base.h"

namespace oomguard::kb {

// ParsePhase for what a file holds, including names earlier builds wrote:
// "vote", their phase of a coordination failure, is kComm now. Defined in
// incident_json.cc, which reads the body; the grouping reads the column.
std::optional<Phase> ParseStoredPhase(std::string_view name);

inline constexpr int kSchemaVersion = 3;

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
};

// The stored form of a model, and back (nullopt for text that is not one).
std::string SizeModelToJson(const SizeModel& model);
std::optional<SizeModel> SizeModelFromJson(const std::string& text);

class Store {
 public:
  // See KnowledgeBase::Open for the error codes. Refuses an SQLite file
  // that holds other tables and no schema_version (someone else's database),
  // a file this user cannot write, and -wal/-shm files beside it that this
  // user cannot write (writes would fail later, one incident at a time).
  static StatusOr<std::unique_ptr<Store>> Open(const std::string& path, int busy_timeout_ms, bool create);
  // Opens for reading only (see above). kNotFound when missing;
  // kFailedPrecondition for an empty file, an SQLite database that is not a
  // knowledge base, a schema newer than this build, or a -wal without its
  // -shm; kDataLoss for a file that is not an SQLite database.
  static StatusOr<std::unique_ptr<Store>> OpenReadOnly(const std::string& path, int busy_timeout_ms);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // One transaction: incidents are upserted by id, priors applied, drops noted.
  Status Write(const std::vector<Incident>& incidents, const std::vector<PriorUpdate>& priors, int64_t dropped);

  StatusOr<std::vector<Incident>> Query(const IncidentQuery& q);
  StatusOr<std::vector<IncidentGroup>> Groups();
  StatusOr<KnowledgeBaseStats> Stats();
  StatusOr<std::optional<int64_t>> Prior(const std::string& workload);
  StatusOr<std::optional<SizeModel>> PriorModel(const std::string& workload);

  const std::string& path() const { return path_; }
  bool read_only() const { return read_only_; }

 private:
  Store(std::string path, sqlite3* db) : path_(std::move(path)), db_(db) {}
  Status Migrate();
  // (Re)opens the read-only connection, choosing immutable or WAL reading.
  Status ConnectReadOnly();
  // Runs `read`; on a read-only store whose file changed while an immutable
  // connection read it, reconnects and runs it again (a few times at most).
  // Fails only when reconnecting fails.
  Status Reading(const std::function<void()>& read);
  StatusOr<std::vector<Incident>> QueryOnce(const IncidentQuery& q);
  StatusOr<std::vector<IncidentGroup>> GroupsOnce();
  StatusOr<KnowledgeBaseStats> StatsOnce();
  StatusOr<std::optional<int64_t>> PriorOnce(const std::string& workload);
  StatusOr<std::optional<SizeModel>> PriorModelOnce(const std::string& workload);
  Status ReadVersion(int* version);
  Status Exec(const char* sql, const char* what);
  // A Status for the connection's last error, naming the file and the operation.
  Status Error(int rc, const char* what) const;

  std::string path_;
  sqlite3* db_;
  bool read_only_ = false;
  bool immutable_ = false;  // read-only, opened with immutable=1 (no -wal existed)
  int busy_timeout_ms_ = 0;
  int version_ = kSchemaVersion;  // of the file; a reader may see an older one
  std::string signature_;         // read-only: the file as it was when connected
};

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_STORE_H_
