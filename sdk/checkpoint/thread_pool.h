// A fixed set of worker threads running queued tasks (chunk compression and
// decompression, outside the HDF5 lock).
//
// Thread-safety: Submit may be called from any thread. The destructor drains
// queued tasks and joins the workers.
#ifndef OOMGUARD_SDK_CHECKPOINT_THREAD_POOL_H_
#define OOMGUARD_SDK_CHECKPOINT_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
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
  // Starts `threads` workers (at least one). Throws std::system_error when a
  // thread cannot be started, after joining those that were.
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
  void Stop();

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

// Buffers of the chunk tasks in flight, one per task, in submission order:
// taken for the newest task, handed back oldest first and reused, so that a
// pipeline needs memory for its window of chunks, not for all it reads.
class ChunkBuffers {
 public:
  // Whether n more bytes stay within `budget` (the first buffer always does).
  bool Fits(int64_t n, int64_t budget) const { return bytes_ == 0 || bytes_ + n <= budget; }
  // A buffer of n bytes for the newest task; valid until it is handed back
  // (moving a vector keeps its storage).
  uint8_t* Take(size_t n) {
    std::vector<uint8_t> buf;
    if (!free_.empty()) {
      buf = std::move(free_.back());
      free_.pop_back();
    }
    buf.resize(n);
    bytes_ += static_cast<int64_t>(n);
    inflight_.push_back(std::move(buf));
    return inflight_.back().data();
  }
  // No buffer for the newest task (it has one elsewhere).
  void TakeNone() { inflight_.emplace_back(); }
  // The oldest task's buffer, out of flight; Reuse it once done with it.
  std::vector<uint8_t> Oldest() {
    std::vector<uint8_t> buf = std::move(inflight_.front());
    inflight_.pop_front();
    bytes_ -= static_cast<int64_t>(buf.size());
    return buf;
  }
  void Reuse(std::vector<uint8_t>&& buf) {
    if (!buf.empty()) free_.push_back(std::move(buf));
  }
  // The newest task was not submitted after all.
  void DropNewest() {
    bytes_ -= static_cast<int64_t>(inflight_.back().size());
    Reuse(std::move(inflight_.back()));
    inflight_.pop_back();
  }

 private:
  std::vector<std::vector<uint8_t>> free_;
  std::deque<std::vector<uint8_t>> inflight_;
  int64_t bytes_ = 0;  // of the buffers in flight
};

}  // namespace oomguard::ckpt

#endif  // OOMGUARD_SDK_CHECKPOINT_THREAD_POOL_H_
