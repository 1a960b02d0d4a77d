#include "sdk/checkpoint/reaper.h"

#include <filesystem>

#include "oomguard/logging.h"

namespace oomguard::ckpt {

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
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
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
