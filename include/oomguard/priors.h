// MicroBatchPriors: what a guard learns about a workload and remembers across
// runs. The knowledge base implements it; a guard given one (GuardOptions.priors)
// with a workload signature starts from what ran before for that signature,
// instead of hitting the same OOMs again: with the predictive controller from
// the memory model it fitted (so that on a device of another size, or with
// less free memory, it starts at the size that fits there), else at the
// largest micro-batch that ran clean.
//
// Thread-safety: implementations may be called from several guards at once.
// RecordCleanMicroBatch and RecordModel are called after every clean step on
// the training thread: they must be cheap and must not block on I/O.
#ifndef OOMGUARD_PRIORS_H_
#define OOMGUARD_PRIORS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

// The predictive policy's model (SizeController, size_controller.h); what learned priors store, so that a later
// run (on another device too) starts from it.
struct SizeModel {
  double fixed_bytes = 0;         // a micro-batch's own memory whatever its size (workspaces)
  double unit_bytes = 0;          // its memory per unit of size (> 0 in a usable model)
  double overhead_bytes = 0;      // allocator reserve beyond the peak, the part whatever the size
  double overhead = 0;            // ... and the share of the micro-batch's memory, known to suffice
  double overhead_too_small = 0;  // a share known not to suffice (0: none known)
  double noise_bytes = 0;         // what the fit does not explain; the headroom follows it
};

// The key under which the guard of rank `rank` of `world_size` keeps the
// priors of `workload`: the workload itself on one rank, "<workload> [rank
// r/n]" on several. Ranks may differ in memory (rank imbalance, pipeline
// stages), so one rank's OOM must not set another rank's starting size; and
// a knowledge base shared by the ranks of a job keeps each rank's lesson
// apart. The guard asks and records under this key; the knowledge base
// matches an incident (workload, rank, world_size) to it.
OOMGUARD_EXPORT std::string PriorKey(const std::string& workload, int rank, int world_size);

class OOMGUARD_EXPORT MicroBatchPriors {
 public:
  virtual ~MicroBatchPriors();
  // The largest micro-batch that ran clean for `workload`, if known.
  virtual std::optional<int64_t> PriorMicroBatch(const std::string& workload) = 0;
  // A step of `workload` completed with micro-batches of up to `size`.
  virtual Status RecordCleanMicroBatch(const std::string& workload, int64_t size) = 0;

  // The memory model learned for `workload` (SizeController::model()), if
  // known. The default knows none.
  virtual std::optional<SizeModel> PriorModel(const std::string& workload);
  // A step of `workload` completed with the controller's model as it is now.
  // The default keeps nothing.
  virtual Status RecordModel(const std::string& workload, const SizeModel& model);
};

}  // namespace oomguard

#endif  // OOMGUARD_PRIORS_H_
