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
// Thread-safety: none. One Store is used by one thread at a time (the
// KnowledgeBase gives the writer thread its own Store and guards the other
// with a mutex). Several Stores, in one or many processes, may share a file.
#ifndef OOMGUARD_SDK_KB_STORE_H_
#define OOMGUARD_SDK_KB_STORE_H_

#include <sqlite3.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"

namespace oomguard::kb {

inline constexpr int kSchemaVersion = 3;

// A prior update produced by KnowledgeBase::RecordCleanMicroBatch or
// RecordModel.
struct PriorUpdate {
  std::string workload;
  int64_t micro_batch = 0;         // 0: no size to update
  bool replace = false;            // true: overwrite; false: keep the larger
  std::optional<SizeModel> model;  // replaces the stored model when set
};

// The stored form of a model, and back (nullopt for text that is not one).
std::string SizeModelToJson(const SizeModel& model);
std::optional<SizeModel> SizeModelFromJson(const std::string& text);

class Store {
 public:
  // See KnowledgeBase::Open for the error codes.
  static StatusOr<std::unique_ptr<Store>> Open(const std::string& path, int busy_timeout_ms, bool create);
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

 private:
  Store(std::string path, sqlite3* db) : path_(std::move(path)), db_(db) {}
  Status Migrate();
  Status Exec(const char* sql, const char* what);
  // A Status for the connection's last error, naming the file and the operation.
  Status Error(int rc, const char* what) const;

  std::string path_;
  sqlite3* db_;
};

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_STORE_H_
