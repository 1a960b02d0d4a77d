// ThreadGroup: ranks as threads of one process.
//
// Every collective is one exchange: each rank deposits its contribution in
// its slot; the last to arrive opens the round; each rank computes the result
// from all slots under the lock (in rank order, so sums are deterministic);
// the last to read closes the round so the slots can be reused. A rank that
// waits past its deadline breaks the group, which wakes every waiter with an
// error: nobody waits longer than its own deadline.
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>

#include "oomguard/coordinator.h"

namespace oomguard {
namespace {

using Bytes = std::vector<uint8_t>;

class Group {
 public:
  explicit Group(int size) : size_(size), slots_(static_cast<size_t>(size)) {}

  // Deposits `mine` and, once every rank has, calls read(slots) under the lock.
  Status Exchange(int rank, Bytes mine, std::chrono::milliseconds deadline, const char* what,
                  const std::function<void(const std::vector<Bytes>&)>& read) {
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
    if (broken_) return broken_status();
    read(slots_);
    if (++readers_ == size_) {
      reading_ = false;
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
    }
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
  std::vector<Bytes> slots_;
  int arrived_ = 0;
  int readers_ = 0;
  bool reading_ = false;
  uint64_t round_ = 0;
  bool broken_ = false;
  std::string broken_why_;
};

template <typename T>
Bytes ToBytes(const T* p, size_t n) {
  Bytes b(n * sizeof(T));
  if (n > 0) std::memcpy(b.data(), p, b.size());
  return b;
}

class ThreadGroupCoordinator final : public Coordinator {
 public:
  ThreadGroupCoordinator(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string engine() const override { return "threads"; }

  StatusOr<VoteResult> Vote(const VoteInput& in, std::chrono::milliseconds deadline) override {
    int64_t w[kVoteWords];
    PackVote(in, w);
    int64_t m[kVoteWords];
    Status s = group_->Exchange(rank_, ToBytes(w, kVoteWords), deadline, "vote", [&](const std::vector<Bytes>& all) {
      for (int i = 0; i < kVoteWords; ++i) m[i] = INT64_MIN;
      for (const Bytes& b : all) {
        const int64_t* v = reinterpret_cast<const int64_t*>(b.data());
        for (int i = 0; i < kVoteWords; ++i) m[i] = std::max(m[i], v[i]);
      }
    });
    if (!s.ok()) return s;
    return UnpackVote(m);
  }

  StatusOr<std::vector<RankMemory>> GatherMemory(const RankMemory& mine, std::chrono::milliseconds deadline) override {
    std::vector<RankMemory> out;
    RankMemory me = mine;
    me.rank = rank_;
    Status s = group_->Exchange(rank_, ToBytes(&me, 1), deadline, "gather memory", [&](const std::vector<Bytes>& all) {
      for (const Bytes& b : all) {
        RankMemory r;
        std::memcpy(&r, b.data(), sizeof(r));
        out.push_back(r);
      }
    });
    if (!s.ok()) return s;
    return out;
  }

  Status Barrier(std::chrono::milliseconds deadline) override {
    return group_->Exchange(rank_, {}, deadline, "barrier", [](const std::vector<Bytes>&) {});
  }

  Status Broadcast(std::vector<uint8_t>* data, int root, std::chrono::milliseconds deadline) override {
    if (root < 0 || root >= size())
      return Status::InvalidArgument("Broadcast: root " + std::to_string(root) + " outside [0, " +
                                     std::to_string(size()) + ")");
    Bytes mine = rank_ == root ? *data : Bytes{};
    return group_->Exchange(rank_, std::move(mine), deadline, "broadcast",
                            [&](const std::vector<Bytes>& all) { *data = all[static_cast<size_t>(root)]; });
  }

  Status AllreduceSum(std::span<double> data, std::chrono::milliseconds deadline) override {
    const size_t n = data.size();
    bool mismatch = false;
    Status s = group_->Exchange(rank_, ToBytes(data.data(), n), deadline, "allreduce",
                                [&](const std::vector<Bytes>& all) {
                                  std::vector<double> sum(n, 0.0);
                                  for (const Bytes& b : all) {
                                    if (b.size() != n * sizeof(double)) {
                                      mismatch = true;
                                      return;
                                    }
                                    const double* v = reinterpret_cast<const double*>(b.data());
                                    for (size_t i = 0; i < n; ++i) sum[i] += v[i];
                                  }
                                  std::copy(sum.begin(), sum.end(), data.begin());
                                });
    if (!s.ok()) return s;
    if (mismatch) return Status::InvalidArgument("AllreduceSum: ranks passed buffers of different sizes");
    return Status::Ok();
  }

  void Abort() override { group_->Abort("aborted by rank " + std::to_string(rank_)); }

 private:
  std::shared_ptr<Group> group_;
  int rank_;
};

}  // namespace

StatusOr<std::vector<std::unique_ptr<Coordinator>>> MakeThreadGroup(int size) {
  if (size < 1) return Status::InvalidArgument("MakeThreadGroup: size must be >= 1 (got " + std::to_string(size) + ")");
  auto group = std::make_shared<Group>(size);
  std::vector<std::unique_ptr<Coordinator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<ThreadGroupCoordinator>(group, r));
  return out;
}

}  // namespace oomguard
