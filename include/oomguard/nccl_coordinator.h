// The NCCL engine of the Coordinator interface (optional target
// oomguard::nccl, built when OOMGUARD_WITH_NCCL is on). For GPU jobs that
// already use NCCL and want no second communication stack.
//
// The communicator is non-blocking: joining and each collective are polled
// (ncclCommGetAsyncError, then a CUDA event after the copy into pinned host
// memory) until done or until the deadline; on a timeout the communicator is
// aborted (ncclCommAbort) so that no rank stays inside it, and the
// coordinator returns kUnavailable from then on. Every buffer a collective
// needs, and NCCL's own (a warm-up all-reduce), is allocated at creation, so
// a vote after an out-of-memory error allocates nothing. AllreduceSum takes
// device buffers of the coordinator's GPU (float16, bfloat16, float32,
// float64, int64; scales applied inside the reduction) and up to 64 KiB of
// host buffers.
//
// Thread-safety: one thread per rank calls the coordinator.
#ifndef OOMGUARD_NCCL_COORDINATOR_H_
#define OOMGUARD_NCCL_COORDINATOR_H_

#include <array>
#include <chrono>
#include <memory>

#include "oomguard/coordinator.h"
#include "oomguard/export.h"

namespace oomguard {

// The 128 bytes of an ncclUniqueId. Rank 0 creates it; the launcher's own
// channel (MPI, torch.distributed's store, a shared file) hands it to the others.
using NcclId = std::array<char, 128>;

// kUnavailable when no GPU is visible, kUnimplemented when built without NCCL.
OOMGUARD_EXPORT StatusOr<NcclId> NewNcclId();

// Joins the NCCL communicator `id` as `rank` of `size` on CUDA device
// `cuda_device`. Collective: every rank calls it. kUnavailable when the other
// ranks do not join within `deadline`.
OOMGUARD_EXPORT StatusOr<std::unique_ptr<Coordinator>> MakeNcclCoordinator(
    int rank, int size, const NcclId& id, int cuda_device,
    std::chrono::milliseconds deadline = std::chrono::milliseconds(60000));

}  // namespace oomguard

#endif  // OOMGUARD_NCCL_COORDINATOR_H_
