// KnowledgeBase: the incident knowledge base. Every OOM the guard survives is
// stored in a SQLite file (WAL mode), classified into a known pattern with
// evidence and remedies, fingerprinted into groups of recurring incidents, and
// used to learn, per workload signature, the largest micro-batch that ran clean
// (a "prior" that the next run starts from).
//
//   auto kb = oomguard::KnowledgeBase::Open("incidents.db").value();
//   oomguard::GuardOptions o;
//   o.workload = "mlp-h256-fp64";
//   o.incidents = kb->sink();
//   o.priors = kb.get();   // the guard starts from the learned size and records clean steps itself
//   ... at the end: (void)kb->Flush();
// (PriorMicroBatch and RecordCleanMicroBatch are what the guard calls through
// GuardOptions::priors; call them yourself only without a guard.)
//
// Writes from sink() and RecordCleanMicroBatch go through one bounded queue
// drained by a background writer thread: the training thread copies the
// incident and returns (a few microseconds); it never waits on disk, on a
// lock held by another process, or on classification. When the queue is full
// the incident is dropped and counted (SinkStats.dropped); the count is stored
// in the file the next time the writer gets through. A write that fails (locked
// past busy_timeout_ms, corrupt or full disk) is logged and counted, never
// thrown into the training loop.
//
// Several processes on one host may write one file (SQLite locking, WAL).
// Across hosts, keep one file per host and read them together (the CLI takes
// several --db), or give every job the same PostgreSQL server: a
// postgresql:// URL in place of the path (docs/knowledge_base.md). While the
// server cannot be reached, incidents wait in a bounded on-disk spool
// (KnowledgeBaseOptions.spool_dir) and are sent once it is back, exactly once
// (the store upserts by incident id).
//
// Thread-safety: every method of KnowledgeBase and of its sink may be called
// from any thread. The KnowledgeBase must outlive every Guard using sink().
#ifndef OOMGUARD_KNOWLEDGE_BASE_H_
#define OOMGUARD_KNOWLEDGE_BASE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "oomguard/export.h"
#include "oomguard/incident.h"
#include "oomguard/priors.h"
#include "oomguard/status.h"

namespace oomguard {

// ---- classification ----

// One entry of the pattern catalogue (docs/patterns.md is its long form).
struct PatternInfo {
  std::string name;                   // "fragmentation", ...
  std::string title;                  // one line for humans
  std::string signal;                 // what the pattern looks like in the figures
  std::string rule;                   // the classifier's rule, with its thresholds
  std::vector<std::string> remedies;  // best first, with the seeds' figures
};

// The ten patterns of the catalogue, in a fixed order. The classifier may also
// answer "unknown" (no rule matched), which is not part of the catalogue.
OOMGUARD_EXPORT const std::vector<PatternInfo>& PatternCatalogue();

// What the classifier concluded about one incident.
struct Classification {
  std::string pattern;                // a catalogue name or "unknown"
  double confidence = 0;              // 0..1
  std::string evidence;               // plain words, with the figures that decided
  std::vector<std::string> remedies;  // best first
};

// Classifies an incident from whatever fields it has (missing figures are 0 or
// empty; a PyTorch-style message fills figures the record lacks). Pure function.
OOMGUARD_EXPORT Classification ClassifyIncident(const Incident& incident);

// The grouping fingerprint: 16 lowercase hex digits of XXH3_64bits over the
// grouping version, pattern, kind, phase, workload and the log2 bucket of the
// requested bytes. Never the step, rank id or exact bytes, so recurrences of one
// problem share a fingerprint. Uses incident.pattern as it is (classify first).
OOMGUARD_EXPORT std::string IncidentFingerprint(const Incident& incident);

// Sets pattern, confidence, evidence, remedies and fingerprint of *incident.
OOMGUARD_EXPORT void ClassifyInPlace(Incident* incident);

// ---- JSON exchange format (one object per incident; JSONL: one per line) ----

// The DESIGN.md record: memory{...}, history{step_peaks, steps_ok_before},
// sample_cost{this, median}, ranks[...], ... Compact, one line, no newline.
OOMGUARD_EXPORT std::string IncidentToJson(const Incident& incident);
// Parses one JSON object. Missing fields keep their defaults; unknown fields
// are ignored; a field of the wrong type, a string longer than 64 KiB or an
// array longer than 4096 entries is kInvalidArgument naming the field. A
// missing id is derived from the text (XXH3), so re-importing is idempotent.
OOMGUARD_EXPORT StatusOr<Incident> IncidentFromJson(std::string_view json);

// ---- the store ----

struct KnowledgeBaseOptions {
  // Incidents and prior updates the background queue holds; beyond it they are dropped and counted.
  size_t queue_capacity = 4096;
  // How long a statement waits for another process's lock before it fails (SQLite busy_timeout).
  int busy_timeout_ms = 5000;
  // Create the file (and its schema) when it does not exist.
  bool create_if_missing = true;
  // Classify incidents that arrive without a pattern before storing them (on the writer thread).
  bool classify = true;
  // Open for reading only: never create, migrate or write the file, and leave no -wal/-shm file
  // beside it (a user who may only read the file can browse it). A file that is not an oomguard
  // knowledge base is refused. The sink's operations and Insert fail (counted as lost).
  bool read_only = false;
  // A server (postgresql://): where incidents wait while it cannot be reached, sent once it is
  // back. "" is $OOMGUARD_KB_SPOOL, else ~/.local/state/oomguard/kb-spool/<a hash of the URL>.
  // Jobs that share the directory adopt the files of jobs that ended (crashed) with incidents in it.
  std::string spool_dir;
  // The most the spool directory holds; beyond it incidents are dropped and counted.
  int64_t spool_max_bytes = int64_t{64} << 20;
  // How often the writer retries an unreachable server while incidents wait in the spool.
  int retry_interval_ms = 500;
};

// Counters of the background writer since Open.
struct SinkStats {
  int64_t enqueued = 0;      // Record/UpdateOutcome/RecordCleanMicroBatch calls accepted
  int64_t dropped = 0;       // rejected because the queue was full
  int64_t written = 0;       // operations committed to the file
  int64_t write_errors = 0;  // operations lost because a write failed
  int64_t spooled = 0;       // records (incidents, prior updates) put in the spool while the server was unreachable
  int64_t spool_pending = 0; // of those, still in the spool (sent later, by this job or the next)
  std::string last_error;    // the last write failure ("" when none)

  // Operations that never reached the file: a run whose count is not 0 lost
  // incidents, and should say so in its result (call after Flush()).
  int64_t lost() const { return dropped + write_errors; }
};

// Filters of Query; empty / zero fields do not filter.
struct IncidentQuery {
  std::string pattern;
  std::optional<int> rank;
  std::string run_id;
  std::string workload;
  std::string fingerprint;
  std::string id_prefix;
  std::string id;             // exactly this id
  std::string outcome;        // IncidentOutcomeName: "recovered", "rolled_back", "failed", ...
  // Case-insensitive (ASCII) substring of the searchable fields: id, run,
  // host, message, exception type, pattern, workload, phase, kind, outcome,
  // fingerprint, evidence (the browser's search box).
  std::string text;
  int64_t since_unix_ms = 0;  // time_unix_ms >= since
  int64_t limit = 0;          // newest first; 0: all
  int64_t offset = 0;         // skip this many of the newest first (paging)
};

// Incidents sharing a fingerprint.
struct IncidentGroup {
  std::string fingerprint;
  std::string pattern;
  IncidentKind kind = IncidentKind::kUnknown;
  Phase phase = Phase::kUnknown;
  std::string workload;
  int64_t count = 0;
  int64_t runs = 0;  // distinct run ids
  int64_t first_seen_unix_ms = 0;
  int64_t last_seen_unix_ms = 0;
  std::string last_id;
};

// A learned micro-batch prior.
struct MicroBatchPrior {
  std::string workload;
  int64_t micro_batch = 0;
  int64_t updated_unix_ms = 0;
  std::optional<SizeModel> model;  // the predictive controller's model, when one was recorded
};

// A team's note on a fingerprint group ("fixed by expandable_segments"),
// shown with every incident of the group.
struct GroupNote {
  std::string fingerprint;
  std::string text;
  std::string author;
  int64_t updated_unix_ms = 0;
};

// Totals of one file.
struct KnowledgeBaseStats {
  int schema_version = 0;
  int64_t incidents = 0;
  int64_t dropped_recorded = 0;  // incidents lost to full queues, as recorded in the file
  std::vector<std::pair<std::string, int64_t>> by_pattern;  // count, descending
  std::vector<std::pair<std::string, int64_t>> by_outcome;
  std::vector<std::pair<std::string, int64_t>> by_kind;
  std::vector<MicroBatchPrior> priors;
};

class OOMGUARD_EXPORT KnowledgeBase : public MicroBatchPriors {
 public:
  // The schema version this build writes (older files are migrated on Open).
  static int SchemaVersion();

  // Opens (and creates, migrates) the store at `path`; with options.read_only
  // opens it for reading only. Errors:
  //   kNotFound          the file does not exist and create_if_missing is false (or read_only)
  //   kDataLoss          the file is not an SQLite database (corrupt)
  //   kFailedPrecondition the schema is newer than this build understands; the file is an SQLite
  //                      database but not a knowledge base; read_only and the file is empty;
  //                      not read_only and the file, or its -wal/-shm, is not writable by this user
  //   kUnavailable       another process held the lock past busy_timeout_ms
  //   kInvalidArgument   bad options or path
  // Every message names the path. A postgresql:// URL opens a server instead: kUnavailable
  // when a reader cannot reach it (a writer opens anyway and spools until it answers),
  // kFailedPrecondition for a database that holds other tables, a newer schema or a role
  // without a privilege it needs. Messages show the URL with its password as "***".
  static StatusOr<std::unique_ptr<KnowledgeBase>> Open(const std::string& path,
                                                       const KnowledgeBaseOptions& options = {});

  // Drains the queue (waits up to a few busy timeouts) and stops the writer.
  virtual ~KnowledgeBase();

  // The sink to give GuardOptions.incidents. Owned by this KnowledgeBase.
  virtual IncidentSink* sink() = 0;

  // Waits until everything queued before the call is written. Returns the first
  // write failure since the previous Flush (the operations are lost), or OK.
  // Operations dropped by a full queue are not failures here: sink_stats().lost()
  // counts both.
  virtual Status Flush() = 0;

  // The largest micro-batch known to run clean for `workload`, or nullopt.
  // Reads the file (not the training path: call it before training).
  std::optional<int64_t> PriorMicroBatch(const std::string& workload) override = 0;

  // Notes that a micro-batch of `size` ran clean for `workload`. Queued like
  // Record (never blocks). Once this session recorded a real OOM for the
  // workload, the session's own largest clean size after that OOM replaces
  // the stored prior (memory conditions changed) or creates it. Before that
  // (no OOM, or only injected ones, which say nothing about memory) clean
  // sizes only raise an existing prior: a session that met no limit has
  // learned none, and must not make the next run start lower.
  // kInvalidArgument when workload is empty or size < 1.
  Status RecordCleanMicroBatch(const std::string& workload, int64_t size) override = 0;

  // The memory model last recorded for `workload`, or nullopt. Reads the file.
  std::optional<SizeModel> PriorModel(const std::string& workload) override = 0;
  // Notes the controller's model for `workload`; the latest replaces the
  // stored one. Queued like Record; a model within 1% of the last one this
  // session queued is not written again. kInvalidArgument when workload is
  // empty or the model has no slope (unit_bytes <= 0) or a negative field.
  Status RecordModel(const std::string& workload, const SizeModel& model) override = 0;

  virtual SinkStats sink_stats() const = 0;

  // Synchronous: stores incidents in one transaction (all or none). Classifies
  // those without a pattern when options.classify is set. Existing ids are replaced.
  virtual Status Insert(std::vector<Incident> incidents) = 0;

  virtual StatusOr<std::vector<Incident>> Query(const IncidentQuery& query) = 0;
  virtual StatusOr<std::vector<IncidentGroup>> Groups() = 0;
  virtual StatusOr<KnowledgeBaseStats> Stats() = 0;
  // How many incidents pass the filters of `query` (limit and offset ignored).
  virtual StatusOr<int64_t> Count(const IncidentQuery& query) = 0;

  // Synchronous: sets the note of a fingerprint group (empty text removes it).
  virtual Status SetNote(const GroupNote& note) = 0;
  // Every group's note, by fingerprint.
  virtual StatusOr<std::vector<GroupNote>> Notes() = 0;

  // The file, or the server's URL with its password replaced by "***".
  virtual const std::string& path() const = 0;
};

}  // namespace oomguard

#endif  // OOMGUARD_KNOWLEDGE_BASE_H_
