// Spool: incidents waiting on local disk for a knowledge-base server that
// cannot be reached (down, restarting, network gone), sent once it is back.
//
// Layout: a directory of files, one per process that spooled, each named
// spool-<host>-<pid>-<random>.jsonl and holding one record per line: an
// incident (the JSON exchange record) or a learned prior,
// {"prior":{"workload", "micro_batch", "replace", "learned_unix_ms", "model"}}. A process holds an exclusive flock on its own file
// while it lives; a file whose lock can be taken belongs to a process that
// ended (crashed, killed) and is adopted by the next Drain of any process
// spooling into the same directory, so nothing spooled is lost with its job.
//
// Exactly once: incidents have ids and the store upserts by id, so a file
// sent again (a crash between the server's commit and the truncation here)
// adds nothing. Priors carry the time they were learned and the store
// applies one only over a prior learned no later (kb::PriorUpdate), so a
// prior sent twice, or after a newer one from another job, changes nothing. A line torn by a crash mid-append is skipped (that incident
// was never fully spooled).
//
// Bounded: Append refuses (kResourceExhausted) once the directory would hold
// more than max_bytes; the caller counts those records as dropped.
//
// Thread-safety: none; the knowledge base's writer thread owns its Spool.
#ifndef OOMGUARD_SDK_KB_SPOOL_H_
#define OOMGUARD_SDK_KB_SPOOL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "oomguard/incident.h"
#include "oomguard/status.h"
#include "sdk/kb/store.h"

namespace oomguard::kb {

class Spool {
 public:
  // `dir` (and its parents) and this process's file are created on the
  // first Append; an existing `dir` this user cannot write is refused here.
  static StatusOr<std::unique_ptr<Spool>> Open(const std::string& dir, int64_t max_bytes);
  ~Spool();
  Spool(const Spool&) = delete;
  Spool& operator=(const Spool&) = delete;

  // Appends and syncs to disk (fdatasync) before returning.
  Status Append(const std::vector<Incident>& incidents, const std::vector<PriorUpdate>& priors = {});

  // Sends this process's spooled records, then any orphaned file's, through
  // `send`: a file's incidents in batches of at most `batch`, its priors
  // with the last batch. Each file is emptied (or removed) once all of it
  // was sent. Stops at the first failure of `send` and returns it. *sent
  // counts the records (incidents and priors) sent.
  using Send = std::function<Status(const std::vector<Incident>&, const std::vector<PriorUpdate>&)>;
  Status Drain(const Send& send, size_t batch, int64_t* sent);

  // Records (incidents and priors) in this process's file (not yet sent).
  int64_t pending() const { return pending_; }
  // True when the directory holds spooled incidents of other, ended
  // processes (checked at Open and by Drain).
  bool orphans() const { return orphans_; }
  const std::string& dir() const { return dir_; }

 private:
  Spool(std::string dir, int64_t max_bytes) : dir_(std::move(dir)), max_bytes_(max_bytes) {}
  Status EnsureFile();
  int64_t DirBytes() const;
  bool ScanOrphans();

  std::string dir_;
  int64_t max_bytes_;
  std::string path_;  // this process's file ("" until the first Append)
  int fd_ = -1;
  int64_t pending_ = 0;
  bool orphans_ = false;
};

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_SPOOL_H_
