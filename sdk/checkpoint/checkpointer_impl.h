// CheckpointerImpl: the Checkpointer, shared by the files that implement its
// jobs (private to sdk/checkpoint):
//   checkpointer.cc  creation, registration of the state, options
//   staging.cc       the blocking part of a save: copying the registered state
//                    into staging buffers (whole, or in pieces beyond the
//                    staging budget), and the in-memory snapshot
//   writer.cc        the background writer thread: one shard per save
//   commit.cc        manifests (the commit marker), retention, durable steps
//   loader.cc        loading a checkpoint and restoring a step
//
// Staging buffers (struct StagedState) are recycled: at steady state one holds
// the retained snapshot (instant rollback) and one is being written or spare,
// so a save copies into memory that is already faulted in. The staging budget
// bounds the bytes of all of them together.
//
// Thread-safety: see include/oomguard/checkpoint.h. Three threads touch a
// CheckpointerImpl: the training thread (registration, the staging of
// SaveAsync and Snapshot, loads and restores), the writer thread
// (WriterLoop: shards, local commits) and the caller of Commit (the guard,
// between collectives). Its state is grouped by owner, each group written
// by one owner:
//   training thread only  entries_, state_used_, copier_, pin_warned_
//   writer thread only    auto_ (compression = auto's measurements)
//   under mu_             saves_ (SaveQueue: the queue and Wait()'s error),
//                         buffers_ (StagingBuffers: the retained snapshot,
//                         the spare, the bytes in flight) and stats_; on
//                         cv_ the writer waits for jobs, and Wait() and
//                         staging wait for the writer
//   its own lock          steps_ (StepBook: the steps this rank holds on
//                         disk, durable and not yet committed)
//   commit_mu_            serialises CommitManifest and retention
// Locks: commit_mu_ is taken first (CommitManifest takes mu_ and steps_'
// lock inside it); mu_, steps_' lock and PieceSource's are leaves, each
// taken alone for a few field updates and never held across file I/O.
#ifndef OOMGUARD_SDK_CHECKPOINT_CHECKPOINTER_IMPL_H_
#define OOMGUARD_SDK_CHECKPOINT_CHECKPOINTER_IMPL_H_

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "oomguard/checkpoint.h"
#include "oomguard/faults.h"
#include "oomguard/incident.h"
#include "oomguard/logging.h"
#include "oomguard/oom_error.h"
#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/compression.h"
#include "sdk/checkpoint/device_copy.h"
#include "sdk/checkpoint/dir_lock.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/host_buffer.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/reaper.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/shard_check.h"
#include "sdk/checkpoint/shard_digest.h"
#include "sdk/checkpoint/thread_pool.h"
#include "sdk/core/ids.h"

namespace oomguard::ckpt_internal {

namespace fs = std::filesystem;
using ckpt::ShardTensor;
using Clock = std::chrono::steady_clock;

inline double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The dtype under which an object's bytes are stored.
constexpr std::string_view kObjectDType = "uint8";

struct Entry {
  std::string path;  // without leading '/'
  bool is_object = false;
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
  void* data = nullptr;
  bool on_cuda = false;  // data is device memory: copies go through the DeviceCopier
  int64_t bytes = 0;
  std::function<std::vector<uint8_t>()> save;
  std::function<Status(std::span<const uint8_t>)> load;
};

// One staged copy of the registered state: every tensor in one page-aligned
// buffer (host_buffer.h), faulted in before use; objects in bytes of their own.
struct StagedState {
  ~StagedState() {
    for (void* p : pinned) ckpt::UnpinHost(p, device);
  }
  int64_t step = -1;
  ckpt::HostBuffer arena;                // the tensors, each at a page-aligned offset
  std::vector<int64_t> layout;           // per entry: the tensor's bytes, or -1 for an object
  std::vector<ckpt::StagedBytes> data;   // per entry: a run of `arena`, or an object's bytes
  std::vector<void*> pinned;  // page-locked runs of CUDA entries (index = entry); null: pageable
  int device = 0;             // the CUDA device the buffers were pinned for
  int64_t bytes = 0;
  bool writing = false;  // StagingBuffers (under CheckpointerImpl::mu_): queued or being written
};

// Gives `s` one buffer of `layout` (StagedState::layout), reusing what it
// holds when the layout is the same. Throws std::bad_alloc.
void ShapeStagedState(StagedState& s, const std::vector<int64_t>& layout);

class SnapshotSource final : public ckpt::ChunkSource {
 public:
  explicit SnapshotSource(std::shared_ptr<StagedState> s) : s_(std::move(s)) {}
  const uint8_t* Acquire(size_t t, int64_t begin, int64_t) override { return s_->data[t].data() + begin; }
  void Release(size_t, int64_t, int64_t) override {}

 private:
  std::shared_ptr<StagedState> s_;
};

// Piece-wise staging for a state larger than the budget: the training thread
// publishes chunk copies (blocking while the budget is used up); the writer
// consumes them in the same order and releases each after compression.
class PieceSource final : public ckpt::ChunkSource {
 public:
  PieceSource(int64_t budget, std::vector<std::vector<uint8_t>> whole)
      : budget_(budget), whole_(std::move(whole)) {}

  // Training thread. Copies [begin, begin+len) of entry t from `src`.
  void Publish(size_t t, int64_t begin, const uint8_t* src, int64_t len) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return used_ == 0 || used_ + len <= budget_ || aborted_; });
    if (aborted_) return;
    used_ += len;
    lk.unlock();
    std::vector<uint8_t> buf(src, src + len);
    lk.lock();
    pieces_[{t, begin}] = std::move(buf);
    cv_.notify_all();
  }
  // Either side, on failure: unblocks the other.
  void Abort() {
    std::lock_guard<std::mutex> lk(mu_);
    aborted_ = true;
    cv_.notify_all();
  }
  // Writer thread. Blocks until the range is published; throws once the save
  // was aborted by either side (the writer's catch turns it into the save's
  // failure), so that neither side waits for the other forever.
  const uint8_t* Acquire(size_t t, int64_t begin, int64_t) override {
    if (!whole_[t].empty()) return whole_[t].data() + begin;
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return pieces_.count({t, begin}) > 0 || aborted_; });
    auto it = pieces_.find({t, begin});
    if (it == pieces_.end()) throw std::runtime_error("checkpoint staging was aborted before this piece was staged");
    return it->second.data();
  }
  bool Ready(size_t t, int64_t begin) override {
    if (!whole_[t].empty()) return true;
    std::lock_guard<std::mutex> lk(mu_);
    return pieces_.count({t, begin}) > 0;
  }
  void Release(size_t t, int64_t begin, int64_t len) override {
    if (!whole_[t].empty()) return;
    std::lock_guard<std::mutex> lk(mu_);
    pieces_.erase({t, begin});
    used_ -= len;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int64_t budget_;
  int64_t used_ = 0;                                                   // guarded by mu_
  bool aborted_ = false;                                               // guarded by mu_
  std::map<std::pair<size_t, int64_t>, std::vector<uint8_t>> pieces_;  // guarded by mu_
  const std::vector<std::vector<uint8_t>> whole_;                      // objects and scalars, staged up front
};

struct CopyRange {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
};

// Copies every range on the calling thread and the helpers of `pool` (if
// any), in slices handed out through one atomic counter. Small copies stay on
// the calling thread: waking helpers costs more than it saves.
void ParallelCopy(const std::vector<CopyRange>& ranges, ckpt::ThreadPool* pool);

struct WriteJob {
  int64_t step = -1;
  std::vector<ShardTensor> tensors;
  std::shared_ptr<ckpt::ChunkSource> source;
  std::shared_ptr<StagedState> snapshot;  // null in piece mode
  std::shared_ptr<PieceSource> pieces;
  Clock::time_point started;
};

// The staging buffers' bookkeeping: the newest complete staged state
// (retained, for instant rollback), a buffer set to reuse (spare), and the
// bytes of snapshots queued or being written. Guarded by
// CheckpointerImpl::mu_; only these methods write it (and StagedState's
// `writing`). REQUIRES: mu_ held for every call.
class StagingBuffers {
 public:
  const std::shared_ptr<StagedState>& retained() const { return retained_; }
  bool has_spare() const { return spare_ != nullptr; }
  int64_t inflight_bytes() const { return inflight_bytes_; }
  // Bytes the retained snapshot holds beside those in flight (0 while it is written).
  int64_t RetainedIdle() const { return (retained_ && !retained_->writing) ? retained_->bytes : 0; }

  // `snap` becomes the retained snapshot; the one before it becomes the
  // spare unless it is being written (or there is one).
  void Retain(std::shared_ptr<StagedState> snap) {
    std::shared_ptr<StagedState> old = std::move(retained_);
    retained_ = std::move(snap);
    if (old && !old->writing && !spare_) spare_ = std::move(old);
  }
  // Over the staging budget: the retained snapshot gives way (its step is
  // durable by now; rollback falls back to disk) and becomes the spare.
  void ReleaseRetained() {
    if (!spare_) spare_ = std::move(retained_);
    retained_.reset();
  }
  // A state larger than the budget is staged in pieces: nothing else may hold staging memory.
  void DropAll() {
    retained_.reset();
    spare_.reset();
  }
  std::shared_ptr<StagedState> TakeSpare() { return std::move(spare_); }
  void OfferSpare(std::shared_ptr<StagedState> s) {
    if (!spare_) spare_ = std::move(s);
  }
  // `s` is queued for the writer / the writer is done with it (it stays
  // retained, or becomes the spare).
  void StartWriting(StagedState& s) {
    s.writing = true;
    inflight_bytes_ += s.bytes;
  }
  void DoneWriting(const std::shared_ptr<StagedState>& s) {
    s->writing = false;
    inflight_bytes_ -= s->bytes;
    if (s != retained_ && !spare_) spare_ = s;
  }

 private:
  std::shared_ptr<StagedState> retained_;
  std::shared_ptr<StagedState> spare_;
  int64_t inflight_bytes_ = 0;
};

// The saves handed to the writer thread, and the failure Wait() reports.
// Guarded by CheckpointerImpl::mu_; only these methods write it. REQUIRES:
// mu_ held for every call.
class SaveQueue {
 public:
  bool Idle() const { return jobs_.empty() && !busy_; }
  bool stopping() const { return stop_; }
  // The writer has nothing to do and may stop waiting.
  bool HasWorkOrStop() const { return stop_ || !jobs_.empty(); }
  const Status& pending_error() const { return pending_error_; }

  // Training thread (Stage).
  void Push(WriteJob job) { jobs_.push_back(std::move(job)); }
  // Writer thread: the next job (the writer is busy until Done), or false
  // when stopping and nothing is left.
  bool Pop(WriteJob* job) {
    if (jobs_.empty()) return false;
    *job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    return true;
  }
  void Done() { busy_ = false; }
  // The destructor.
  void Stop() { stop_ = true; }
  // The newest save's failure, kept for Wait() (the writer's and
  // SaveAsync's alike).
  void NoteFailure(int64_t step, const Status& s) {
    pending_error_ = s;
    pending_error_step_ = step;
  }
  // `step` is durable: an earlier failure no longer matters to anyone who
  // waits for the newest save (Stats() keeps it).
  void NoteWritten(int64_t step) {
    if (step < pending_error_step_) return;
    pending_error_ = Status::Ok();
    pending_error_step_ = -1;
  }

 private:
  std::deque<WriteJob> jobs_;
  bool busy_ = false;  // the writer holds a job
  bool stop_ = false;
  Status pending_error_;
  int64_t pending_error_step_ = -1;
};

// The steps this rank holds on disk: every step whose shard of this rank is
// durable, and this rank's shards written but not yet named by a manifest
// (coordinated commit). Its own lock, a leaf; only these methods write it.
class StepBook {
 public:
  // A save of `step` begins: whatever this rank held of it is being replaced.
  void Replacing(int64_t step) {
    std::lock_guard<std::mutex> lk(mu_);
    durable_.erase(step);
    own_shards_.erase(step);
  }
  // This rank's shard of `step` is written; durable now unless a manifest
  // must name it first (local commit: Committed says so).
  void ShardWritten(int64_t step, ckpt::ManifestShard own, bool durable_now) {
    std::lock_guard<std::mutex> lk(mu_);
    if (durable_now) durable_.insert(step);
    own_shards_[step] = std::move(own);
  }
  // This rank's uncommitted shard of `step` when it is rank `rank`.
  std::optional<ckpt::ManifestShard> OwnShard(int64_t step, int rank) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = own_shards_.find(step);
    if (it == own_shards_.end() || it->second.rank != rank) return std::nullopt;
    return it->second;
  }
  // The manifest of `step` is written: the step is durable when this rank's
  // shard is there (found on disk at start, or written); this rank's shards
  // up to it are committed.
  void Committed(int64_t step, bool shard_present) {
    std::lock_guard<std::mutex> lk(mu_);
    if (shard_present) durable_.insert(step);
    own_shards_.erase(own_shards_.begin(), own_shards_.upper_bound(step));
  }
  // At most `n` of the newest durable steps, newest first.
  std::vector<int64_t> Newest(size_t n) const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<int64_t> out;
    for (auto it = durable_.rbegin(); it != durable_.rend() && out.size() < n; ++it) out.push_back(*it);
    return out;
  }
  // Steps whose shard is gone (retention on another rank's behalf).
  void Forget(const std::vector<int64_t>& steps) {
    std::lock_guard<std::mutex> lk(mu_);
    for (int64_t step : steps) durable_.erase(step);
  }

 private:
  mutable std::mutex mu_;
  std::set<int64_t> durable_;
  std::map<int64_t, ckpt::ManifestShard> own_shards_;
};

// compression = auto's measurements (writer thread only).
struct AutoMeasurements {
  // The write + fsync throughput of the last save large enough to measure it.
  std::optional<double> write_bytes_per_s;
  // The last sample of compression (piece-wise saves cannot take one).
  std::optional<ckpt::CompressionSample> last_sample;
  ckpt::AutoCalibration calibration;    // compressed saves against their samples
  double sampled_compress_seconds = 0;  // the save in progress, when auto compressed it
};

// Committed step directories under `dir` (MANIFEST.json present), ascending.
// Step directories that are symbolic links are left out unless
// include_linked: LoadLatest tries them so that each is refused with a
// warning (ckpt::CheckStepDir), as a linked shard is; retention and the
// durable steps never see them.
std::vector<int64_t> CommittedSteps(const std::string& dir, bool include_linked = false);

class CheckpointerImpl final : public Checkpointer {
 public:
  // Starts the pools and, with a directory, finds its committed steps and
  // starts the writer thread (checkpointer.cc, as the rest of registration).
  explicit CheckpointerImpl(const CheckpointOptions& o);
  ~CheckpointerImpl() override;

  Status AddTensor(std::string path, DType dtype, std::vector<int64_t> shape, void* data,
                   MemoryLocation location) override;
  Status AddObject(std::string path, std::function<std::vector<uint8_t>()> save,
                   std::function<Status(std::span<const uint8_t>)> load) override;

  Status SaveAsync(int64_t step) override;
  Status Wait() override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return saves_.Idle(); });
    return saves_.pending_error();
  }
  Status Commit(int64_t step, int world_size) override;

  StatusOr<int64_t> LoadLatest() override;
  StatusOr<int64_t> Load(int64_t step) override {
    if (in_memory()) return NothingOnDisk();
    (void)Wait();
    Status s = LoadStep(step);
    if (!s.ok()) return s;
    return step;
  }

  // Bytes [begin, begin + len) of a registered tensor, wherever it lives.
  Status CopyOut(const Entry& e, int64_t begin, int64_t len, std::vector<uint8_t>* out);

  // The copier for a CUDA tensor's device: every CUDA tensor of one
  // checkpointer lives on one device (a rank's).
  Status UseDeviceOf(const std::string& path, const void* data);

  // Starts a batch of device copies after the streams that write the tensors.
  Status BeginDeviceCopies();

  CheckpointStats Stats() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_;
  }
  const CheckpointOptions& options() const override { return o_; }
  // The directory's lock for this rank (Create takes it before construction).
  void HoldLock(std::shared_ptr<ckpt::DirLock> lock) { dir_lock_ = std::move(lock); }

  std::vector<int64_t> DurableSteps() override;
  std::optional<int64_t> SnapshotStep() override {
    std::lock_guard<std::mutex> lk(mu_);
    if (buffers_.retained() == nullptr) return std::nullopt;
    return buffers_.retained()->step;
  }
  Status Snapshot(int64_t step) override;
  Status Restore(int64_t step) override;
  Status OnStepCommitted(int64_t step, bool after_recovery) override {
    const bool by_count = o_.every_steps > 0 && (step + 1) % o_.every_steps == 0;
    if (!by_count && !(after_recovery && o_.save_after_recovery)) return Status::Ok();
    return SaveAsync(step);
  }

 private:
  // CheckpointOptions::dir is empty: saves are kept in host memory only.
  bool in_memory() const { return o_.dir.empty(); }
  Status NothingOnDisk() const {
    return Status::NotFound("this checkpointer keeps its saves in memory only (CheckpointOptions.dir is empty): "
                            "there is no checkpoint on disk to load");
  }
  // The registered state is fixed from the first save, snapshot or load on:
  // a path added later would be missing from the checkpoints already taken,
  // and every load of them would fail (or, after a load, it would silently
  // keep its fresh value).
  Status CheckRegistrationOpen(std::string_view call, const std::string& path) const;
  // A state path is a dataset's name in the shard: groups separated by '/'.
  // HDF5 would cut a name at a NUL byte and resolve "." and ".." components,
  // so a checkpoint with such a path could never be loaded; a path deeper
  // than ckpt::kMaxGroupDepth groups would be refused by every reader.
  Status CheckNewPath(const std::string& path) const;
  std::string StepDir(int64_t step) const { return o_.dir + "/" + ckpt::StepDirName(step); }
  std::string ShardPath(int64_t step) const { return StepDir(step) + "/" + ckpt::ShardFileName(o_.rank); }
  // OK when StepDir(step) is absent or a real directory (ckpt::CheckStepDir);
  // kFailedPrecondition naming it otherwise: a save or a commit never writes
  // through a link.
  Status UsableStepDir(int64_t step) const {
    Status s = ckpt::CheckStepDir(StepDir(step));
    if (s.ok() || s.code() == StatusCode::kNotFound) return Status::Ok();
    return Status::FailedPrecondition("cannot write checkpoint of step " + std::to_string(step) + ": " +
                                      s.message());
  }
  // Serialises the objects and copies the registered state into a staging
  // buffer (the blocking part of a save). REQUIRES: the state fits the
  // staging budget beside what is in flight (or there is no budget).
  StatusOr<std::shared_ptr<StagedState>> StageWithinBudget(int64_t step, std::vector<std::vector<uint8_t>>& object_bytes,
                                                        int64_t need);
  // StagedState::layout of the registered state.
  std::vector<int64_t> StagingLayout() const;
  std::vector<ShardTensor> Layout(const std::vector<std::vector<uint8_t>>* object_bytes) const;

  // This process writes its manifests (one rank, or ManifestCommit::kLocal).
  bool CommitsLocally() const {
    return o_.manifest_commit == ManifestCommit::kLocal ||
           (o_.manifest_commit == ManifestCommit::kAuto && o_.world_size == 1);
  }
  // SaveAsync's body; may throw (user save callbacks, fault points,
  // bad_alloc). *queued turns true once the writer has the save (and reports
  // its failures itself).
  Status Stage(int64_t step, bool* queued);
  // Counts a failed save in Stats() and keeps it for Wait() as the newest
  // failure, the writer's and SaveAsync's alike. REQUIRES: mu_ held.
  void NoteSaveFailure(int64_t step, const Status& s);
  // NoteSaveFailure under mu_, and the error logged (SaveAsync's failures).
  void RecordSaveFailure(int64_t step, const Status& s);
  void WriterLoop();
  // Writer thread: a faulted-in (and pinned) spare for the next save when
  // `written` stays retained and no spare exists, within the staging budget.
  void PrepareSpare(const std::shared_ptr<StagedState>& written);
  Status Write(WriteJob& job);
  // Writes <dir>/step-S/MANIFEST.json naming `world_size` shards, then
  // applies retention. Checks that every shard file exists. Any thread.
  Status CommitManifest(int64_t step, int world_size);
  Status LoadStep(int64_t step);
  void ApplyRetention(int64_t newest_committed);
  // Hands directories a crash left under ckpt::kRemovingPrefix names to the reaper.
  void RemoveLeftovers();
  void RecordCorrupt(int64_t step, const Status& why);

  // First, so destroyed last: released after the writer and the reaper stopped.
  std::shared_ptr<ckpt::DirLock> dir_lock_;
  const CheckpointOptions o_;
  // Set at construction, then only used: the pools are thread-safe, and
  // frames_ recycles compressed-frame buffers under its own lock.
  std::unique_ptr<ckpt::ThreadPool> pool_;
  std::unique_ptr<ckpt::ThreadPool> stage_pool_;  // helpers of the staging copy; null: the caller alone
  ckpt::FramePool frames_;

  // Training thread only.
  std::vector<Entry> entries_;  // the registered state (frozen once saving starts)
  // A save was staged, a snapshot taken, or a load or restore began (it may
  // have written into the registered state).
  bool state_used_ = false;
  std::unique_ptr<ckpt::DeviceCopier> copier_;  // set once a CUDA tensor is registered
  bool pin_warned_ = false;

  // Writer thread only.
  AutoMeasurements auto_;
  // Chooses the compression of `job` (writer thread).
  void ChooseCompression(const WriteJob& job, ckpt::ShardWriteOptions* wo);

  // Shared by the training thread, the writer and Commit's caller.
  mutable std::mutex mu_;
  std::condition_variable cv_;  // notified when a job is queued or written, and on stopping
  SaveQueue saves_;             // guarded by mu_
  StagingBuffers buffers_;      // guarded by mu_
  CheckpointStats stats_;       // guarded by mu_
  StepBook steps_;              // its own lock
  std::mutex commit_mu_;        // serialises CommitManifest + retention
  ckpt::Reaper reaper_;         // deletes what retention dropped (thread-safe)
  std::thread writer_;
};


}  // namespace oomguard::ckpt_internal

#endif  // OOMGUARD_SDK_CHECKPOINT_CHECKPOINTER_IMPL_H_
