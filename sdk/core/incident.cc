// The incident vocabulary (incident.h): names and their inverses, the sink's
// anchor, and IsKnown. In the core because the guard writes incidents, the
// knowledge base reads and stores them, and the checkpointer records its own.
#include "oomguard/incident.h"

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace oomguard {
namespace {

// One table per enum, in enumerator order, so that a name and its inverse
// cannot disagree.
constexpr std::array<std::pair<Phase, std::string_view>, 11> kPhases = {{
    {Phase::kUnknown, "unknown"},
    {Phase::kData, "data"},
    {Phase::kForward, "forward"},
    {Phase::kBackward, "backward"},
    {Phase::kOptimizer, "optimizer"},
    {Phase::kCommit, "commit"},
    {Phase::kCheckpoint, "checkpoint"},
    {Phase::kInit, "init"},
    {Phase::kLoad, "load"},
    {Phase::kEval, "eval"},
    {Phase::kComm, "comm"},
}};
constexpr std::array<std::pair<IncidentKind, std::string_view>, 5> kKinds = {{
    {IncidentKind::kUnknown, "unknown"},
    {IncidentKind::kDevice, "device"},
    {IncidentKind::kHost, "host"},
    {IncidentKind::kWorkspace, "workspace"},
    {IncidentKind::kCoordination, "coordination"},
}};
constexpr std::array<std::pair<LadderAction, std::string_view>, 5> kActions = {{
    {LadderAction::kNone, "none"},
    {LadderAction::kRelease, "release"},
    {LadderAction::kHalve, "halve"},
    {LadderAction::kRollback, "rollback"},
    {LadderAction::kGiveUp, "give_up"},
}};
constexpr std::array<std::pair<IncidentOutcome, std::string_view>, 5> kOutcomes = {{
    {IncidentOutcome::kUnknown, "unknown"},
    {IncidentOutcome::kPending, "pending"},
    {IncidentOutcome::kRecovered, "recovered"},
    {IncidentOutcome::kRolledBack, "rolled_back"},
    {IncidentOutcome::kFailed, "failed"},
}};

template <typename E, size_t N>
std::string_view NameIn(const std::array<std::pair<E, std::string_view>, N>& table, E value) {
  for (const auto& [e, name] : table)
    if (e == value) return name;
  return table[0].second;  // a value cast from an out-of-range integer reads as the unknown one
}

template <typename E, size_t N>
std::optional<E> ParseIn(const std::array<std::pair<E, std::string_view>, N>& table, std::string_view name) {
  for (const auto& [e, n] : table)
    if (n == name) return e;
  return std::nullopt;
}

}  // namespace

std::string_view PhaseName(Phase p) { return NameIn(kPhases, p); }
std::string_view IncidentKindName(IncidentKind k) { return NameIn(kKinds, k); }
std::string_view LadderActionName(LadderAction a) { return NameIn(kActions, a); }
std::string_view IncidentOutcomeName(IncidentOutcome o) { return NameIn(kOutcomes, o); }

std::optional<Phase> ParsePhase(std::string_view name) { return ParseIn(kPhases, name); }
std::optional<IncidentKind> ParseIncidentKind(std::string_view name) { return ParseIn(kKinds, name); }
std::optional<LadderAction> ParseLadderAction(std::string_view name) { return ParseIn(kActions, name); }
std::optional<IncidentOutcome> ParseIncidentOutcome(std::string_view name) { return ParseIn(kOutcomes, name); }

bool IsKnown(const Incident& incident, std::string_view field) {
  for (const std::string& u : incident.unknown)
    if (u == field) return false;
  return true;
}

// Out of line so that the interface's vtable and type_info live in this library.
IncidentSink::~IncidentSink() = default;

}  // namespace oomguard
