#include "sdk/checkpoint/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>

namespace oomguard::ckpt {
namespace {

// The locks this process holds, by canonical path: flock conflicts between
// two open files of one process too, so a second Checkpointer here shares the
// first one's lock instead of taking its own.
struct Held {
  std::mutex mu;
  std::map<std::string, std::weak_ptr<DirLock>> locks;
};
Held& HeldLocks() {
  static auto* held = new Held();  // leaked: used from destructors at exit
  return *held;
}

}  // namespace

std::string DirLock::FileName(int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "LOCK.rank-%05d", rank);
  return name;
}

StatusOr<std::shared_ptr<DirLock>> DirLock::Acquire(const std::string& dir, int rank) {
  std::error_code ec;
  std::filesystem::path canonical = std::filesystem::weakly_canonical(dir, ec);
  if (ec) canonical = std::filesystem::absolute(dir, ec);
  const std::string key = (canonical / FileName(rank)).string();
  Held& held = HeldLocks();
  std::lock_guard<std::mutex> lock(held.mu);
  if (auto existing = held.locks[key].lock()) return existing;
  const int fd = ::open(key.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    return Status::InvalidArgument("CheckpointOptions.dir: cannot open the lock file " + key + ": " +
                                   std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char pid[32] = {0};
    const ssize_t n = ::pread(fd, pid, sizeof(pid) - 1, 0);
    ::close(fd);
    std::string holder = n > 0 ? std::string(pid, static_cast<size_t>(n)) : std::string("unknown");
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    if (err != EWOULDBLOCK)
      return Status::InvalidArgument("CheckpointOptions.dir: cannot lock " + key + ": " + std::strerror(err));
    return Status::FailedPrecondition(
        "CheckpointOptions.dir: " + dir + " is in use by another process (pid " + holder + ") as rank " +
        std::to_string(rank) + ": two processes writing one checkpoint directory overwrite each other's shards "
        "and delete each other's checkpoints; give each run its own directory, or stop the other process");
  }
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, me.data(), me.size(), 0);
  std::shared_ptr<DirLock> out(new DirLock(key, fd));
  held.locks[key] = out;
  return out;
}

DirLock::~DirLock() {
  Held& held = HeldLocks();
  std::lock_guard<std::mutex> lock(held.mu);
  auto it = held.locks.find(key_);
  if (it != held.locks.end() && it->second.expired()) held.locks.erase(it);
  ::close(fd_);  // releases the flock
}

}  // namespace oomguard::ckpt
