// The Checkpointer: state registry, staging (the only blocking part of a
// save), the background writer, manifest commit, retention, loading, and the
// RecoveryStore the guard rolls back through.
//
// Staging buffers (struct StagedState) are recycled: at steady state one holds
// the retained snapshot (instant rollback) and one is being written or spare,
// so a save copies into memory that is already faulted in. The staging budget
// bounds the bytes of all of them together.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "oomguard/checkpoint.h"
#include "oomguard/device.h"
#include "oomguard/faults.h"
#include "oomguard/incident.h"
#include "oomguard/logging.h"
#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/device_copy.h"
#include "sdk/checkpoint/hdf5_io.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/shard_check.h"
#include "sdk/checkpoint/thread_pool.h"
#include "sdk/core/ids.h"

namespace oomguard {

namespace fs = std::filesystem;
using ckpt::ShardTensor;

namespace {

using Clock = std::chrono::steady_clock;
double MsSince(Clock::time_point t0) {
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

// One staged copy of the registered state (one buffer per entry).
struct StagedState {
  ~StagedState() {
    for (void* p : pinned) ckpt::UnpinHost(p, device);
  }
  int64_t step = -1;
  std::vector<std::vector<uint8_t>> data;
  std::vector<void*> pinned;  // page-locked buffers of CUDA entries (index = entry); null: pageable
  int device = 0;             // the CUDA device the buffers were pinned for
  int64_t bytes = 0;
  bool writing = false;  // guarded by CheckpointerImpl::mu_
};

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
  // Writer side, on failure: unblocks the training thread.
  void Abort() {
    std::lock_guard<std::mutex> lk(mu_);
    aborted_ = true;
    cv_.notify_all();
  }
  const uint8_t* Acquire(size_t t, int64_t begin, int64_t) override {
    if (!whole_[t].empty()) return whole_[t].data() + begin;
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return pieces_.count({t, begin}) > 0; });
    return pieces_[{t, begin}].data();
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
void ParallelCopy(const std::vector<CopyRange>& ranges, ckpt::ThreadPool* pool) {
  constexpr size_t kSlice = size_t{4} << 20;
  size_t total = 0;
  for (const auto& r : ranges) total += r.bytes;
  if (pool == nullptr || total < 4 * kSlice) {
    for (const auto& r : ranges) std::memcpy(r.dst, r.src, r.bytes);
    return;
  }
  std::vector<CopyRange> slices;
  slices.reserve(total / kSlice + ranges.size());
  for (const auto& r : ranges)
    for (size_t off = 0; off < r.bytes; off += kSlice)
      slices.push_back({r.dst + off, r.src + off, std::min(kSlice, r.bytes - off)});
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < slices.size(); i = next.fetch_add(1))
      std::memcpy(slices[i].dst, slices[i].src, slices[i].bytes);
  };
  std::vector<std::future<void>> helpers;
  for (int h = 0; h < pool->size(); ++h) helpers.push_back(pool->Submit(work));
  work();
  for (auto& f : helpers) f.wait();
}

struct WriteJob {
  int64_t step = -1;
  std::vector<ShardTensor> tensors;
  std::shared_ptr<ckpt::ChunkSource> source;
  std::shared_ptr<StagedState> snapshot;  // null in piece mode
  std::shared_ptr<PieceSource> pieces;
  Clock::time_point started;
};

std::vector<int64_t> CommittedSteps(const std::string& dir) {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    auto step = ckpt::ParseStepDirName(e.path().filename().string());
    if (step && fs::exists(e.path() / ckpt::kManifestName, ec)) out.push_back(*step);
  }
  std::sort(out.begin(), out.end());
  return out;
}

class CheckpointerImpl final : public Checkpointer {
 public:
  explicit CheckpointerImpl(const CheckpointOptions& o) : o_(o) {
    int threads =
        o.threads > 0 ? o.threads : std::min(8, static_cast<int>(std::thread::hardware_concurrency()));
    pool_ = std::make_unique<ckpt::ThreadPool>(std::max(1, threads));
    const int stagers = o.stage_threads > 0
                            ? o.stage_threads
                            : std::min(4, std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
    if (stagers > 1) stage_pool_ = std::make_unique<ckpt::ThreadPool>(stagers - 1);
    for (int64_t step : CommittedSteps(o_.dir))
      if (fs::exists(ShardPath(step))) durable_.insert(step);
    writer_ = std::thread([this] { WriterLoop(); });
  }

  ~CheckpointerImpl() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    writer_.join();
  }

  Status AddTensor(std::string path, DType dtype, std::vector<int64_t> shape, void* data,
                   MemoryLocation location) override {
    OOMGUARD_RETURN_IF_ERROR(CheckNewPath(path));
    int64_t elems = 1;
    for (int64_t d : shape) {
      if (d < 0) return Status::InvalidArgument("AddTensor(" + path + "): negative dimension");
      elems *= d;
    }
    if (data == nullptr && elems > 0) return Status::InvalidArgument("AddTensor(" + path + "): data is null");
    if (location == MemoryLocation::kCuda) OOMGUARD_RETURN_IF_ERROR(UseDeviceOf(path, data));
    Entry e;
    e.path = std::move(path);
    e.dtype = dtype;
    e.shape = std::move(shape);
    e.data = data;
    e.on_cuda = location == MemoryLocation::kCuda;
    e.bytes = elems * static_cast<int64_t>(DTypeSize(dtype));
    entries_.push_back(std::move(e));
    return Status::Ok();
  }

  Status AddObject(std::string path, std::function<std::vector<uint8_t>()> save,
                   std::function<Status(std::span<const uint8_t>)> load) override {
    OOMGUARD_RETURN_IF_ERROR(CheckNewPath(path));
    if (!save || !load) return Status::InvalidArgument("AddObject(" + path + "): save and load must be set");
    Entry e;
    e.path = std::move(path);
    e.is_object = true;
    e.save = std::move(save);
    e.load = std::move(load);
    entries_.push_back(std::move(e));
    return Status::Ok();
  }

  Status SaveAsync(int64_t step) override;
  Status Wait() override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
    return pending_error_;
  }

  StatusOr<int64_t> LoadLatest() override;
  StatusOr<int64_t> Load(int64_t step) override {
    (void)Wait();
    Status s = LoadStep(step);
    if (!s.ok()) return s;
    return step;
  }

  // Bytes [begin, begin + len) of a registered tensor, wherever it lives.
  Status CopyOut(const Entry& e, int64_t begin, int64_t len, std::vector<uint8_t>* out) {
    out->resize(static_cast<size_t>(len));
    if (len == 0) return Status::Ok();
    const auto* src = static_cast<const uint8_t*>(e.data) + begin;
    if (!e.on_cuda) {
      std::memcpy(out->data(), src, static_cast<size_t>(len));
      return Status::Ok();
    }
    OOMGUARD_RETURN_IF_ERROR(BeginDeviceCopies());
    OOMGUARD_RETURN_IF_ERROR(copier_->ToHost(out->data(), src, static_cast<size_t>(len)));
    return copier_->Sync();
  }

  // The copier for a CUDA tensor's device: every CUDA tensor of one
  // checkpointer lives on one device (a rank's).
  Status UseDeviceOf(const std::string& path, const void* data) {
    auto device = ckpt::DeviceOfPointer(data);
    if (!device.ok()) {
      // Without a GPU (or a CUDA build) say that, rather than "not device memory".
      auto probe = ckpt::DeviceCopier::Create(0);
      const Status& why = probe.ok() ? device.status() : probe.status();
      return Status(why.code(), "AddTensor(" + path + "): " + why.message());
    }
    if (copier_ != nullptr) {
      if (copier_->device() == *device) return Status::Ok();
      return Status::InvalidArgument("AddTensor(" + path + "): on CUDA device " + std::to_string(*device) +
                                     ", other tensors on device " + std::to_string(copier_->device()) +
                                     " (one checkpointer holds one rank's state, on one device)");
    }
    auto c = ckpt::DeviceCopier::Create(*device);
    if (!c.ok()) return Status(c.status().code(), "AddTensor(" + path + "): " + c.status().message());
    copier_ = std::move(c).value();
    return Status::Ok();
  }

  // Starts a batch of device copies after the streams that write the tensors.
  Status BeginDeviceCopies() {
    std::vector<void*> streams;
    if (o_.cuda_streams) streams = o_.cuda_streams();
    return copier_->Begin(streams);
  }

  int64_t ShardDurableStep() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return durable_.empty() ? -1 : *durable_.rbegin();
  }
  Status CommitManifest(int64_t step, int world_size) override;

  CheckpointStats Stats() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_;
  }
  const CheckpointOptions& options() const override { return o_; }

  std::vector<int64_t> DurableSteps() override;
  std::optional<int64_t> SnapshotStep() override {
    std::lock_guard<std::mutex> lk(mu_);
    if (retained_ == nullptr) return std::nullopt;
    return retained_->step;
  }
  Status Snapshot(int64_t step) override;
  Status Restore(int64_t step) override;
  Status OnStepCommitted(int64_t step, bool after_recovery) override {
    const bool by_count = o_.every_steps > 0 && (step + 1) % o_.every_steps == 0;
    if (!by_count && !(after_recovery && o_.save_after_recovery)) return Status::Ok();
    try {
      return SaveAsync(step);
    } catch (const std::bad_alloc& e) {
      return Status::ResourceExhausted(std::string("staging checkpoint of step ") + std::to_string(step) +
                                       " ran out of host memory: " + e.what());
    } catch (const DeviceOomError& e) {
      return Status::ResourceExhausted(std::string("staging checkpoint of step ") + std::to_string(step) +
                                       " ran out of device memory: " + e.what());
    } catch (const std::exception& e) {
      return Status::Internal(std::string("checkpoint of step ") + std::to_string(step) +
                              " failed: " + e.what());
    }
  }

 private:
  Status CheckNewPath(const std::string& path) const {
    if (path.empty() || path.front() == '/' || path.back() == '/' || path.find("//") != std::string::npos ||
        path.find('.') == 0)
      return Status::InvalidArgument("state path '" + path + "' must look like 'model/fc1.weight'");
    for (const auto& e : entries_)
      if (e.path == path) return Status::InvalidArgument("state path '" + path + "' is registered twice");
    return Status::Ok();
  }
  std::string StepDir(int64_t step) const { return o_.dir + "/" + ckpt::StepDirName(step); }
  std::string ShardPath(int64_t step) const { return StepDir(step) + "/" + ckpt::ShardFileName(o_.rank); }
  // Serialises the objects and copies the registered state into a staging
  // buffer (the blocking part of a save). REQUIRES: the state fits the
  // staging budget beside what is in flight (or there is no budget).
  StatusOr<std::shared_ptr<StagedState>> StageWithinBudget(int64_t step, std::vector<std::vector<uint8_t>>& object_bytes,
                                                        int64_t need);
  std::vector<ShardTensor> Layout(const std::vector<std::vector<uint8_t>>* object_bytes) const {
    std::vector<ShardTensor> out;
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      ShardTensor t;
      t.path = e.path;
      if (e.is_object) {
        t.dtype = DType::kUInt8;
        t.bytes = static_cast<int64_t>((*object_bytes)[i].size());
        t.shape = {t.bytes};
      } else {
        t.dtype = e.dtype;
        t.shape = e.shape;
        t.bytes = e.bytes;
      }
      out.push_back(std::move(t));
    }
    return out;
  }

  void WriterLoop();
  Status Write(WriteJob& job);
  Status LoadStep(int64_t step);
  void ApplyRetention(int64_t newest_committed);
  void RecordCorrupt(int64_t step, const Status& why);

  const CheckpointOptions o_;
  std::vector<Entry> entries_;  // training thread only (frozen once saving starts)
  std::unique_ptr<ckpt::ThreadPool> pool_;
  std::unique_ptr<ckpt::ThreadPool> stage_pool_;  // helpers of the staging copy; null: the caller alone
  ckpt::FramePool frames_;                        // compressed-frame buffers, reused by every save
  std::unique_ptr<ckpt::DeviceCopier> copier_;  // set once a CUDA tensor is registered
  bool pin_warned_ = false;                     // training thread only

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<WriteJob> queue_;                         // guarded by mu_
  bool busy_ = false;                                  // guarded by mu_: the writer holds a job
  bool stop_ = false;                                  // guarded by mu_
  std::shared_ptr<StagedState> retained_;              // guarded by mu_: newest complete staged state
  std::shared_ptr<StagedState> spare_;                 // guarded by mu_: a buffer set to reuse
  int64_t inflight_bytes_ = 0;                         // guarded by mu_: snapshots queued or being written
  std::set<int64_t> durable_;                          // guarded by mu_: steps whose shard of this rank is durable
  std::map<int64_t, ckpt::ManifestShard> own_shards_;  // guarded by mu_: durable, not yet committed
  Status pending_error_;                               // guarded by mu_: the newest save's failure
  int64_t pending_error_step_ = -1;                    // guarded by mu_: the step that failed
  CheckpointStats stats_;                              // guarded by mu_
  std::mutex commit_mu_;                               // serialises CommitManifest + retention
  std::thread writer_;
};

StatusOr<std::shared_ptr<StagedState>> CheckpointerImpl::StageWithinBudget(
    int64_t step, std::vector<std::vector<uint8_t>>& object_bytes, int64_t need) {
  const int64_t budget = o_.staging_budget_bytes;
  std::shared_ptr<StagedState> snap;
  {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      const int64_t retained_idle = (retained_ && !retained_->writing) ? retained_->bytes : 0;
      if (budget == 0 || inflight_bytes_ + retained_idle + need <= budget) break;
      if (retained_idle > 0) {
        // Its step is durable by now; rollback falls back to disk.
        if (!spare_) spare_ = std::move(retained_);
        retained_.reset();
        continue;
      }
      cv_.wait(lk);  // back-pressure: a write must finish first
    }
    snap = std::move(spare_);
  }
  if (!snap) snap = std::make_shared<StagedState>();
  snap->data.resize(entries_.size());
  snap->pinned.resize(entries_.size(), nullptr);
  snap->step = step;
  snap->bytes = need;
  bool device_copies = false;
  std::vector<CopyRange> host_copies;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.is_object) {
      snap->data[i] = std::move(object_bytes[i]);
      continue;
    }
    auto& buf = snap->data[i];
    if (static_cast<int64_t>(buf.size()) != e.bytes) {
      // Resize without value-initialising what memcpy overwrites anyway.
      ckpt::UnpinHost(snap->pinned[i], snap->device);
      snap->pinned[i] = nullptr;
      buf = std::vector<uint8_t>();
      buf.resize(static_cast<size_t>(e.bytes));
    }
    if (e.bytes == 0) continue;
    if (e.on_cuda) {
      if (!device_copies) OOMGUARD_RETURN_IF_ERROR(BeginDeviceCopies());
      // Pinned once per buffer; buffers are recycled between saves. A buffer
      // the driver would not pin stays pageable (slower, still correct).
      if (snap->pinned[i] == nullptr) {
        snap->device = copier_->device();
        if (ckpt::PinHost(buf.data(), buf.size(), snap->device)) {
          snap->pinned[i] = buf.data();
        } else if (!pin_warned_) {
          pin_warned_ = true;
          Logger()->warn("checkpoint staging: could not page-lock {} bytes of host memory for {}: device copies "
                         "of this state run from pageable memory (slower)", buf.size(), e.path);
        }
      }
      OOMGUARD_RETURN_IF_ERROR(copier_->ToHost(buf.data(), e.data, static_cast<size_t>(e.bytes)));
      device_copies = true;
    } else {
      host_copies.push_back({buf.data(), static_cast<const uint8_t*>(e.data), static_cast<size_t>(e.bytes)});
    }
  }
  ParallelCopy(host_copies, stage_pool_.get());
  // The stall ends when the device copies landed: training may then change the tensors.
  if (device_copies) OOMGUARD_RETURN_IF_ERROR(copier_->Sync());
  return snap;
}

Status CheckpointerImpl::Snapshot(int64_t step) {
  if (!o_.keep_snapshot) return Status::FailedPrecondition("CheckpointOptions.keep_snapshot is off");
  std::vector<std::vector<uint8_t>> object_bytes(entries_.size());
  int64_t need = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].is_object) object_bytes[i] = entries_[i].save();
    need += entries_[i].is_object ? static_cast<int64_t>(object_bytes[i].size()) : entries_[i].bytes;
  }
  if (o_.staging_budget_bytes > 0 && need > o_.staging_budget_bytes)
    return Status::ResourceExhausted("the state (" + std::to_string(need) + " bytes) exceeds the staging budget (" +
                                     std::to_string(o_.staging_budget_bytes) + " bytes): no in-memory snapshot");
  auto snap = StageWithinBudget(step, object_bytes, need);
  if (!snap.ok()) return snap.status();
  std::lock_guard<std::mutex> lk(mu_);
  std::shared_ptr<StagedState> old = std::move(retained_);
  retained_ = *snap;
  if (old && !old->writing && !spare_) spare_ = std::move(old);
  return Status::Ok();
}

Status CheckpointerImpl::SaveAsync(int64_t step) {
  const auto t0 = Clock::now();
  FaultPoint(FaultSite::kCkptStage, FaultContext{step, o_.rank, -1, 0});
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.saves_started;
  }
  // Objects serialise first: their size is part of the state's size.
  std::vector<std::vector<uint8_t>> object_bytes(entries_.size());
  int64_t need = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].is_object) object_bytes[i] = entries_[i].save();
    need += entries_[i].is_object ? static_cast<int64_t>(object_bytes[i].size()) : entries_[i].bytes;
  }
  WriteJob job;
  job.step = step;
  job.tensors = Layout(&object_bytes);
  const int64_t budget = o_.staging_budget_bytes;

  if (budget == 0 || need <= budget) {
    auto staged = StageWithinBudget(step, object_bytes, need);
    if (!staged.ok()) return staged.status();
    std::shared_ptr<StagedState> snap = std::move(staged).value();
    job.snapshot = snap;
    job.source = std::make_shared<SnapshotSource>(snap);
    job.started = Clock::now();
    {
      std::lock_guard<std::mutex> lk(mu_);
      snap->writing = true;
      inflight_bytes_ += snap->bytes;
      if (o_.keep_snapshot) {
        std::shared_ptr<StagedState> old = std::move(retained_);
        retained_ = snap;
        if (old && !old->writing && !spare_) spare_ = std::move(old);
      }
      stats_.state_bytes = need;
      stats_.stall_ms.push_back(MsSince(t0));
      queue_.push_back(std::move(job));
    }
    cv_.notify_all();
  } else {
    // Larger than the budget: wait until nothing else holds staging memory,
    // then stream chunk copies to the writer.
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
      retained_.reset();
      spare_.reset();
    }
    std::vector<std::vector<uint8_t>> whole(entries_.size());
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      if (e.is_object) {
        whole[i] = std::move(object_bytes[i]);
      } else if (e.shape.empty() && e.bytes > 0) {
        OOMGUARD_RETURN_IF_ERROR(CopyOut(e, 0, e.bytes, &whole[i]));
      }
    }
    auto pieces = std::make_shared<PieceSource>(budget, whole);
    job.pieces = pieces;
    job.source = pieces;
    job.started = Clock::now();
    std::vector<ShardTensor> tensors = job.tensors;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stats_.state_bytes = need;
      queue_.push_back(std::move(job));
    }
    cv_.notify_all();
    std::vector<hsize_t> offset;
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (!whole[i].empty() || entries_[i].bytes == 0) continue;
      ckpt::ChunkLayout L = ckpt::PlanChunks(tensors[i].shape, DTypeSize(tensors[i].dtype), o_.chunk_bytes);
      for (int64_t c = 0; c < L.count; ++c) {
        int64_t begin = 0, len = 0;
        ckpt::ChunkPosition(tensors[i].shape, L, c, &offset, &begin, &len);
        if (entries_[i].on_cuda) {
          std::vector<uint8_t> host;
          OOMGUARD_RETURN_IF_ERROR(CopyOut(entries_[i], begin, len, &host));
          pieces->Publish(i, begin, host.data(), len);
        } else {
          pieces->Publish(i, begin, static_cast<const uint8_t*>(entries_[i].data) + begin, len);
        }
      }
    }
    std::lock_guard<std::mutex> lk(mu_);
    stats_.stall_ms.push_back(MsSince(t0));
  }
  return Status::Ok();
}

void CheckpointerImpl::WriterLoop() {
  for (;;) {
    WriteJob job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    Status s;
    try {
      s = Write(job);
    } catch (const std::exception& e) {
      // Injected faults (ckpt_write/ckpt_manifest oom rules) and allocation failures.
      s = Status::ResourceExhausted(std::string("checkpoint writer: ") + e.what());
    }
    if (!s.ok() && job.pieces) job.pieces->Abort();
    {
      std::lock_guard<std::mutex> lk(mu_);
      busy_ = false;
      stats_.last_write_ms = MsSince(job.started);
      if (job.snapshot) {
        job.snapshot->writing = false;
        inflight_bytes_ -= job.snapshot->bytes;
        if (job.snapshot != retained_ && !spare_) spare_ = job.snapshot;
        // A snapshot whose write failed is not a checkpoint, but it is still
        // a complete copy of that step's state: it stays usable for rollback.
      }
      if (!s.ok()) {
        ++stats_.save_failures;
        stats_.last_error = s;
        pending_error_ = s;
        pending_error_step_ = job.step;
      } else if (job.step >= pending_error_step_) {
        // A newer state is durable: the earlier failure no longer matters to
        // anyone who waits for the newest save (Stats() keeps it).
        pending_error_ = Status::Ok();
        pending_error_step_ = -1;
      }
    }
    if (!s.ok()) Logger()->error("checkpoint of step {} failed: {}", job.step, s.ToString());
    cv_.notify_all();
  }
}

Status CheckpointerImpl::Write(WriteJob& job) {
  const std::string dir = StepDir(job.step);
  {
    // Whatever this rank held of the step before is being replaced.
    std::lock_guard<std::mutex> lk(mu_);
    durable_.erase(job.step);
    own_shards_.erase(job.step);
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::Internal("cannot create " + dir + ": " + ec.message());
  // Re-saving a step that was committed before (a run resumed from an older
  // checkpoint): retract the old commit first, so that a crash in between
  // never pairs the old manifest with a new shard.
  if (fs::exists(dir + "/" + ckpt::kManifestName, ec)) {
    fs::remove(dir + "/" + ckpt::kManifestName, ec);
    if (o_.fsync) OOMGUARD_RETURN_IF_ERROR(ckpt::FsyncPath(dir, true));
  }
  ckpt::ShardWriteOptions wo;
  wo.step = job.step;
  wo.rank = o_.rank;
  wo.world_size = o_.world_size;
  wo.level = o_.compression_level;
  wo.chunk_bytes = o_.chunk_bytes;
  wo.fsync = o_.fsync;
  wo.frames = &frames_;
  const FaultContext ctx{job.step, o_.rank, -1, 0};
  wo.midway = [ctx] { FaultPoint(FaultSite::kCkptWrite, ctx); };
  const std::string file = ckpt::ShardFileName(o_.rank);
  auto res = ckpt::WriteShard(dir + "/" + file, job.tensors, job.source.get(), pool_.get(), wo);
  if (!res.ok()) return res.status();
  {
    std::lock_guard<std::mutex> lk(mu_);
    // With local commit a step counts once its manifest is written (below).
    if (!o_.commit_manifest_locally) durable_.insert(job.step);
    own_shards_[job.step] = ckpt::ManifestShard{o_.rank, file, res->file_bytes, res->file_xxh3};
    ++stats_.checkpoints_written;
    stats_.last_file_bytes = res->file_bytes;
  }
  if (o_.commit_manifest_locally) return CommitManifest(job.step, o_.world_size);
  return Status::Ok();
}

Status CheckpointerImpl::CommitManifest(int64_t step, int world_size) {
  std::lock_guard<std::mutex> commit_lock(commit_mu_);
  FaultPoint(FaultSite::kCkptManifest, FaultContext{step, o_.rank, -1, 0});
  const std::string dir = StepDir(step);
  ckpt::Manifest m;
  m.format = std::string(kCheckpointFormat);
  m.step = step;
  m.world_size = world_size;
  m.created_unix = internal::NowUnixMs() / 1000;
  for (int r = 0; r < world_size; ++r) {
    std::optional<ckpt::ManifestShard> own;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = own_shards_.find(step);
      if (it != own_shards_.end() && it->second.rank == r) own = it->second;
    }
    if (own) {
      m.shards.push_back(*own);
      continue;
    }
    // Another rank's shard (shared filesystem): its bytes and hash from disk.
    ckpt::ManifestShard sh{r, ckpt::ShardFileName(r), 0, ""};
    uint64_t h = 0;
    Status s = ckpt::HashFile(dir + "/" + sh.file, &h, &sh.bytes);
    if (!s.ok())
      return Status::FailedPrecondition("cannot commit step " + std::to_string(step) + ": " + s.message());
    sh.xxh3 = ckpt::Hex64(h);
    m.shards.push_back(std::move(sh));
  }
  OOMGUARD_RETURN_IF_ERROR(
      ckpt::WriteFileDurably(dir + "/" + ckpt::kManifestName, ckpt::ManifestToJson(m), o_.fsync));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (fs::exists(ShardPath(step))) durable_.insert(step);
    own_shards_.erase(own_shards_.begin(), own_shards_.upper_bound(step));
    ++stats_.manifests_committed;
  }
  ApplyRetention(step);
  return Status::Ok();
}

void CheckpointerImpl::ApplyRetention(int64_t newest_committed) {
  std::error_code ec;
  std::vector<int64_t> committed = CommittedSteps(o_.dir);
  std::vector<int64_t> doomed;
  if (o_.keep > 0 && static_cast<int>(committed.size()) > o_.keep)
    doomed.assign(committed.begin(), committed.end() - o_.keep);
  // Incomplete directories older than a committed step are crash leftovers;
  // newer ones may be saves in progress (here or on other ranks).
  for (const auto& e : fs::directory_iterator(o_.dir, ec)) {
    auto step = ckpt::ParseStepDirName(e.path().filename().string());
    if (step && *step < newest_committed && !fs::exists(e.path() / ckpt::kManifestName, ec))
      doomed.push_back(*step);
  }
  for (int64_t s : doomed) {
    if (s == newest_committed) continue;
    // Remove the manifest first: a crash mid-delete leaves an uncommitted directory, never a
    // committed one with shards missing.
    fs::remove(StepDir(s) + "/" + ckpt::kManifestName, ec);
    fs::remove_all(StepDir(s), ec);
    if (ec) Logger()->warn("retention: cannot remove {}: {}", StepDir(s), ec.message());
  }
  if (!doomed.empty() && o_.fsync) (void)ckpt::FsyncPath(o_.dir, true);
}

Status CheckpointerImpl::LoadStep(int64_t step) {
  const std::string dir = StepDir(step);
  auto m = ckpt::ReadStepManifest(dir, step);
  if (!m.ok()) return m.status();
  if (m->world_size != o_.world_size)
    return Status::DataLoss(dir + "/MANIFEST.json names world size " + std::to_string(m->world_size) +
                            ", this run has " + std::to_string(o_.world_size) +
                            " (resharding is not supported)");
  const ckpt::ManifestShard* sh = nullptr;
  for (const auto& s : m->shards)
    if (s.rank == o_.rank) sh = &s;
  if (sh == nullptr)
    return Status::DataLoss(dir + "/MANIFEST.json has no shard for rank " + std::to_string(o_.rank));
  // The checker VerifyCheckpoint uses too (shard_check.h): the shard's
  // structure and sizes are checked before anything is allocated or read.
  auto checked = ckpt::CheckedShard::Open(dir, *m, *sh, o_.verify_file_checksum);
  if (!checked.ok()) return checked.status();
  ckpt::CheckedShard& shard = **checked;
  // Host tensors and objects in one pipeline; a CUDA tensor goes through a
  // host buffer of its own size, one at a time. Objects' load() runs last,
  // only when every byte of the shard has verified.
  std::vector<std::vector<uint8_t>> objects(entries_.size());
  std::vector<ckpt::ShardReader::ReadRequest> batch;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    const std::string ds = "/" + e.path;
    const ckpt::ShardEntry* found = shard.Find(ds);
    if (found == nullptr)
      return shard.Finish(Status::DataLoss(shard.path() + ": tensor " + ds + " is missing"));
    if (e.is_object) {
      if (found->dtype != DType::kUInt8 || found->shape.size() != 1)
        return shard.Finish(
            Status::DataLoss(shard.path() + ": object " + ds + " is not a 1-D uint8 dataset"));
      try {
        objects[i].resize(static_cast<size_t>(found->bytes));  // bounded by the file (CheckedShard)
      } catch (const std::bad_alloc&) {
        return shard.Finish(Status::ResourceExhausted(shard.path() + ": object " + ds + " needs " +
                                                      std::to_string(found->bytes) +
                                                      " bytes of host memory"));
      }
      batch.push_back({ds, true, DType::kUInt8, found->shape, objects[i].data(), found->bytes});
    } else if (!e.on_cuda) {
      batch.push_back({ds, true, e.dtype, e.shape, static_cast<uint8_t*>(e.data), e.bytes});
    }
  }
  Status read_status = shard.Read(batch, pool_.get());
  for (size_t i = 0; i < entries_.size() && read_status.ok(); ++i) {
    const Entry& e = entries_[i];
    if (!e.on_cuda) continue;
    std::vector<uint8_t> host(static_cast<size_t>(e.bytes));
    read_status = shard.Read({{"/" + e.path, true, e.dtype, e.shape, host.data(), e.bytes}}, pool_.get());
    if (read_status.ok() && e.bytes > 0) {
      read_status = BeginDeviceCopies();
      if (read_status.ok()) read_status = copier_->ToDevice(e.data, host.data(), host.size());
      if (read_status.ok()) read_status = copier_->Sync();
    }
  }
  // A tensor's own error names the tensor; Finish prefers it over the file's.
  OOMGUARD_RETURN_IF_ERROR(shard.Finish(read_status));
  const std::string file = shard.path();
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!entries_[i].is_object) continue;
    Status s = entries_[i].load(objects[i]);
    if (!s.ok()) return Status(s.code(), file + ": object /" + entries_[i].path + ": " + s.message());
  }
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.restores_from_disk;
  return Status::Ok();
}

void CheckpointerImpl::RecordCorrupt(int64_t step, const Status& why) {
  Logger()->warn("skipping checkpoint step {}: {}", step, why.ToString());
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.corrupt_skipped;
  }
  if (o_.incidents == nullptr) return;
  Incident inc;
  inc.id = internal::RandomHex16();
  inc.time_unix_ms = internal::NowUnixMs();
  inc.host = internal::HostName();
  inc.rank = o_.rank;
  inc.world_size = o_.world_size;
  inc.step = step;
  inc.phase = "checkpoint";
  inc.kind = "host";
  inc.exception_type = "oomguard::DataLoss";
  inc.message = why.message();
  inc.action = std::string(LadderActionName(LadderAction::kRollback));
  inc.outcome = std::string(IncidentOutcomeName(IncidentOutcome::kFailed));
  try {
    o_.incidents->Record(inc);
  } catch (...) {
    Logger()->warn("incident sink failed to record a corrupt checkpoint");
  }
}

StatusOr<int64_t> CheckpointerImpl::LoadLatest() {
  (void)Wait();
  std::vector<int64_t> steps = CommittedSteps(o_.dir);
  if (steps.empty()) return Status::NotFound("no committed checkpoint in " + o_.dir);
  std::string failures;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    Status s = LoadStep(*it);
    if (s.ok()) return *it;
    RecordCorrupt(*it, s);
    failures += "; step " + std::to_string(*it) + ": " + s.message();
  }
  return Status::DataLoss("no checkpoint in " + o_.dir + " verifies" + failures);
}

Status CheckpointerImpl::Restore(int64_t step) {
  std::shared_ptr<StagedState> snap;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (retained_ && retained_->step == step) snap = retained_;
  }
  if (snap) {
    // The writer only reads a snapshot, so copying out of it is safe while it is written.
    if (copier_ != nullptr) OOMGUARD_RETURN_IF_ERROR(BeginDeviceCopies());
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      if (e.is_object) continue;
      if (e.bytes == 0) continue;
      if (e.on_cuda) {
        OOMGUARD_RETURN_IF_ERROR(copier_->ToDevice(e.data, snap->data[i].data(), static_cast<size_t>(e.bytes)));
      } else {
        std::memcpy(e.data, snap->data[i].data(), static_cast<size_t>(e.bytes));
      }
    }
    if (copier_ != nullptr) OOMGUARD_RETURN_IF_ERROR(copier_->Sync());
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (!entries_[i].is_object) continue;
      Status s = entries_[i].load(snap->data[i]);
      if (!s.ok()) return Status(s.code(), "restoring object /" + entries_[i].path + ": " + s.message());
    }
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.restores_from_memory;
    return Status::Ok();
  }
  (void)Wait();
  // Exactly this step: a rollback that quietly landed on an older one would
  // leave this rank out of step with the others.
  Status s = LoadStep(step);
  if (!s.ok()) {
    RecordCorrupt(step, s);
    return Status(s.code(), "cannot restore step " + std::to_string(step) + ": " + s.message());
  }
  return Status::Ok();
}

std::vector<int64_t> CheckpointerImpl::DurableSteps() {
  // The newest ones are what a rollback wants; older shards may have been
  // removed by retention on another rank's behalf, so each is checked.
  constexpr size_t kMostRecent = 16;
  std::vector<int64_t> candidates;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = durable_.rbegin(); it != durable_.rend() && candidates.size() < kMostRecent; ++it)
      candidates.push_back(*it);
  }
  std::vector<int64_t> out, gone;
  for (int64_t step : candidates) {
    struct stat st {};
    (::stat(ShardPath(step).c_str(), &st) == 0 ? out : gone).push_back(step);
  }
  if (!gone.empty()) {
    std::lock_guard<std::mutex> lk(mu_);
    for (int64_t step : gone) durable_.erase(step);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace

Status Checkpointer::CommitDurable(int64_t step, int world_size) {
  if (options().commit_manifest_locally) return Status::Ok();
  // The guard calls this between collectives: an exception here (an injected
  // fault, bad_alloc) must become a status that reaches every rank.
  try {
    return CommitManifest(step, world_size);
  } catch (const std::bad_alloc& e) {
    return Status::ResourceExhausted("committing checkpoint of step " + std::to_string(step) +
                                     " ran out of host memory: " + e.what());
  } catch (const std::exception& e) {
    return Status::Internal("committing checkpoint of step " + std::to_string(step) + " failed: " + e.what());
  }
}

StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(const CheckpointOptions& o) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("CheckpointOptions." + m); };
  if (o.dir.empty()) return bad("dir must be set");
  if (o.world_size < 1) return bad("world_size must be >= 1 (got " + std::to_string(o.world_size) + ")");
  if (o.rank < 0 || o.rank >= o.world_size)
    return bad("rank must be in [0, world_size) (got " + std::to_string(o.rank) + ")");
  if (o.every_steps < 0) return bad("every_steps must be >= 0");
  if (o.keep < 0) return bad("keep must be >= 0");
  // Negative levels are zstd's fast mode (less ratio, much more speed); 0
  // would silently mean zstd's default level 3, so it is refused.
  if (o.compression_level < -7 || o.compression_level > 22 || o.compression_level == 0)
    return bad("compression_level must be in [-7, -1] (fast) or [1, 22] (got " +
               std::to_string(o.compression_level) + ")");
  if (o.chunk_bytes < 4096 || o.chunk_bytes > (int64_t{1} << 30))
    return bad("chunk_bytes must be in [4 KiB, 1 GiB] (got " + std::to_string(o.chunk_bytes) + ")");
  if (o.staging_budget_bytes < 0) return bad("staging_budget_bytes must be >= 0");
  if (o.threads < 0) return bad("threads must be >= 0");
  if (o.stage_threads < 0) return bad("stage_threads must be >= 0");
  std::error_code ec;
  fs::create_directories(o.dir, ec);
  if (ec)
    return Status::InvalidArgument("CheckpointOptions.dir: cannot create " + o.dir + ": " + ec.message());
  return std::unique_ptr<Checkpointer>(new CheckpointerImpl(o));
}

Checkpointer::~Checkpointer() = default;

}  // namespace oomguard
