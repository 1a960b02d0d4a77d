// RecoveryStore: what the guard can roll back to when splitting is not enough.
//
// The guard uses it on two rungs of the escalation ladder:
//   - an OOM inside commit (optimizer step) may have left parameters half
//     updated: RestoreSnapshot() puts back the last complete in-memory state;
//   - an OOM at the minimum micro-batch: the step cannot be done here, so every
//     rank restores the newest checkpoint that is complete everywhere.
// The checkpointer implements this interface; without one the guard gives up
// with kResourceExhausted at those rungs.
//
// Thread-safety: called on the training thread only.
#ifndef OOMGUARD_RECOVERY_H_
#define OOMGUARD_RECOVERY_H_

#include <cstdint>

#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

class OOMGUARD_EXPORT RecoveryStore {
 public:
  virtual ~RecoveryStore();
  // Newest step whose state this rank has made durable (its shard is written
  // and synced; with several ranks the manifest may still be pending) (-1: none).
  virtual int64_t DurableStep() = 0;
  // Restores the state of `step` (a durable checkpoint, or the in-memory
  // snapshot when it holds that step) into the registered state. Returns the
  // step restored. kDataLoss when nothing usable exists.
  virtual StatusOr<int64_t> Restore(int64_t step) = 0;
  // The step of the newest in-memory snapshot (-1: none).
  virtual int64_t SnapshotStep() = 0;
  // Step `step` committed. `after_recovery`: an OOM was recovered at a reduced
  // size in this step (a good moment to save). Must not block beyond staging.
  virtual Status OnStepCommitted(int64_t step, bool after_recovery) = 0;
  // Blocks until the saves in flight are durable, then returns DurableStep().
  // Used when ranks must agree on a rollback target that only the disk has.
  virtual int64_t WaitDurable() { return DurableStep(); }
  // Multi-rank: called on rank 0 once every rank's state of `step` is durable
  // (the min of DurableStep() over ranks reached it): write the commit marker.
  // A single process commits its own checkpoints and can ignore this.
  virtual Status CommitDurable(int64_t step, int world_size) {
    (void)step;
    (void)world_size;
    return Status::Ok();
  }
};

}  // namespace oomguard

#endif  // OOMGUARD_RECOVERY_H_
