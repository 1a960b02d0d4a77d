// MicroBatchPriors' anchor (priors.h): its vtable and type_info live here, in
// the core, below both the guard that asks and the knowledge base that answers;
// and the defaults of the model hooks (a priors source that keeps no model).
#include "oomguard/priors.h"

namespace oomguard {

std::string PriorKey(const std::string& workload, int rank, int world_size) {
  if (world_size <= 1) return workload;
  return workload + " [rank " + std::to_string(rank) + "/" + std::to_string(world_size) + "]";
}

MicroBatchPriors::~MicroBatchPriors() = default;
std::optional<SizeModel> MicroBatchPriors::PriorModel(const std::string&) { return std::nullopt; }
Status MicroBatchPriors::RecordModel(const std::string&, const SizeModel&) { return Status::Ok(); }

}  // namespace oomguard
