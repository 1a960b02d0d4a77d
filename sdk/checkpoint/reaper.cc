#include "sdk/checkpoint/reaper.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "oomguard/logging.h"

namespace oomguard::ckpt {
namespace {

constexpr int kMaxDepth = 64;

// Empties the directory open at `dir_fd` (which it closes), depth first.
int EmptyDirectory(int dir_fd, int depth) {
  DIR* dir = ::fdopendir(dir_fd);
  if (dir == nullptr) {
    const int err = errno;
    ::close(dir_fd);
    return err;
  }
  int result = 0;
  while (dirent* e = ::readdir(dir)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    if (::unlinkat(dir_fd, e->d_name, 0) == 0 || errno == ENOENT) continue;
    if (errno != EISDIR && errno != EPERM) {
      result = errno;
      break;
    }
    // A directory (unlink of a directory is EISDIR on Linux, EPERM elsewhere).
    if (depth >= kMaxDepth) {
      result = ELOOP;
      break;
    }
    const int child = ::openat(dir_fd, e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (child < 0) {
      if (errno == ENOENT) continue;
      result = errno;
      break;
    }
    if ((result = EmptyDirectory(child, depth + 1)) != 0) break;
    if (::unlinkat(dir_fd, e->d_name, AT_REMOVEDIR) != 0 && errno != ENOENT) {
      result = errno;
      break;
    }
  }
  ::closedir(dir);  // closes dir_fd
  return result;
}

}  // namespace

std::error_code RemoveTree(const std::string& path) {
  if (::unlink(path.c_str()) == 0 || errno == ENOENT) return {};
  if (errno != EISDIR && errno != EPERM) return {errno, std::generic_category()};
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? std::error_code{} : std::error_code{errno, std::generic_category()};
  if (const int err = EmptyDirectory(fd, 1); err != 0) return {err, std::generic_category()};
  if (::rmdir(path.c_str()) != 0 && errno != ENOENT) return {errno, std::generic_category()};
  return {};
}

Reaper::~Reaper() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Reaper::Remove(std::string path) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(std::move(path));
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
  }
  cv_.notify_one();
}

void Reaper::Drain() {
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
}

void Reaper::Run() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) break;  // stopping, and all handed over is done
    const std::string path = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    const std::error_code ec = RemoveTree(path);
    // Another rank sharing the directory may have removed it first.
    if (ec && ec != std::errc::no_such_file_or_directory)
      Logger()->warn("retention: cannot remove {}: {}", path, ec.message());
    lk.lock();
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
  idle_cv_.notify_all();
}

}  // namespace oomguard::ckpt
