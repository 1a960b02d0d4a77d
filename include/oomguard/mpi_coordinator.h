// The MPI engine of the Coordinator interface (optional target oomguard::mpi,
// built when OOMGUARD_WITH_MPI is on).
//
// Collectives are non-blocking MPI operations (MPI_Iallreduce, MPI_Iallgather,
// MPI_Ibarrier, MPI_Ibcast) polled with MPI_Test until done or until the
// deadline, so that a rank that died or hangs turns into kUnavailable instead
// of a hang. After a timeout the pending operation cannot be cancelled: exit
// the process with kExitCoordinationTimeout without calling MPI_Finalize (the
// launcher then ends and restarts every rank).
//
// Thread-safety: one thread per process calls the coordinator (MPI is
// initialised with MPI_THREAD_FUNNELED when oomguard initialises it).
#ifndef OOMGUARD_MPI_COORDINATOR_H_
#define OOMGUARD_MPI_COORDINATOR_H_

#include <memory>

#include "oomguard/coordinator.h"
#include "oomguard/export.h"

namespace oomguard {

// A coordinator over MPI_COMM_WORLD (duplicated, so its traffic never mixes
// with the application's). Initialises MPI when the application has not, and
// then finalises it at process exit. kUnavailable when MPI cannot start.
OOMGUARD_EXPORT StatusOr<std::unique_ptr<Coordinator>> MakeMpiCoordinator();

}  // namespace oomguard

#endif  // OOMGUARD_MPI_COORDINATOR_H_
