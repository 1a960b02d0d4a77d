#include "oomguard/mpi_coordinator.h"

#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <thread>

namespace oomguard {
namespace {

std::string MpiError(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

class MpiCoordinator final : public Coordinator {
 public:
  MpiCoordinator(MPI_Comm comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string engine() const override { return "mpi"; }

  StatusOr<VoteResult> Vote(const VoteInput& in, std::chrono::milliseconds deadline) override {
    int64_t w[kVoteWords], m[kVoteWords];
    PackVote(in, w);
    MPI_Request req;
    Status s = Start("vote", MPI_Iallreduce(w, m, kVoteWords, MPI_INT64_T, MPI_MAX, comm_, &req));
    if (s.ok()) s = Wait("vote", &req, deadline);
    if (!s.ok()) return s;
    return UnpackVote(m);
  }

  StatusOr<std::vector<RankMemory>> GatherMemory(const RankMemory& mine, std::chrono::milliseconds deadline) override {
    int64_t w[4] = {rank_, mine.allocated, mine.reserved, mine.peak_allocated};
    std::vector<int64_t> all(static_cast<size_t>(4 * size_));
    MPI_Request req;
    Status s = Start("gather memory", MPI_Iallgather(w, 4, MPI_INT64_T, all.data(), 4, MPI_INT64_T, comm_, &req));
    if (s.ok()) s = Wait("gather memory", &req, deadline);
    if (!s.ok()) return s;
    std::vector<RankMemory> out(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      out[r].rank = static_cast<int>(all[4 * r]);
      out[r].allocated = all[4 * r + 1];
      out[r].reserved = all[4 * r + 2];
      out[r].peak_allocated = all[4 * r + 3];
    }
    return out;
  }

  Status Barrier(std::chrono::milliseconds deadline) override {
    MPI_Request req;
    Status s = Start("barrier", MPI_Ibarrier(comm_, &req));
    return s.ok() ? Wait("barrier", &req, deadline) : s;
  }

  Status Broadcast(std::vector<uint8_t>* data, int root, std::chrono::milliseconds deadline) override {
    if (root < 0 || root >= size_)
      return Status::InvalidArgument("Broadcast: root " + std::to_string(root) + " outside [0, " +
                                     std::to_string(size_) + ")");
    const auto until = std::chrono::steady_clock::now() + deadline;
    int64_t n = static_cast<int64_t>(data->size());
    MPI_Request req;
    Status s = Start("broadcast", MPI_Ibcast(&n, 1, MPI_INT64_T, root, comm_, &req));
    if (s.ok()) s = Wait("broadcast", &req, Remaining(until));
    if (!s.ok()) return s;
    data->resize(static_cast<size_t>(n));
    if (n == 0) return Status::Ok();
    if (n > INT32_MAX) return Status::InvalidArgument("Broadcast: more than 2 GiB");
    s = Start("broadcast", MPI_Ibcast(data->data(), static_cast<int>(n), MPI_BYTE, root, comm_, &req));
    return s.ok() ? Wait("broadcast", &req, Remaining(until)) : s;
  }

  Status AllreduceSum(std::span<double> data, std::chrono::milliseconds deadline) override {
    if (data.size() > static_cast<size_t>(INT32_MAX)) return Status::InvalidArgument("AllreduceSum: buffer too large");
    MPI_Request req;
    Status s = Start("allreduce", MPI_Iallreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.size()),
                                                 MPI_DOUBLE, MPI_SUM, comm_, &req));
    return s.ok() ? Wait("allreduce", &req, deadline) : s;
  }

  void Abort() override { broken_ = true; }

 private:
  static std::chrono::milliseconds Remaining(std::chrono::steady_clock::time_point until) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    return std::max(left, std::chrono::milliseconds(0));
  }

  Status Start(const char* what, int rc) {
    if (broken_) return Status::Unavailable(std::string(what) + ": coordinator is broken by an earlier timeout");
    if (rc != MPI_SUCCESS) return Status::Unavailable(std::string(what) + ": " + MpiError(rc));
    return Status::Ok();
  }

  // Polls until the request completes: a short spin for the common case of
  // peers that are already there, then sleeps that grow to 1 ms.
  Status Wait(const char* what, MPI_Request* req, std::chrono::milliseconds deadline) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto until = t0 + deadline;
    auto sleep = std::chrono::microseconds(20);
    for (int polls = 0;; ++polls) {
      int done = 0;
      int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        broken_ = true;
        return Status::Unavailable(std::string(what) + ": " + MpiError(rc));
      }
      if (done) return Status::Ok();
      auto now = std::chrono::steady_clock::now();
      if (now >= until) {
        broken_ = true;
        return Status::Unavailable(std::string(what) + ": peers did not answer within " +
                                   std::to_string(deadline.count()) + " ms (rank " + std::to_string(rank_) + " of " +
                                   std::to_string(size_) + ")");
      }
      if (now - t0 > std::chrono::microseconds(200)) {
        std::this_thread::sleep_for(sleep);
        sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
      }
    }
  }

  MPI_Comm comm_;
  int rank_, size_;
  bool broken_ = false;
};

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

StatusOr<std::unique_ptr<Coordinator>> MakeMpiCoordinator() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) return Status::Unavailable("MPI_Init_thread failed: " + MpiError(rc));
    std::atexit(FinalizeAtExit);
  }
  // Errors come back as return codes, not as an abort of the whole job.
  MPI_Comm comm;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  if (rc != MPI_SUCCESS) return Status::Unavailable("MPI_Comm_dup failed: " + MpiError(rc));
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::unique_ptr<Coordinator>(new MpiCoordinator(comm, rank, size));
}

}  // namespace oomguard
