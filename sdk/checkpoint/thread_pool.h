// A fixed set of worker threads running queued tasks (chunk compression and
// decompression, outside the HDF5 lock).
//
// Thread-safety: Submit may be called from any thread. The destructor drains
// queued tasks and joins the workers.
#ifndef OOMGUARD_SDK_CHECKPOINT_THREAD_POOL_H_
#define OOMGUARD_SDK_CHECKPOINT_THREAD_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace oomguard::ckpt {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }

  template <typename F>
  auto Submit(F&& f) -> std::future<decltype(f())> {
    using R = decltype(f());
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(f));
    std::future<R> fut = task->get_future();
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.emplace_back([task] { (*task)(); });
    }
    cv_.notify_one();
    return fut;
  }

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::vector<std::thread> workers_;
};

// Chunk tasks in flight per worker, in the writer and the readers: enough to
// keep every worker busy while the calling thread handles the oldest, few
// enough to bound the memory their buffers take.
inline constexpr int kTasksPerWorker = 4;

// Waits for every task still in `q` when it goes out of scope, so that no
// task outlives the locals and buffers it uses, however the scope is left
// (an early error return included).
template <typename T>
struct WaitForAll {
  std::deque<std::future<T>>* q;
  ~WaitForAll() {
    for (auto& f : *q)
      if (f.valid()) f.wait();
  }
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_THREAD_POOL_H_
