// Checkpointer: sharded asynchronous checkpoints (format "oomguard-ckpt/2",
// HDF5, shuffle + zstd when it pays) and the RecoveryStore the guard rolls back through.
//
//   oomguard::CheckpointOptions o;
//   o.dir = "/ckpt";  o.every_steps = 100;  o.keep = 3;
//   auto ckpt = oomguard::Checkpointer::Create(o).value();
//   ckpt->AddTensor("model/fc1.weight", oomguard::DType::kFloat32, {1024, 512}, w);
//   ckpt->AddObject("optimizer/adam", save_fn, load_fn);
//   guard_options.recovery = ckpt.get();       // saves every N steps, rolls back
//   auto resumed = guard->Resume();            // kNotFound on a fresh directory
// (libtorch: oomguard/torch.h registers a module, an optimizer and an LR
// scheduler exactly.) Without a directory (o.dir empty) the checkpointer keeps
// its saves in memory only, which is enough for the guard's rollbacks.
//
// Layout on disk (one directory per step, one shard per rank):
//   <dir>/step-00000100/rank-00000.h5   tensors at /<state>/<tensor>
//   <dir>/step-00000100/MANIFEST.json   the commit marker, written last
// A checkpoint counts only when its manifest exists, names this world size,
// and every shard and tensor checksum verifies (docs/checkpoints.md).
//
// Save: SaveAsync blocks only while the registered state is copied into
// staging buffers; shuffle + zstd compression (a thread pool, outside the HDF5
// lock), the chunk writes, fsync/rename and the manifest commit run in the
// background. The last staged state stays in host memory (when the staging
// budget allows), so an OOM inside the optimizer step rolls back without I/O.
//
// Thread-safety: the registration, save, load and RecoveryStore methods are
// called from one (training) thread. Stats() may be called from any thread.
// Registered buffers must not
// be written while SaveAsync runs (it copies them) and must stay valid until
// the Checkpointer is destroyed.
#ifndef OOMGUARD_CHECKPOINT_H_
#define OOMGUARD_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "oomguard/dtype.h"
#include "oomguard/export.h"
#include "oomguard/recovery.h"
#include "oomguard/status.h"

namespace oomguard {

class IncidentSink;

// The format this version writes. Format 2 adds per-chunk hashes and a
// digest of the shard built from them (docs/checkpoints.md); format 1
// checkpoints are still read.
inline constexpr std::string_view kCheckpointFormat = "oomguard-ckpt/2";
// The most threads CheckpointOptions::threads and stage_threads may ask for:
// more than any machine has cores to give a checkpoint, few enough that
// starting them cannot exhaust the process's threads.
inline constexpr int kMaxCheckpointThreads = 256;
inline constexpr std::string_view kCheckpointFormatV1 = "oomguard-ckpt/1";
// The HDF5 filter id registered for Zstandard.
inline constexpr int kZstdFilterId = 32015;

// Where a registered tensor lives.
enum class MemoryLocation { kHost, kCuda };

// Who writes a checkpoint's MANIFEST.json, the marker that makes it count.
enum class ManifestCommit {
  // One rank (world_size 1): kLocal. Several: kCoordinated — a rank alone
  // must never commit a step the others may not have written.
  kAuto,
  // This process, as soon as its own shard is durable (ranks that share nothing).
  kLocal,
  // Rank 0, through RecoveryStore::Commit, once the guard's vote shows every
  // rank's shard of the step durable (a shared filesystem).
  kCoordinated,
};

// How a save compresses its shard (recorded in the shard and the manifest).
enum class CheckpointCompression {
  // Decided per save from measurements: shuffle + zstd at compression_level
  // when compressing a sample of the state runs fast enough that the save
  // would finish sooner than writing the bytes as they are (measured write +
  // fsync throughput of this Checkpointer's previous saves), else none. A
  // state under 32 MiB is always compressed (fsync latency, not throughput,
  // sets its save time); the first larger save writes uncompressed, which
  // measures the write throughput. docs/checkpoints.md.
  kAuto,
  // Chunks stored as they are (no filters).
  kNone,
  // Always shuffle + zstd at compression_level.
  kZstd,
};

struct CheckpointOptions {
  // Directory holding step-NNNNNNNN/ subdirectories (created if missing).
  // Empty: in memory only. A save (SaveAsync, and so the every_steps and
  // after-recovery triggers) then copies the state into the in-memory
  // snapshot, replacing the previous one, and writes nothing; the guard rolls
  // back to it (an OOM in the optimizer step, or at the smallest
  // micro-batch) exactly as to a checkpoint on disk. LoadLatest and Load
  // return kNotFound, and nothing survives the process. keep_snapshot must
  // stay on.
  std::string dir;
  // This process's rank and the number of ranks writing one checkpoint.
  int rank = 0;
  int world_size = 1;
  // OnStepCommitted saves after every `every_steps` steps (step % N == N-1). 0: never by count.
  int64_t every_steps = 0;
  // OnStepCommitted also saves right after an OOM was recovered at a reduced size.
  bool save_after_recovery = true;
  // Complete checkpoints kept on disk (the newest complete one is never deleted). 0: keep all.
  int keep = 3;
  // Whether shards are compressed (see CheckpointCompression).
  CheckpointCompression compression = CheckpointCompression::kAuto;
  // zstd level when a shard is compressed, stored in cd_values[0]: [-7, -1]
  // (faster) or [1, 22].
  int compression_level = 1;
  // Target uncompressed bytes per HDF5 chunk (and per compression task).
  int64_t chunk_bytes = 1 << 20;
  // Compression/decompression threads. 0: hardware concurrency, at most 8.
  // At most kMaxCheckpointThreads.
  int threads = 0;
  // Threads that copy host tensors into the staging buffers during
  // SaveAsync's blocking part, the calling thread included (one memcpy
  // stream rarely saturates memory bandwidth). 0: hardware concurrency, at
  // most 4; 1: the calling thread alone. At most kMaxCheckpointThreads.
  int stage_threads = 0;
  // Upper bound on host bytes held by staging buffers (the retained snapshot
  // included). 0: unlimited. A state larger than the budget is staged in
  // pieces: SaveAsync then blocks until the last piece is staged and no
  // in-memory snapshot is kept.
  int64_t staging_budget_bytes = 0;
  // Keep the last staged state in host memory for instant rollback.
  bool keep_snapshot = true;
  // Who writes MANIFEST.json, the commit marker (see ManifestCommit).
  ManifestCommit manifest_commit = ManifestCommit::kAuto;
  // fsync files and directories (off only for tests on tmpfs-like scratch).
  bool fsync = true;
  // Verify the whole-file xxh3 of each shard before loading it (tensor
  // checksums are always verified).
  bool verify_file_checksum = true;
  // Corrupt checkpoints met while loading are recorded here. Not owned.
  IncidentSink* incidents = nullptr;
  // CUDA tensors: the streams (cudaStream_t values) whose queued work the
  // staging and restore copies must wait for, asked at the start of each
  // batch of copies. Not set, or empty: the legacy default stream. Training
  // that writes its parameters on other streams (PyTorch's current stream
  // when it is not the default one) must name them here; the Python
  // Checkpointer passes torch's current stream.
  std::function<std::vector<void*>()> cuda_streams;
};

struct CheckpointStats {
  int64_t saves_started = 0;
  int64_t checkpoints_written = 0;  // shards made durable by this process
  int64_t manifests_committed = 0;
  int64_t save_failures = 0;
  int64_t restores_from_memory = 0;
  int64_t restores_from_disk = 0;
  int64_t corrupt_skipped = 0;   // checkpoints skipped by loads as corrupt
  int64_t state_bytes = 0;       // uncompressed bytes of one save
  int64_t last_file_bytes = 0;   // bytes of the last shard written
  std::vector<double> stall_ms;  // blocking time of each SaveAsync
  // Staging buffers SaveAsync had to allocate and fault in inside its stall.
  // The writer prepares the next one in the background, so after the first
  // save this stays put unless the staging budget forbids a spare.
  int64_t stall_allocations = 0;
  double last_write_ms = 0;      // background time of the last save (compress + write + commit)
  // The last shard's compression ("none" or "zstd-<level>") and, when
  // compression = auto chose it, why: a JSON object of what it measured
  // (as recorded in the manifest's "auto").
  std::string last_compression;
  std::string last_compression_auto;
  Status last_error;             // the newest background failure
};

class OOMGUARD_EXPORT Checkpointer : public RecoveryStore {
 public:
  // Validates the options, creates the directory and finds the committed
  // checkpoints in it (DurableSteps()).
  static StatusOr<std::unique_ptr<Checkpointer>> Create(const CheckpointOptions& options);
  // Waits for background saves to finish.
  ~Checkpointer() override;

  // ---- registration (before the first save or load) ----
  // Both return kFailedPrecondition, naming the path, once a save, snapshot,
  // load or restore has begun: a path added later would be missing from the
  // checkpoints already taken (every later load of them would fail), or keep
  // its fresh value after a load.
  // A tensor at HDF5 path /<path> ("model/fc1.weight"). `data` holds
  // prod(shape) elements, row-major; an empty shape is a scalar. kCuda: device
  // memory, staged into pinned host buffers on a side stream that waits for the
  // work of CheckpointOptions::cuda_streams (SaveAsync returns once the copies
  // landed); needs a CUDA build (kUnimplemented) and a visible GPU
  // (kUnavailable); every CUDA tensor of one checkpointer on one device.
  // REQUIRES: data stays valid for the Checkpointer's life.
  virtual Status AddTensor(std::string path, DType dtype, std::vector<int64_t> shape, void* data,
                           MemoryLocation location = MemoryLocation::kHost) = 0;
  // A stateful object with its own serialisation (optimizer scalars, RNG
  // state, data position). `save` runs on the training thread during staging;
  // `load` receives exactly the bytes `save` returned.
  virtual Status AddObject(std::string path, std::function<std::vector<uint8_t>()> save,
                           std::function<Status(std::span<const uint8_t>)> load) = 0;

  // ---- saving ----
  // Stages the registered state as step `step` and returns; the rest runs in
  // the background. Blocks longer only when the staging budget is exhausted
  // (back-pressure) or the state is staged in pieces. A failure, in staging
  // or in the background, is logged, counted in Stats() and returned by
  // Wait() unless a later save became durable since. kInvalidArgument (not a
  // failed save) for a step outside [0, kMaxStep]. A std::exception of a save
  // callback, a fault point or an allocation is returned as a status
  // (kResourceExhausted for running out of memory); any other exception (the
  // host language's own, such as a Python KeyboardInterrupt carried through a
  // save callback) is counted as a failed save and rethrown.
  virtual Status SaveAsync(int64_t step) = 0;
  // Waits until every started save is durable (and committed when local).
  // Returns the error of the newest save when it failed; an error that a
  // later durable save superseded is not returned (Stats() keeps it), and
  // waiting does not clear it: the next Wait reports it again.
  Status Wait() override = 0;

  // ---- loading ----
  // Loads the newest checkpoint that verifies; corrupt ones are skipped with
  // a warning naming the file and tensor. Returns its step. kNotFound when the
  // directory holds no committed checkpoint, kDataLoss when none verifies.
  // On error the registered state may be partly overwritten. kNotFound too
  // for a checkpointer in memory only (CheckpointOptions::dir empty).
  // To continue a guarded run, prefer Guard::Resume (it agrees on the step
  // with every rank and sets the guard's step): LoadLatest is for a
  // checkpointer used without a guard (evaluation, export, tools).
  virtual StatusOr<int64_t> LoadLatest() = 0;
  // Loads exactly `step` (kDataLoss when it does not verify).
  virtual StatusOr<int64_t> Load(int64_t step) = 0;

  virtual CheckpointStats Stats() const = 0;
  virtual const CheckpointOptions& options() const = 0;

  // RecoveryStore::Commit: with coordinated commit, the guard on rank 0 calls
  // this once every rank's shard of `step` is durable: writes
  // <dir>/step-S/MANIFEST.json naming `world_size` shards (their bytes and
  // hashes read from the shared filesystem), then applies retention. A no-op
  // with local commit. Never throws.
  Status Commit(int64_t step, int world_size) override = 0;

  // ---- RecoveryStore (the guard's view) ----
  // The committed checkpoints whose shard of this rank exists, and
  // (coordinated commit) this rank's durable shards not yet committed (at
  // most the newest 16).
  std::vector<int64_t> DurableSteps() override = 0;
  // The last staged state, kept in host memory (when keep_snapshot is on and
  // the staging budget holds it).
  std::optional<int64_t> SnapshotStep() override = 0;
  Status Snapshot(int64_t step) override = 0;
  // The snapshot when it holds `step`, else checkpoint `step` from disk,
  // which must be committed and verify; never another step.
  Status Restore(int64_t step) override = 0;
  // SaveAsync on the triggers of the options (CheckpointOptions).
  Status OnStepCommitted(int64_t step, bool after_recovery) override = 0;
};

// ---- offline inspection (the CLI, tools, tests); any thread ----

struct TensorInfo {
  std::string path;  // "/model/fc1.weight"
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> chunk;        // chunk dims (empty: not chunked)
  int64_t bytes = 0;                 // uncompressed
  int64_t stored_bytes = 0;          // on disk
  std::string xxh3;                  // the stored attribute
  std::vector<std::string> filters;  // "shuffle", "zstd(level=1)", ...
};

struct ShardInfo {
  std::string file;
  std::string format;
  int64_t step = -1;
  int rank = -1;
  int world_size = -1;
  int64_t file_bytes = 0;
  std::vector<TensorInfo> tensors;
};

struct CheckpointInfo {
  int64_t step = -1;
  std::string dir;         // the step directory
  bool committed = false;  // MANIFEST.json exists and parses
  int world_size = -1;     // from the manifest
  int64_t created_unix = 0;
  int64_t bytes = 0;                // sum of shard bytes in the manifest (or on disk when uncommitted)
  std::vector<std::string> shards;  // shard files present
  std::string problem;              // why the manifest did not parse ("" : none)
};

// Every step directory under `dir`, oldest first.
OOMGUARD_EXPORT StatusOr<std::vector<CheckpointInfo>> ListCheckpoints(const std::string& dir);

// Verifies checkpoint `step` fully: manifest, world size (when
// expected_world_size > 0), every shard's size and xxh3, every tensor's xxh3.
// OK, or kDataLoss / kNotFound naming the file and tensor. `progress` (may
// be null) is called with bytes verified so far and the total.
OOMGUARD_EXPORT Status VerifyCheckpoint(const std::string& dir, int64_t step, int expected_world_size = -1,
                                        const std::function<void(int64_t, int64_t)>& progress = nullptr);

// The attributes, datasets, filters and checksums of one shard file.
OOMGUARD_EXPORT StatusOr<ShardInfo> InspectShard(const std::string& file);

}  // namespace oomguard

#endif  // OOMGUARD_CHECKPOINT_H_
