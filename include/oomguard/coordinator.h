// Coordinator: the transport through which the ranks of one job agree.
//
// The guard runs its step protocol (docs/distributed.md: vote, gradient sync,
// agreement after the optimizer apply, rollback) over two collectives that
// every engine implements:
//   Allgather     every rank's small record of int64 words, to every rank
//   AllreduceSum  buffers (gradients, the loss) summed over ranks in place,
//                 each rank's contribution scaled by a factor of its own
// The protocol itself (what the words mean, the kind and sequence number each
// collective carries, what every rank does next) lives in the guard, written
// once for all engines; an engine only moves bytes and keeps deadlines.
//
// Collectives must be called by every rank in the same order with the same
// shapes. Each takes a deadline; a call that does not complete in time returns
// kUnavailable, and the coordinator is then broken: later calls fail at once.
// The process should exit with kExitCoordinationTimeout so that the launcher
// (torchrun, mpirun, Slurm, Kubernetes) restarts every rank, which resume from
// the newest complete checkpoint.
//
// Engines: MakeLocalCoordinator (one rank, the default), MakeThreadGroup (ranks
// as threads of one process), the MPI and NCCL engines (mpi_coordinator.h,
// nccl_coordinator.h, optional targets), and torch.distributed from Python
// (oomguard.torch.TorchDistributedCoordinator), which implements this interface.
//
// Thread-safety: one thread per rank calls its coordinator; Abort may be
// called from any thread.
#ifndef OOMGUARD_COORDINATOR_H_
#define OOMGUARD_COORDINATOR_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "oomguard/dtype.h"
#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

// The documented exit code of a process whose peers stopped answering
// (EX_TEMPFAIL: "try again"). Launchers restart all ranks; they resume.
inline constexpr int kExitCoordinationTimeout = 75;

// One buffer of Coordinator::AllreduceSum.
struct SumBuffer {
  void* data = nullptr;  // `count` contiguous elements of `dtype`
  int64_t count = 0;
  DType dtype = DType::kFloat64;
  int device = -1;  // -1: host memory; N >= 0: memory of CUDA device N
  // This rank contributes scale * data (floating-point types; integer
  // buffers require 1). The guard sets it to this rank's share of the global
  // batch's loss units, so that the sum is the global batch's mean.
  double scale = 1.0;
  // The object the buffer belongs to, for engines written in another language
  // (the Python binding passes the torch.Tensor here). C++ engines ignore it.
  const void* handle = nullptr;

  // A host buffer of float64.
  static SumBuffer Host(double* data, int64_t count) {
    SumBuffer b;
    b.data = data;
    b.count = count;
    return b;
  }
  // A host buffer of float32.
  static SumBuffer Host(float* data, int64_t count) {
    SumBuffer b = Host(static_cast<double*>(nullptr), count);
    b.data = data;
    b.dtype = DType::kFloat32;
    return b;
  }
};

class OOMGUARD_EXPORT Coordinator {
 public:
  virtual ~Coordinator();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "local", "threads", "mpi", "nccl", "torch.distributed".
  virtual std::string engine() const = 0;
  // An identifier of the group that is the same on every rank, agreed when
  // the group was made (the engines that make one collectively: threads,
  // MPI, NCCL). The guard names its run after it (GuardOptions::run_id
  // empty), so that the incidents of every rank of one job form one run in
  // the knowledge base. Empty: the engine has none (one rank; an engine of
  // the user's): each guard then makes its own unless run_id is set.
  virtual std::string job_id() const { return {}; }

  // Collective: every rank's `mine` (the same length on every rank),
  // concatenated in rank order into `all`, which holds size() * mine.size()
  // words. For small records (tens of words): votes and agreements.
  // kInvalidArgument when `all` has the wrong length (before any
  // communication); kUnavailable when the peers do not answer within `deadline`.
  virtual Status Allgather(std::span<const int64_t> mine, std::span<int64_t> all,
                           std::chrono::milliseconds deadline) = 0;

  // Collective: element-wise sum over ranks of each buffer, in place; rank r
  // contributes buffers[i].scale * buffers[i] (rank r's own scale). Every rank
  // passes the same number of buffers with the same counts and types. An
  // engine that cannot sum a buffer's type or location returns
  // kInvalidArgument before any communication (every rank then fails alike).
  virtual Status AllreduceSum(std::span<const SumBuffer> buffers, std::chrono::milliseconds deadline) = 0;

  // Breaks the coordinator: blocked and later calls on every rank return
  // kAborted/kUnavailable. Safe from any thread.
  virtual void Abort() = 0;
};

// The single-process coordinator: rank 0 of 1.
OOMGUARD_EXPORT std::unique_ptr<Coordinator> MakeLocalCoordinator();

// `size` coordinators that share one group, one per rank; each is used by one
// thread. Sums are reduced in rank order, so results are deterministic, and
// every collective checks that all ranks called the same one with the same
// shapes ("collective sequence diverged" otherwise). kInvalidArgument for size < 1.
OOMGUARD_EXPORT StatusOr<std::vector<std::unique_ptr<Coordinator>>> MakeThreadGroup(int size);

}  // namespace oomguard

#endif  // OOMGUARD_COORDINATOR_H_
