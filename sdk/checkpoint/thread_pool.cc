#include "sdk/checkpoint/thread_pool.h"

namespace oomguard::ckpt {

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) threads = 1;
  workers_.reserve(static_cast<size_t>(threads));
  try {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Run(); });
  } catch (...) {
    // The destructor does not run for a constructor that throws: the workers
    // already started are joined here (a joinable std::thread destroyed
    // would terminate the process).
    Stop();
    throw;
  }
}

ThreadPool::~ThreadPool() { Stop(); }

void ThreadPool::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::Run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace oomguard::ckpt
