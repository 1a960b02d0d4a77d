#include "sdk/server/snapshot.h"

#include <sys/stat.h>

#include <chrono>
#include <optional>

#include "sdk/core/ids.h"

namespace oomguard::server {

StatusOr<std::shared_ptr<const IncidentIndex>> LoadIndex(kb::KnowledgeBaseSet* files) {
  auto stats = files->Stats();
  if (!stats.ok()) return stats.status();
  auto incidents = files->Query(IncidentQuery{});
  if (!incidents.ok()) return incidents.status();
  auto notes = files->Notes();
  if (!notes.ok()) return notes.status();
  return std::shared_ptr<const IncidentIndex>(std::make_shared<IncidentIndex>(
      std::move(incidents).value(), std::move(stats).value(), internal::NowUnixMs(), std::move(notes).value()));
}

StatusOr<std::unique_ptr<SnapshotSource>> SnapshotSource::Open(const std::vector<std::string>& db_specs,
                                                               int poll_ms) {
  auto files = kb::KnowledgeBaseSet::Open(db_specs);
  if (!files.ok()) return files.status();
  auto first = LoadIndex(&*files);
  if (!first.ok()) return first.status();
  return std::unique_ptr<SnapshotSource>(new SnapshotSource(files->specs(), std::move(first).value(), poll_ms));
}

SnapshotSource::SnapshotSource(std::vector<std::string> paths, std::shared_ptr<const IncidentIndex> first,
                               int poll_ms)
    : paths_(std::move(paths)), poll_ms_(poll_ms), current_(std::move(first)) {
  if (poll_ms_ > 0) poller_ = std::thread([this] { Poll(); });
}

SnapshotSource::~SnapshotSource() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (poller_.joinable()) poller_.join();
}

std::shared_ptr<const IncidentIndex> SnapshotSource::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

std::string SnapshotSource::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

std::string SnapshotSource::Signature() const {
  std::string sig;
  for (const std::string& p : paths_) {
    if (kb::IsServerUrl(p)) {
      auto& store = servers_[p];
      if (store == nullptr) {
        auto opened = kb::Store::OpenReadOnly(p, 1000);
        if (opened.ok()) store = std::move(opened).value();
      }
      auto stamp = store != nullptr ? store->ChangeStamp() : StatusOr<std::string>(Status::Unavailable(""));
      // Unreachable: the same "-" each time, so the snapshot stays until it answers.
      sig += (stamp.ok() ? *stamp : std::string("-")) + ";";
      continue;
    }
    for (const std::string& f : {p, p + "-wal"}) {
      struct stat st {};
      if (::stat(f.c_str(), &st) != 0) {
        sig += "-;";
        continue;
      }
      // The inode too: `mv new.db kb.db` (rsync, scp) puts another file
      // under the name, possibly with the same size and time.
      sig += std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) +
             ":" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) + ";";
    }
  }
  return sig;
}

void SnapshotSource::Poll() {
  std::string seen = Signature();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_cv_.wait_for(lock, std::chrono::milliseconds(poll_ms_), [this] { return stopping_; })) {
    lock.unlock();
    std::string now = Signature();
    if (now == seen) {
      lock.lock();
      continue;
    }
    // Open the files again (a replaced file is another file) and close them
    // once read, so that no connection of ours outlives the reload.
    auto next = [this]() -> StatusOr<std::shared_ptr<const IncidentIndex>> {
      auto files = kb::KnowledgeBaseSet::Open(paths_);
      if (!files.ok()) return files.status();
      return LoadIndex(&*files);
    }();
    lock.lock();
    if (next.ok()) {
      current_ = std::move(next).value();
      last_error_.clear();
      seen = std::move(now);
    } else {
      // Keep serving the previous snapshot; the next poll retries.
      last_error_ = next.status().ToString();
    }
  }
}

}  // namespace oomguard::server
