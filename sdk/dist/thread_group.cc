// ThreadGroup: ranks as threads of one process.
//
// Every collective is one exchange: each rank deposits its contribution and a
// description of the call (which collective, with which shapes) in its slot;
// the last to arrive opens the round; each rank computes the result from all
// slots under the lock (in rank order, so sums are deterministic); the last to
// read closes the round so the slots can be reused. Ranks whose descriptions
// differ called different collectives at the same point: every rank of that
// round fails with "collective sequence diverged" and the group breaks. A rank
// that waits past its deadline breaks the group, which wakes every waiter with
// an error: nobody waits longer than its own deadline.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>

#include "oomguard/coordinator.h"
#include "sdk/core/ids.h"
#include "sdk/dist/host_buffers.h"

namespace oomguard {
namespace {

using Bytes = std::vector<uint8_t>;

// What one rank put into a round.
struct Slot {
  std::string call;            // "allgather of 18 words", "sum of [float64 x 4417, float64 x 5]"
  Bytes data;                  // the rank's contribution
  std::vector<double> scales;  // AllreduceSum: one per buffer
};

class Group {
 public:
  explicit Group(int size) : size_(size), slots_(static_cast<size_t>(size)) {}

  // Deposits `mine` and, once every rank has and all called the same
  // collective, calls read(slots) under the lock.
  Status Exchange(int rank, Slot mine, std::chrono::milliseconds deadline, const char* what,
                  const std::function<void(const std::vector<Slot>&)>& read) {
    const auto until = std::chrono::steady_clock::now() + deadline;
    std::unique_lock<std::mutex> lock(mu_);
    auto broken_status = [&] {
      return Status::Unavailable(std::string(what) + ": thread group is broken (" + broken_why_ + ")");
    };
    // Wait for the previous round to be fully read.
    if (!cv_.wait_until(lock, until, [&] { return broken_ || !reading_; })) return Break(rank, what, deadline);
    if (broken_) return broken_status();
    slots_[static_cast<size_t>(rank)] = std::move(mine);
    const uint64_t round = round_;
    if (++arrived_ == size_) {
      reading_ = true;
      readers_ = 0;
      cv_.notify_all();
    } else if (!cv_.wait_until(lock, until, [&] { return broken_ || (reading_ && round_ == round); })) {
      return Break(rank, what, deadline);
    }
    // A round every rank completed is read even if a rank broke the group
    // right after reading it: all ranks then see the same data.
    if (!(reading_ && round_ == round)) return broken_status();
    std::string diverged;
    for (int r = 1; r < size_ && diverged.empty(); ++r) {
      if (slots_[static_cast<size_t>(r)].call != slots_[0].call)
        diverged = "collective sequence diverged: rank 0 called " + slots_[0].call + ", rank " + std::to_string(r) +
                   " called " + slots_[static_cast<size_t>(r)].call;
    }
    if (diverged.empty()) read(slots_);
    if (++readers_ == size_) {
      reading_ = false;
      arrived_ = 0;
      ++round_;
      if (!diverged.empty() && !broken_) {
        broken_ = true;
        broken_why_ = diverged;
      }
      cv_.notify_all();
    }
    if (!diverged.empty()) return Status::Internal(diverged);
    return Status::Ok();
  }

  void Abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_) {
      broken_ = true;
      broken_why_ = why;
    }
    cv_.notify_all();
  }

  int size() const { return size_; }

 private:
  Status Break(int rank, const char* what, std::chrono::milliseconds deadline) {
    const std::string why = "rank " + std::to_string(rank) + " waited " + std::to_string(deadline.count()) +
                            " ms in " + what + " for " + std::to_string(size_ - arrived_) + " rank(s)";
    if (!broken_) {
      broken_ = true;
      broken_why_ = why;
    }
    cv_.notify_all();
    return Status::Unavailable(std::string(what) + ": peers did not answer within the deadline (" + why + ")");
  }

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  int arrived_ = 0;
  int readers_ = 0;
  bool reading_ = false;
  uint64_t round_ = 0;
  bool broken_ = false;
  std::string broken_why_;
};

// Sums buffer `i` of every slot into `out`: out[j] = sum over ranks, in rank
// order, of scale_r * x_r[j], accumulated in double.
template <typename T>
void SumInto(const std::vector<Slot>& all, size_t i, size_t offset, int64_t count, T* out) {
  for (int64_t j = 0; j < count; ++j) {
    double acc = 0;
    for (const Slot& s : all) {
      T v;
      std::memcpy(&v, s.data.data() + offset + static_cast<size_t>(j) * sizeof(T), sizeof(T));
      acc += s.scales[i] * static_cast<double>(v);
    }
    out[j] = static_cast<T>(acc);
  }
}

void SumInt64(const std::vector<Slot>& all, size_t offset, int64_t count, int64_t* out) {
  for (int64_t j = 0; j < count; ++j) {
    int64_t acc = 0;
    for (const Slot& s : all) {
      int64_t v;
      std::memcpy(&v, s.data.data() + offset + static_cast<size_t>(j) * sizeof(v), sizeof(v));
      acc += v;
    }
    out[j] = acc;
  }
}

class ThreadGroupCoordinator final : public Coordinator {
 public:
  ThreadGroupCoordinator(std::shared_ptr<Group> group, int rank, std::string job_id)
      : group_(std::move(group)), rank_(rank), job_id_(std::move(job_id)) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string engine() const override { return "threads"; }
  std::string job_id() const override { return job_id_; }

  Status Allgather(std::span<const int64_t> mine, std::span<int64_t> all,
                   std::chrono::milliseconds deadline) override {
    const size_t n = mine.size();
    if (all.size() != n * static_cast<size_t>(size()))
      return Status::InvalidArgument("Allgather: `all` holds " + std::to_string(all.size()) + " words, expected " +
                                     std::to_string(n * static_cast<size_t>(size())));
    Slot slot;
    slot.call = "allgather of " + std::to_string(n) + " words";
    slot.data.resize(n * sizeof(int64_t));
    if (n > 0) std::memcpy(slot.data.data(), mine.data(), slot.data.size());
    return group_->Exchange(rank_, std::move(slot), deadline, "allgather", [&](const std::vector<Slot>& slots) {
      for (size_t r = 0; r < slots.size(); ++r)
        if (n > 0) std::memcpy(all.data() + r * n, slots[r].data.data(), n * sizeof(int64_t));
    });
  }

  Status AllreduceSum(std::span<const SumBuffer> buffers, std::chrono::milliseconds deadline) override {
    OOMGUARD_RETURN_IF_ERROR(dist::CheckHostBuffers(buffers, "threads"));
    Slot slot;
    slot.call = "sum of [";
    size_t bytes = 0;
    for (size_t i = 0; i < buffers.size(); ++i) {
      slot.call += (i > 0 ? ", " : "") + std::string(DTypeName(buffers[i].dtype)) + " x " +
                   std::to_string(buffers[i].count);
      bytes += static_cast<size_t>(buffers[i].count) * DTypeSize(buffers[i].dtype);
    }
    slot.call += "]";
    slot.data.resize(bytes);
    size_t at = 0;
    for (const SumBuffer& b : buffers) {
      const size_t n = static_cast<size_t>(b.count) * DTypeSize(b.dtype);
      if (n > 0) std::memcpy(slot.data.data() + at, b.data, n);
      at += n;
      slot.scales.push_back(b.scale);
    }
    return group_->Exchange(rank_, std::move(slot), deadline, "allreduce", [&](const std::vector<Slot>& slots) {
      size_t offset = 0;
      for (size_t i = 0; i < buffers.size(); ++i) {
        const SumBuffer& b = buffers[i];
        switch (b.dtype) {
          case DType::kFloat64: SumInto(slots, i, offset, b.count, static_cast<double*>(b.data)); break;
          case DType::kFloat32: SumInto(slots, i, offset, b.count, static_cast<float*>(b.data)); break;
          default: SumInt64(slots, offset, b.count, static_cast<int64_t*>(b.data)); break;
        }
        offset += static_cast<size_t>(b.count) * DTypeSize(b.dtype);
      }
    });
  }

  void Abort() override { group_->Abort("aborted by rank " + std::to_string(rank_)); }

 private:
  std::shared_ptr<Group> group_;
  int rank_;
  std::string job_id_;
};

}  // namespace

StatusOr<std::vector<std::unique_ptr<Coordinator>>> MakeThreadGroup(int size) {
  if (size < 1) return Status::InvalidArgument("MakeThreadGroup: size must be >= 1 (got " + std::to_string(size) + ")");
  auto group = std::make_shared<Group>(size);
  std::vector<std::unique_ptr<Coordinator>> out;
  const std::string job_id = internal::RandomHex16();
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<ThreadGroupCoordinator>(group, r, job_id));
  return out;
}

}  // namespace oomguard
