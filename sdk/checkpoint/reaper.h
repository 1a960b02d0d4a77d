// Deletes directories on a thread of its own. Retention renames a
// checkpoint it drops to a hidden name in the same directory (one metadata
// operation, atomic) and hands it here, so that freeing its blocks and page
// cache (a third of a second for a 512 MiB shard on ext4 here) is not part
// of the save that committed the newer one.
//
// Thread-safety: Remove and Drain may be called from any thread. The
// destructor finishes what was handed over, then joins.
#ifndef OOMGUARD_SDK_CHECKPOINT_REAPER_H_
#define OOMGUARD_SDK_CHECKPOINT_REAPER_H_

#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

namespace oomguard::ckpt {

// Names of directories handed to a Reaper begin with this; a crash can
// leave them behind, and a new Checkpointer removes them.
inline constexpr const char* kRemovingPrefix = ".removing-";

// Removes `path` and everything under it, like std::filesystem::remove_all,
// without following symbolic links (a link is removed, never what it points
// to). Written on openat/unlinkat rather than called from libstdc++: the
// std::filesystem::remove_all that PyPI's libtorch 2.11 exports from
// libtorch.so takes the place of libstdc++'s in a process that loads it
// first, and crashes. A path that does not exist is no error. Directories
// deeper than 64 levels are refused (ELOOP): no checkpoint is that deep.
std::error_code RemoveTree(const std::string& path);

class Reaper {
 public:
  Reaper() = default;
  ~Reaper();
  Reaper(const Reaper&) = delete;
  Reaper& operator=(const Reaper&) = delete;

  // Removes `path` and everything under it, later. Failures are logged.
  void Remove(std::string path);
  // Returns once everything handed over so far is removed.
  void Drain();

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::string> queue_;  // guarded by mu_
  bool busy_ = false;              // guarded by mu_: removing one now
  bool stop_ = false;              // guarded by mu_
  std::thread thread_;             // started by the first Remove
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_REAPER_H_
