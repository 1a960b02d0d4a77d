// SnapshotSource: keeps an IncidentIndex of the knowledge-base files current.
//
// The files are read read-only (never created, never written) and are open
// only while they are read: the index lives in memory, and a connection held
// between reloads would keep a writer that closes from removing its -wal
// (SQLite removes it with the last connection), which a file later replaced
// by `mv new.db kb.db` would then find beside it. A poller thread looks at
// each file's inode, size and modification time (and its -wal companion,
// where SQLite appends in WAL mode) every poll interval and, when anything
// changed, opens and reads every file again (a replaced file is a new inode)
// and swaps in a new index. Requests keep the snapshot they started with
// (shared_ptr), so a reload never tears a page; a failed reload keeps the
// previous snapshot and remembers the error.
//
// A PostgreSQL server (a postgresql:// spec) has no file to look at: the
// poller keeps one read-only connection to it and asks it for its change
// stamp (kb::Store::ChangeStamp) instead.
//
// Thread-safety: Current(), last_error() and paths() may be called from any
// thread. Only the poller reads the files after Open.
#ifndef OOMGUARD_SDK_SERVER_SNAPSHOT_H_
#define OOMGUARD_SDK_SERVER_SNAPSHOT_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "oomguard/status.h"
#include "sdk/kb/file_set.h"
#include "sdk/kb/store.h"
#include "sdk/server/incident_index.h"

namespace oomguard::server {

// Reads every incident and the totals of `files` into a new index.
StatusOr<std::shared_ptr<const IncidentIndex>> LoadIndex(kb::KnowledgeBaseSet* files);

class SnapshotSource {
 public:
  // Opens the files named by --db specs (globs allowed) and loads the first
  // snapshot; an error here is the caller's to report (nothing to serve).
  // poll_ms <= 0: never reload.
  static StatusOr<std::unique_ptr<SnapshotSource>> Open(const std::vector<std::string>& db_specs,
                                                        int poll_ms);
  ~SnapshotSource();
  SnapshotSource(const SnapshotSource&) = delete;
  SnapshotSource& operator=(const SnapshotSource&) = delete;

  std::shared_ptr<const IncidentIndex> Current() const;
  std::string last_error() const;  // "" when the newest reload succeeded
  const std::vector<std::string>& paths() const { return paths_; }

 private:
  SnapshotSource(std::vector<std::string> paths, std::shared_ptr<const IncidentIndex> first, int poll_ms);
  // Inodes, sizes and mtimes of every file and its -wal, as one comparable string.
  std::string Signature() const;
  void Poll();

  const std::vector<std::string> paths_;  // the --db specs, expanded once
  mutable std::map<std::string, std::unique_ptr<kb::Store>> servers_;  // poller only: by URL
  const int poll_ms_;
  mutable std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;                         // guarded by mu_
  std::shared_ptr<const IncidentIndex> current_;  // guarded by mu_
  std::string last_error_;                        // guarded by mu_
  std::thread poller_;
};

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_SNAPSHOT_H_
