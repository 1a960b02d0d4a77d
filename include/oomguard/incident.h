// Incident: the record of one out-of-memory event, as the guard saw it and as
// the knowledge base stores and exchanges it (JSON key names follow the field
// names; memory keys follow torch.cuda.memory_stats where they overlap).
//
// Where a field has a fixed vocabulary (phase, kind, action, outcome) it is an
// enum; its strings (PhaseName, ...) appear only where incidents leave C++:
// JSON, SQLite, log lines, the command line and Python.
//
// IncidentSink is where the guard hands incidents. Record is called on the
// training thread at the moment of the OOM and must not block on I/O;
// UpdateOutcome follows once the recovery finished (or failed).
//
// Thread-safety: the functions are pure; a sink may be called from several
// guards (threads) at once.
#ifndef OOMGUARD_INCIDENT_H_
#define OOMGUARD_INCIDENT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "oomguard/export.h"
#include "oomguard/oom_error.h"

namespace oomguard {

// Where in the run an OOM happened. User code marks the phases of a step
// with Guard::MarkPhase (kData to kCheckpoint). The log importer also reads
// kInit (model set-up), kLoad (restoring a checkpoint), kEval (evaluation)
// and kComm (a collective) off a traceback; the guard records a failed
// collective of its own as kComm.
enum class Phase {
  kUnknown,
  kData,
  kForward,
  kBackward,
  kOptimizer,
  kCommit,
  kCheckpoint,
  kInit,
  kLoad,
  kEval,
  kComm,
};

// What ran out: device memory, host memory, or a library's scratch space.
// kCoordination is not an OOM: a peer rank did not answer or the ranks'
// collectives diverged, which the guard records as an incident too.
// kUnknown: a record (imported from another tool) that did not say.
enum class IncidentKind { kUnknown, kDevice, kHost, kWorkspace, kCoordination };

// The rung of the escalation ladder an incident took. kNone: no rung was
// recorded (an imported incident).
enum class LadderAction { kNone, kRelease, kHalve, kRollback, kGiveUp };

// How the recovery ended. The guard records kPending at the OOM and one of
// the others when the step ends. kUnknown: not recorded (an imported incident).
enum class IncidentOutcome { kUnknown, kPending, kRecovered, kRolledBack, kFailed };

// The strings of JSON, SQLite, log lines and Python: "forward", "device",
// "halve", "rolled_back", ... and "unknown" (or "none" for LadderAction::kNone).
// They view string literals, so data() is a C string.
OOMGUARD_EXPORT std::string_view PhaseName(Phase p);
OOMGUARD_EXPORT std::string_view IncidentKindName(IncidentKind k);
OOMGUARD_EXPORT std::string_view LadderActionName(LadderAction a);
OOMGUARD_EXPORT std::string_view IncidentOutcomeName(IncidentOutcome o);

// The inverse of the names above; nullopt for any other string.
OOMGUARD_EXPORT std::optional<Phase> ParsePhase(std::string_view name);
OOMGUARD_EXPORT std::optional<IncidentKind> ParseIncidentKind(std::string_view name);
OOMGUARD_EXPORT std::optional<LadderAction> ParseLadderAction(std::string_view name);
OOMGUARD_EXPORT std::optional<IncidentOutcome> ParseIncidentOutcome(std::string_view name);

struct RankMemory {
  int rank = 0;
  int64_t allocated = 0;
  int64_t reserved = 0;
  int64_t peak_allocated = 0;
};

struct Incident {
  std::string id;                 // unique, 16 hex digits
  std::string run_id;
  int64_t time_unix_ms = 0;
  std::string host;
  int rank = 0;
  int world_size = 1;
  int64_t step = 0;
  int micro_index = -1;
  Phase phase = Phase::kUnknown;
  IncidentKind kind = IncidentKind::kUnknown;
  std::string exception_type;
  std::string message;
  int64_t requested_bytes = 0;
  MemoryStats memory;
  std::vector<int64_t> step_peaks;  // history: recent per-step peak allocated bytes, oldest first
  int64_t steps_ok_before = 0;      // history: clean steps since the previous OOM
  double sample_cost_this = 0;      // largest per-sample cost in the failing micro-batch (0: unknown)
  double sample_cost_median = 0;    // median per-sample cost of the step (0: unknown)
  std::vector<RankMemory> ranks;    // every rank's memory, when more than one rank runs
  int64_t micro_before = 0;
  int64_t micro_after = 0;
  LadderAction action = LadderAction::kNone;           // the rung that decided the incident
  IncidentOutcome outcome = IncidentOutcome::kUnknown;
  double recovery_ms = 0;
  std::string workload;           // workload signature
  std::vector<LadderAction> actions;  // every ladder rung taken for this incident, in order
  bool injected = false;          // raised by fault injection
  FrameworkEvidence framework;    // what the framework's binding saw at the OOM (oom_error.h)
  // Where an imported record came from (the log importer sets these; the
  // guard leaves them empty):
  std::string source;             // "logs/train.log:412": file and line of the OOM
  std::string context;            // the source text around the OOM (traceback, log lines), <= 16 KiB
  // Fields the source did not hold: "step", "steps_ok_before", "rank". The
  // classifier never reads an unknown field as zero. Figures such as
  // memory.total or requested_bytes are unknown when 0 and need no entry; the
  // guard knows every field and leaves this empty.
  std::vector<std::string> unknown;
  // Filled by the classifier (knowledge base):
  std::string pattern;
  double confidence = 0;
  std::string evidence;
  std::vector<std::string> remedies;
  std::string fingerprint;
};

// True unless `field` is listed in incident.unknown.
OOMGUARD_EXPORT bool IsKnown(const Incident& incident, std::string_view field);

class OOMGUARD_EXPORT IncidentSink {
 public:
  virtual ~IncidentSink();
  // Must not block on disk or network; may drop (and count) under pressure.
  virtual void Record(const Incident& incident) = 0;
  // The recovery of incident `id` finished (outcome, recovery_ms, micro_after, actions set).
  virtual void UpdateOutcome(const Incident& incident) = 0;
};

}  // namespace oomguard

#endif  // OOMGUARD_INCIDENT_H_
