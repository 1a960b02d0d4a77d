// DirLock: one process per (checkpoint directory, rank).
//
// Two processes of the same rank writing one directory overwrite each other's
// shards and retention deletes each other's checkpoints, with no error. A
// Checkpointer holds an exclusive flock(2) on <dir>/LOCK.rank-<rank> for its
// life; the kernel releases it when the process dies, so a job killed with
// kill -9 does not leave the directory locked. Checkpointers of one process
// on the same (dir, rank) share the lock (a second one to inspect or load is
// the program's own business); other ranks of the same job lock other files.
//
// Thread-safety: Acquire may be called from any thread.
#ifndef OOMGUARD_SDK_CHECKPOINT_DIR_LOCK_H_
#define OOMGUARD_SDK_CHECKPOINT_DIR_LOCK_H_

#include <memory>
#include <string>

#include "oomguard/status.h"

namespace oomguard::ckpt {

class DirLock {
 public:
  // kFailedPrecondition naming the holder's pid when another process holds
  // the lock; kInvalidArgument when the lock file cannot be opened.
  static StatusOr<std::shared_ptr<DirLock>> Acquire(const std::string& dir, int rank);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  // The lock file's name in the directory (readers skip it).
  static std::string FileName(int rank);

 private:
  DirLock(std::string key, int fd) : key_(std::move(key)), fd_(fd) {}
  std::string key_;
  int fd_;
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_DIR_LOCK_H_
