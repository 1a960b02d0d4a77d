// Coordinator: how ranks agree, once per step, on what happens next.
//
// The guard retries OOMs locally, then every rank calls Vote with its outcome.
// The vote is one small allreduce: the max of status, the min of the durable
// checkpoint step and of the micro-batch limit, and whether any rank wants a
// rollback. Gradient collectives run only after a vote that all ranks passed,
// so one rank's OOM never leaves the others blocked inside a collective.
//
// Every rank must call Vote the same number of times (collective). A call that
// does not complete within the deadline returns kUnavailable.
//
// Engines: LocalCoordinator (one rank, the default), and the multi-rank engines
// (thread group, MPI, NCCL, torch.distributed) built on this interface.
//
// Thread-safety: one training thread per rank calls a coordinator.
#ifndef OOMGUARD_COORDINATOR_H_
#define OOMGUARD_COORDINATOR_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "oomguard/export.h"
#include "oomguard/incident.h"
#include "oomguard/status.h"

namespace oomguard {

// A rank's step outcome, ordered so that max() is the worst.
enum class VoteStatus : int64_t { kOk = 0, kRollback = 1, kFailed = 2 };

struct VoteInput {
  VoteStatus status = VoteStatus::kOk;
  int64_t durable_step = -1;   // newest checkpoint step that is durable on this rank (-1: none)
  int64_t micro_limit = 0;     // this rank's micro-batch limit
};

struct VoteResult {
  VoteStatus status = VoteStatus::kOk;  // max over ranks
  int64_t min_durable_step = -1;        // min over ranks
  int64_t min_micro_limit = 0;          // min over ranks
};

class OOMGUARD_EXPORT Coordinator {
 public:
  virtual ~Coordinator();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Collective. kUnavailable when the peers do not answer within `deadline`.
  virtual StatusOr<VoteResult> Vote(const VoteInput& in, std::chrono::milliseconds deadline) = 0;
  // Collective: every rank's memory figures (index = rank).
  virtual StatusOr<std::vector<RankMemory>> GatherMemory(const RankMemory& mine,
                                                         std::chrono::milliseconds deadline) = 0;
};

// The single-process coordinator: rank 0 of 1; its vote is its own input.
OOMGUARD_EXPORT std::unique_ptr<Coordinator> MakeLocalCoordinator();

}  // namespace oomguard

#endif  // OOMGUARD_COORDINATOR_H_
