// The NCCL engine of the Coordinator interface (optional target
// oomguard::nccl, built when OOMGUARD_WITH_NCCL is on). For GPU jobs that
// already use NCCL and want no second communication stack.
//
// Each collective is enqueued on a private CUDA stream and polled with
// cudaStreamQuery until done or until the deadline; on a timeout the
// communicator is aborted (ncclCommAbort) so that no rank stays inside it,
// and the coordinator returns kUnavailable from then on.
//
// Thread-safety: one thread per rank calls the coordinator.
#ifndef OOMGUARD_NCCL_COORDINATOR_H_
#define OOMGUARD_NCCL_COORDINATOR_H_

#include <array>
#include <memory>

#include "oomguard/coordinator.h"
#include "oomguard/export.h"

namespace oomguard {

// The 128 bytes of an ncclUniqueId. Rank 0 creates it; the launcher's own
// channel (MPI, torch.distributed's store, a shared file) hands it to the others.
using NcclId = std::array<char, 128>;

// kUnavailable when no GPU is visible, kUnimplemented when built without NCCL.
OOMGUARD_EXPORT StatusOr<NcclId> NewNcclId();

// Joins the NCCL communicator `id` as `rank` of `size` on CUDA device `cuda_device`.
OOMGUARD_EXPORT StatusOr<std::unique_ptr<Coordinator>> MakeNcclCoordinator(int rank, int size, const NcclId& id,
                                                                           int cuda_device);

}  // namespace oomguard

#endif  // OOMGUARD_NCCL_COORDINATOR_H_
