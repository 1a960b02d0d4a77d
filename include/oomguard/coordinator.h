// Coordinator: how ranks agree, once per step, on what happens next.
//
// The guard retries OOMs locally, then every rank calls Vote with its outcome.
// The vote is one small allreduce of a few int64: the worst status, the min of
// the durable checkpoint step and of the micro-batch limit, the min and max of
// the in-memory snapshot step, and whether any rank hit an OOM. Gradient
// collectives run only after a vote that every rank passed, so one rank's OOM
// never leaves the others blocked inside a collective.
//
// Collective calls (Vote, GatherMemory, Barrier, Broadcast, AllreduceSum) must
// be made by every rank in the same order. Each takes a deadline; a call that
// does not complete in time returns kUnavailable, and the coordinator is then
// broken: later calls fail at once. The process should exit with
// kExitCoordinationTimeout so that the launcher (torchrun, mpirun, Slurm,
// Kubernetes) restarts every rank, which resume from the newest complete
// checkpoint.
//
// Engines: MakeLocalCoordinator (one rank, the default), MakeThreadGroup (ranks
// as threads of one process), the MPI and NCCL engines (mpi_coordinator.h,
// nccl_coordinator.h, optional targets), and torch.distributed from Python,
// which implements this interface.
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

#include "oomguard/export.h"
#include "oomguard/incident.h"
#include "oomguard/status.h"

namespace oomguard {

// The documented exit code of a process whose peers stopped answering
// (EX_TEMPFAIL: "try again"). Launchers restart all ranks; they resume.
inline constexpr int kExitCoordinationTimeout = 75;

// A rank's step outcome, ordered so that max() is the worst.
enum class VoteStatus : int64_t { kOk = 0, kRollback = 1, kFailed = 2 };

struct VoteInput {
  VoteStatus status = VoteStatus::kOk;
  int64_t durable_step = -1;     // newest step durable on this rank (-1: none)
  int64_t snapshot_step = -1;    // step of this rank's in-memory snapshot (-1: none)
  int64_t micro_limit = 0;       // this rank's micro-batch limit
  bool had_oom = false;          // this rank handled an OOM in this step
};

struct VoteResult {
  VoteStatus status = VoteStatus::kOk;  // max over ranks
  int64_t min_durable_step = -1;        // min over ranks
  int64_t min_snapshot_step = -1;       // min over ranks
  int64_t max_snapshot_step = -1;       // max over ranks (equal to the min: every rank holds that snapshot)
  int64_t min_micro_limit = 0;          // min over ranks
  bool any_oom = false;                 // some rank handled an OOM
};

// The vote as it travels: kVoteWords int64, reduced with max (mins are negated).
inline constexpr int kVoteWords = 6;
OOMGUARD_EXPORT void PackVote(const VoteInput& in, int64_t out[kVoteWords]);
OOMGUARD_EXPORT VoteResult UnpackVote(const int64_t reduced_max[kVoteWords]);

class OOMGUARD_EXPORT Coordinator {
 public:
  virtual ~Coordinator();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "local", "threads", "mpi", "nccl", "torch.distributed".
  virtual std::string engine() const = 0;
  // Collective. kUnavailable when the peers do not answer within `deadline`.
  virtual StatusOr<VoteResult> Vote(const VoteInput& in, std::chrono::milliseconds deadline) = 0;
  // Collective: every rank's memory figures (index = rank).
  virtual StatusOr<std::vector<RankMemory>> GatherMemory(const RankMemory& mine,
                                                         std::chrono::milliseconds deadline) = 0;
  // Collective: returns when every rank has arrived.
  virtual Status Barrier(std::chrono::milliseconds deadline) = 0;
  // Collective: rank `root`'s bytes replace every other rank's `data` (sizes may differ).
  virtual Status Broadcast(std::vector<uint8_t>* data, int root, std::chrono::milliseconds deadline) = 0;
  // Collective: element-wise sum of a host buffer over ranks, in place. For small
  // host state such as the demo's gradients; real training synchronises
  // gradients with its framework (DDP, NCCL) inside commit.
  virtual Status AllreduceSum(std::span<double> data, std::chrono::milliseconds deadline) = 0;
  // Breaks the coordinator: blocked and later calls on every rank return
  // kAborted/kUnavailable. Safe from any thread.
  virtual void Abort() = 0;
};

// The single-process coordinator: rank 0 of 1.
OOMGUARD_EXPORT std::unique_ptr<Coordinator> MakeLocalCoordinator();

// `size` coordinators that share one group, one per rank; each is used by one
// thread. Sums are reduced in rank order, so results are deterministic.
// kInvalidArgument for size < 1.
OOMGUARD_EXPORT StatusOr<std::vector<std::unique_ptr<Coordinator>>> MakeThreadGroup(int size);

}  // namespace oomguard

#endif  // OOMGUARD_COORDINATOR_H_
