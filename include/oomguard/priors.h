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
#include "oomguard/size_controller.h"
#include "oomguard/status.h"

namespace oomguard {

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
