// The MPI engine: non-blocking collectives on a duplicate of MPI_COMM_WORLD,
// polled against the caller's deadline.
//
// Errors come back as return codes, never as an abort of the job: the private
// communicator has MPI_ERRORS_RETURN, and because Open MPI reports errors that
// surface in MPI_Test of a non-blocking collective through MPI_COMM_WORLD's
// handler (its requests carry no communicator), MPI_COMM_WORLD's handler is
// switched to MPI_ERRORS_RETURN for the duration of each poll and then put
// back, so the application's own choice still holds everywhere else.
#include "oomguard/mpi_coordinator.h"

#include <mpi.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "sdk/core/ids.h"
#include "sdk/dist/host_buffers.h"

namespace oomguard {
namespace {

std::string MpiError(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

// MPI_COMM_WORLD returns errors while this object lives.
class WorldErrorsReturn {
 public:
  WorldErrorsReturn() {
    if (MPI_Comm_get_errhandler(MPI_COMM_WORLD, &saved_) == MPI_SUCCESS) {
      MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
      restore_ = true;
    }
  }
  ~WorldErrorsReturn() {
    if (!restore_) return;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, saved_);
    MPI_Errhandler_free(&saved_);
  }
  WorldErrorsReturn(const WorldErrorsReturn&) = delete;
  WorldErrorsReturn& operator=(const WorldErrorsReturn&) = delete;

 private:
  MPI_Errhandler saved_ = MPI_ERRHANDLER_NULL;
  bool restore_ = false;
};

class MpiCoordinator final : public Coordinator {
 public:
  MpiCoordinator(MPI_Comm comm, int rank, int size, std::string job_id)
      : comm_(comm), rank_(rank), size_(size), job_id_(std::move(job_id)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string engine() const override { return "mpi"; }
  std::string job_id() const override { return job_id_; }

  Status Allgather(std::span<const int64_t> mine, std::span<int64_t> all,
                   std::chrono::milliseconds deadline) override {
    if (all.size() != mine.size() * static_cast<size_t>(size_))
      return Status::InvalidArgument("Allgather: `all` holds " + std::to_string(all.size()) + " words, expected " +
                                     std::to_string(mine.size() * static_cast<size_t>(size_)));
    if (mine.size() > static_cast<size_t>(INT32_MAX)) return Status::InvalidArgument("Allgather: record too large");
    const int n = static_cast<int>(mine.size());
    MPI_Request req;
    OOMGUARD_RETURN_IF_ERROR(Start("allgather", [&] {
      return MPI_Iallgather(mine.data(), n, MPI_INT64_T, all.data(), n, MPI_INT64_T, comm_, &req);
    }));
    return Wait("allgather", {&req, 1}, deadline);
  }

  Status AllreduceSum(std::span<const SumBuffer> buffers, std::chrono::milliseconds deadline) override {
    OOMGUARD_RETURN_IF_ERROR(dist::CheckHostBuffers(buffers, "mpi"));
    for (const SumBuffer& b : buffers)
      if (b.count > INT32_MAX) return Status::InvalidArgument("mpi AllreduceSum: a buffer of more than 2^31 elements");
    if (broken_) return Broken("allreduce");
    // Scaled in place before the sum: MPI_SUM then yields sum_r scale_r * x_r.
    for (const SumBuffer& b : buffers) dist::ScaleInPlace(b);
    std::vector<MPI_Request> reqs;
    reqs.reserve(buffers.size());
    for (const SumBuffer& b : buffers) {
      MPI_Datatype type = b.dtype == DType::kFloat64 ? MPI_DOUBLE : b.dtype == DType::kFloat32 ? MPI_FLOAT : MPI_INT64_T;
      MPI_Request req;
      Status s = Start("allreduce", [&] {
        return MPI_Iallreduce(MPI_IN_PLACE, b.data, static_cast<int>(b.count), type, MPI_SUM, comm_, &req);
      });
      if (!s.ok()) return s;  // the coordinator is broken: nothing else will be waited for
      reqs.push_back(req);
    }
    return Wait("allreduce", reqs, deadline);
  }

  void Abort() override { broken_ = true; }

 private:
  Status Broken(const char* what) const {
    return Status::Unavailable(std::string(what) + ": coordinator is broken by an earlier error or timeout");
  }

  template <typename F>
  Status Start(const char* what, F&& call) {
    if (broken_) return Broken(what);
    int rc;
    {
      WorldErrorsReturn guard;
      rc = call();
    }
    if (rc != MPI_SUCCESS) {
      broken_ = true;
      return Status::Unavailable(std::string(what) + ": " + MpiError(rc));
    }
    return Status::Ok();
  }

  // Polls until every request completes: a short spin for the common case of
  // peers that are already there, then sleeps that grow to 1 ms.
  Status Wait(const char* what, std::span<MPI_Request> reqs, std::chrono::milliseconds deadline) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto until = t0 + deadline;
    auto sleep = std::chrono::microseconds(20);
    WorldErrorsReturn guard;
    for (;;) {
      int done = 0;
      int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
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
  std::string job_id_;
  std::atomic<bool> broken_{false};
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
  MPI_Comm comm;
  int rc;
  {
    WorldErrorsReturn guard;
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  }
  if (rc != MPI_SUCCESS) return Status::Unavailable("MPI_Comm_dup failed: " + MpiError(rc));
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  // The job's id, rank 0's, on every rank: every rank is here (MPI_Comm_dup
  // is collective), so one broadcast at creation costs the steps nothing.
  char id[16];
  const std::string mine = internal::RandomHex16();
  std::memcpy(id, mine.data(), sizeof(id));
  rc = MPI_Bcast(id, sizeof(id), MPI_CHAR, 0, comm);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&comm);
    return Status::Unavailable("MPI_Bcast of the job id failed: " + MpiError(rc));
  }
  return std::unique_ptr<Coordinator>(new MpiCoordinator(comm, rank, size, std::string(id, sizeof(id))));
}

}  // namespace oomguard
