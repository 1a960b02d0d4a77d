// Out-of-line anchors (vtables, type_info) of the interfaces that components
// implement across the dependency graph, and the names of shared enums.
#include "oomguard/incident.h"
#include "oomguard/priors.h"
#include "oomguard/recovery.h"

namespace oomguard {

IncidentSink::~IncidentSink() = default;
RecoveryStore::~RecoveryStore() = default;
MicroBatchPriors::~MicroBatchPriors() = default;
std::optional<SizeModel> MicroBatchPriors::PriorModel(const std::string&) { return std::nullopt; }
Status MicroBatchPriors::RecordModel(const std::string&, const SizeModel&) { return Status::Ok(); }

std::string_view LadderActionName(LadderAction a) {
  switch (a) {
    case LadderAction::kRelease: return "release";
    case LadderAction::kHalve: return "halve";
    case LadderAction::kRollback: return "rollback";
    case LadderAction::kGiveUp: return "give_up";
  }
  return "unknown";
}

std::string_view IncidentOutcomeName(IncidentOutcome o) {
  switch (o) {
    case IncidentOutcome::kPending: return "pending";
    case IncidentOutcome::kRecovered: return "recovered";
    case IncidentOutcome::kRolledBack: return "rolled_back";
    case IncidentOutcome::kFailed: return "failed";
  }
  return "unknown";
}

}  // namespace oomguard
