// RecoveryStore: what the guard can roll back to when splitting is not enough.
//
// The guard uses it on the rollback rung of the escalation ladder:
//   - an OOM inside the optimizer apply may have left parameters half updated;
//   - an OOM at the minimum micro-batch: the step cannot be done here.
// In both cases every rank restores the same step: the newest one that every
// rank can restore (from its in-memory snapshot or from durable storage),
// chosen by the guard from what each rank reports here, restored exactly, and
// confirmed by all ranks afterwards (docs/distributed.md). The checkpointer
// implements this interface; without one the guard gives up with
// kResourceExhausted at that rung.
//
// Step numbers name the state *after* that step committed; the state before a
// run's first step is step first_step - 1 (-1 for a run that starts at 0).
//
// Thread-safety: called on the training thread only.
#ifndef OOMGUARD_RECOVERY_H_
#define OOMGUARD_RECOVERY_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

// The largest step number. Steps are 0 .. kMaxStep: checkpoints name their
// directories after the step in at most 16 digits ("step-00000100"), and a
// guard's step counter never reaches a number that could not be saved and
// loaded again. A negative step is only ever the state before a run's first
// step (-1), which is kept in memory, never written.
inline constexpr int64_t kMaxStep = 9'999'999'999'999'999;

class OOMGUARD_EXPORT RecoveryStore {
 public:
  virtual ~RecoveryStore();

  // The steps whose state this rank holds durably (its own part written and
  // synced, committed or not), ascending. Steps whose part was lost (removed
  // by retention, a failed write) are not listed.
  virtual std::vector<int64_t> DurableSteps() = 0;
  // The step of the in-memory snapshot, if one is held.
  virtual std::optional<int64_t> SnapshotStep() = 0;
  // Keeps a copy of the registered state in memory as the state after `step`
  // (nothing is written). The guard calls it before the first optimizer apply
  // when no other restorable state exists, so that an OOM in the very first
  // apply (optimizer state allocation) rolls back instead of giving up.
  // kUnimplemented by default.
  virtual Status Snapshot(int64_t step) {
    (void)step;
    return Status::Unimplemented("this RecoveryStore keeps no in-memory snapshot");
  }
  // Restores exactly the state of `step` into the registered state: the
  // in-memory snapshot when it holds that step, else durable storage. Never
  // another step: kDataLoss or kNotFound when `step` cannot be restored.
  virtual Status Restore(int64_t step) = 0;
  // Step `step` committed on every rank. `after_recovery`: some rank recovered
  // an OOM in this step (a good moment to save). Must not block beyond staging.
  virtual Status OnStepCommitted(int64_t step, bool after_recovery) = 0;
  // Blocks until the saves in flight are durable or failed. Returns the error
  // of the newest save when it failed (an error superseded by a later durable
  // save is not returned).
  virtual Status Wait() { return Status::Ok(); }
  // Called on rank 0 when `step` is durable on every rank: write the commit
  // marker (a single process commits its own checkpoints and can ignore this).
  virtual Status Commit(int64_t step, int world_size) {
    (void)step;
    (void)world_size;
    return Status::Ok();
  }
};

}  // namespace oomguard

#endif  // OOMGUARD_RECOVERY_H_
