// KnowledgeBase: the store behind a bounded queue and one writer thread.
//
// Invariants:
// - The training thread (sink Record/UpdateOutcome, RecordCleanMicroBatch)
//   only copies into the queue under mu_; it never touches SQLite, never
//   waits for the writer, never throws.
// - Operations are written in the order they were queued, so an UpdateOutcome
//   always lands after the Record it completes.
// - processed_ counts queued operations the writer has finished (written,
//   spooled or lost); Flush waits for processed_ to reach the count at its call.
// - With a server (spool_ set): while this process's spool holds incidents,
//   new incidents join it rather than overtake it, so an UpdateOutcome still
//   lands after its Record; the writer retries the server every
//   retry_interval_ms and sends the spool (its own file first) when it answers.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "oomguard/faults.h"
#include "oomguard/knowledge_base.h"
#include "oomguard/logging.h"
#include "sdk/core/ids.h"
#include "sdk/kb/spool.h"
#include "sdk/kb/store.h"

namespace oomguard {
namespace {

constexpr size_t kMaxBatch = 256;

struct Op {
  enum Kind { kIncident, kPrior } kind = kIncident;
  Incident incident;
  kb::PriorUpdate prior;
};

class KnowledgeBaseImpl;

class QueueSink final : public IncidentSink {
 public:
  explicit QueueSink(KnowledgeBaseImpl* kb) : kb_(kb) {}
  void Record(const Incident& incident) override;
  void UpdateOutcome(const Incident& incident) override;

 private:
  KnowledgeBaseImpl* kb_;
};

class KnowledgeBaseImpl final : public KnowledgeBase {
 public:
  KnowledgeBaseImpl(std::string path, KnowledgeBaseOptions options, std::unique_ptr<kb::Store> writer_store,
                    std::unique_ptr<kb::Store> reader_store, std::unique_ptr<kb::Spool> spool = nullptr)
      : path_(std::move(path)),
        options_(options),
        sink_(this),
        spool_(std::move(spool)),
        writer_store_(std::move(writer_store)),
        reader_store_(std::move(reader_store)) {
    if (spool_ != nullptr && spool_->orphans()) spool_has_data_ = true;
    // A reader (options.read_only) has no writer store and no writer thread.
    if (writer_store_ != nullptr) writer_ = std::thread([this] { WriterLoop(); });
  }

  ~KnowledgeBaseImpl() override {
    (void)Flush();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    if (writer_.joinable()) writer_.join();
  }

  IncidentSink* sink() override { return &sink_; }

  // Training thread. Copies the incident (the only allocation) and returns.
  void Enqueue(const Incident& incident, bool is_record) noexcept {
    try {
      Op op;
      op.incident = incident;
      std::unique_lock<std::mutex> lock(mu_);
      if (is_record && !incident.injected && !incident.workload.empty()) {
        // An OOM invalidates clean sizes seen so far in this session (see RecordCleanMicroBatch).
        SessionPrior& sp = session_priors_[PriorKey(incident.workload, incident.rank, incident.world_size)];
        sp.saw_oom = true;
        sp.best = 0;
      }
      PushLocked(std::move(op));
    } catch (...) {
      // Out of host memory while copying: count it as a drop; training goes on.
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.dropped;
      ++unrecorded_drops_;
    }
  }

  Status Flush() override {
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t target = queued_;
    // Bounded: a writer stuck on another process's lock gives up each batch
    // after busy_timeout_ms, so this returns in a few busy timeouts at most.
    auto limit = std::chrono::milliseconds(10000 + 4LL * options_.busy_timeout_ms);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    if (!done_cv_.wait_until(lock, deadline, [&] { return processed_ >= target; }))
      return Status::DeadlineExceeded("knowledge base " + path_ + ": flush timed out; " +
                                      std::to_string(queued_ - processed_) + " operations still queued");
    Status s = std::move(flush_error_);
    flush_error_ = Status::Ok();
    if (s.ok() && spool_has_data_) {
      // One more try at the server for what waits in the spool.
      const uint64_t attempt = drain_attempts_;
      drain_requested_ = true;
      work_cv_.notify_all();
      done_cv_.wait_until(lock, deadline, [&] { return drain_attempts_ > attempt || stop_; });
      if (spool_has_data_)
        return Status::Unavailable("knowledge base " + path_ + ": " + std::to_string(stats_.spool_pending) +
                                   " record(s) (incidents, priors) wait in the spool " + spool_->dir() +
                                   " for the server; they are sent when it answers (by this job, or the next "
                                   "one using that spool)");
    }
    return s;
  }

  std::optional<int64_t> PriorMicroBatch(const std::string& workload) override {
    std::lock_guard<std::mutex> lock(reader_mu_);
    auto p = reader_store_->Prior(workload);
    if (!p.ok()) {
      Logger()->warn("knowledge base: cannot read the prior of '{}': {}", workload, p.status().ToString());
      return std::nullopt;
    }
    return *p;
  }

  Status RecordCleanMicroBatch(const std::string& workload, int64_t size) override {
    if (workload.empty()) return Status::InvalidArgument("RecordCleanMicroBatch: workload is empty");
    if (size < 1) return Status::InvalidArgument("RecordCleanMicroBatch: size must be >= 1 (got " +
                                                 std::to_string(size) + ")");
    try {
      std::lock_guard<std::mutex> lock(mu_);
      SessionPrior& sp = session_priors_[workload];
      // Only a new best is worth a write: most clean steps repeat the size.
      if (size <= sp.best) return Status::Ok();
      sp.best = size;
      Op op;
      op.kind = Op::kPrior;
      op.prior = {workload, size, sp.saw_oom, std::nullopt, internal::NowUnixMs()};
      PushLocked(std::move(op));
    } catch (...) {
      return Status::ResourceExhausted("RecordCleanMicroBatch: out of host memory");
    }
    return Status::Ok();
  }

  std::optional<SizeModel> PriorModel(const std::string& workload) override {
    std::lock_guard<std::mutex> lock(reader_mu_);
    auto m = reader_store_->PriorModel(workload);
    if (!m.ok()) {
      Logger()->warn("knowledge base: cannot read the prior model of '{}': {}", workload,
                     m.status().ToString());
      return std::nullopt;
    }
    return *m;
  }

  Status RecordModel(const std::string& workload, const SizeModel& model) override {
    if (workload.empty()) return Status::InvalidArgument("RecordModel: workload is empty");
    if (!(model.unit_bytes > 0) || model.fixed_bytes < 0 || model.overhead_bytes < 0 || model.overhead < 0 ||
        model.overhead_too_small < 0 || model.noise_bytes < 0)
      return Status::InvalidArgument("RecordModel: the model needs unit_bytes > 0 and no negative field");
    try {
      std::lock_guard<std::mutex> lock(mu_);
      SessionPrior& sp = session_priors_[workload];
      // Steady state repeats the model: only a change is worth a write.
      if (sp.model && Close(*sp.model, model)) return Status::Ok();
      sp.model = model;
      Op op;
      op.kind = Op::kPrior;
      op.prior.workload = workload;
      op.prior.model = model;
      op.prior.learned_unix_ms = internal::NowUnixMs();
      PushLocked(std::move(op));
    } catch (...) {
      return Status::ResourceExhausted("RecordModel: out of host memory");
    }
    return Status::Ok();
  }

  SinkStats sink_stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  Status Insert(std::vector<Incident> incidents) override {
    if (options_.read_only) return ReadOnlyError();
    for (auto& inc : incidents) Prepare(&inc);
    std::lock_guard<std::mutex> lock(reader_mu_);
    return reader_store_->Write(incidents, {}, 0);
  }

  StatusOr<std::vector<Incident>> Query(const IncidentQuery& q) override {
    std::lock_guard<std::mutex> lock(reader_mu_);
    return reader_store_->Query(q);
  }
  StatusOr<std::vector<IncidentGroup>> Groups() override {
    std::lock_guard<std::mutex> lock(reader_mu_);
    return reader_store_->Groups();
  }
  StatusOr<KnowledgeBaseStats> Stats() override {
    std::lock_guard<std::mutex> lock(reader_mu_);
    return reader_store_->Stats();
  }
  StatusOr<int64_t> Count(const IncidentQuery& q) override {
    std::lock_guard<std::mutex> lock(reader_mu_);
    return reader_store_->Count(q);
  }
  Status SetNote(const GroupNote& note) override {
    if (options_.read_only) return ReadOnlyError();
    std::lock_guard<std::mutex> lock(reader_mu_);
    return reader_store_->SetNote(note);
  }
  StatusOr<std::vector<GroupNote>> Notes() override {
    std::lock_guard<std::mutex> lock(reader_mu_);
    return reader_store_->Notes();
  }
  const std::string& path() const override { return path_; }

 private:
  struct SessionPrior {
    int64_t best = 0;      // largest clean size since the last OOM of this session
    bool saw_oom = false;  // this session recorded an OOM for the workload
    std::optional<SizeModel> model;  // the last model this session queued
  };

  Status ReadOnlyError() const {
    return Status::FailedPrecondition("knowledge base " + path_ + " is open for reading only");
  }

  // Within 1% (or 1 KiB, or a share of 0.001) in every field.
  static bool Close(const SizeModel& a, const SizeModel& b) {
    auto near = [](double x, double y, double floor) {
      return std::fabs(x - y) <= std::max(floor, 0.01 * std::fabs(y));
    };
    return near(a.fixed_bytes, b.fixed_bytes, 1024) && near(a.unit_bytes, b.unit_bytes, 1) &&
           near(a.overhead_bytes, b.overhead_bytes, 1024) && near(a.overhead, b.overhead, 0.001) &&
           near(a.overhead_too_small, b.overhead_too_small, 0.001) &&
           near(a.noise_bytes, b.noise_bytes, 1024);
  }

  // REQUIRES: mu_ held.
  void PushLocked(Op op) {
    if (options_.read_only) {
      // Nothing will write it: lost, and said so by Flush and sink_stats.
      ++stats_.write_errors;
      stats_.last_error = ReadOnlyError().ToString();
      if (flush_error_.ok()) flush_error_ = ReadOnlyError();
      return;
    }
    if (queue_.size() >= options_.queue_capacity) {
      ++stats_.dropped;
      ++unrecorded_drops_;
      return;
    }
    queue_.push_back(std::move(op));
    ++queued_;
    ++stats_.enqueued;
    work_cv_.notify_one();
  }

  void Prepare(Incident* inc) const {
    if (options_.classify && inc->pattern.empty()) {
      ClassifyInPlace(inc);
    } else if (inc->fingerprint.empty()) {
      inc->fingerprint = IncidentFingerprint(*inc);
    }
  }

  // Writer thread: sends what waits in the spool; true when it is empty now.
  bool TryDrain() {
    int64_t sent = 0;
    Status s = spool_->Drain(
        [&](const std::vector<Incident>& part, const std::vector<kb::PriorUpdate>& priors) {
          return writer_store_->Write(part, priors, 0);
        },
        kMaxBatch, &sent);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.written += sent;
    stats_.spool_pending = spool_->pending();
    spool_has_data_ = !s.ok() || spool_->pending() > 0 || spool_->orphans();
    if (!s.ok()) stats_.last_error = s.ToString();
    ++drain_attempts_;
    done_cv_.notify_all();
    return !spool_has_data_;
  }

  void WriterLoop() {
    std::vector<Op> batch;
    auto next_retry = std::chrono::steady_clock::now();
    for (;;) {
      int64_t drops = 0;
      bool drain_now = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        auto ready = [&] { return stop_ || !queue_.empty() || unrecorded_drops_ > 0 || drain_requested_; };
        if (spool_has_data_)
          work_cv_.wait_until(lock, next_retry, ready);
        else
          work_cv_.wait(lock, ready);
        if (stop_ && queue_.empty()) return;
        size_t n = std::min(kMaxBatch, queue_.size());
        batch.clear();
        for (size_t i = 0; i < n; ++i) {
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
        drops = unrecorded_drops_;
        unrecorded_drops_ = 0;
        drain_now = spool_has_data_ && (drain_requested_ || std::chrono::steady_clock::now() >= next_retry);
        drain_requested_ = false;
      }
      if (drain_now) {
        TryDrain();
        next_retry = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.retry_interval_ms);
      }
      std::vector<Incident> incidents;
      std::vector<kb::PriorUpdate> priors;
      for (Op& op : batch) {
        if (op.kind == Op::kPrior) {
          priors.push_back(std::move(op.prior));
        } else {
          Prepare(&op.incident);
          incidents.push_back(std::move(op.incident));
        }
      }
      int64_t spooled = 0;  // records (incidents and priors) put in the spool
      Status spool_error;
      auto to_spool = [&](bool with_priors) {
        const std::vector<kb::PriorUpdate> none;
        spool_error = spool_->Append(incidents, with_priors ? priors : none);
        if (spool_error.ok())
          spooled += static_cast<int64_t>(incidents.size() + (with_priors ? priors.size() : 0));
        incidents.clear();
        if (with_priors) priors.clear();
      };
      // Behind a spool that still holds this process's incidents, new ones
      // queue up there too (in order). Priors need no order (each carries
      // when it was learned): they try the server first.
      if (spool_ != nullptr && spool_->pending() > 0 && !incidents.empty()) to_spool(false);
      Status s;
      try {
        // The kb_write fault site: a kill tests that a half-written batch
        // never corrupts the file (SQLite's transaction); an injected OOM
        // counts as a failed write, like a full disk.
        FaultPoint(FaultSite::kKbWrite, FaultContext{});
        s = writer_store_->Write(incidents, priors, drops);
        if (!s.ok() && spool_ != nullptr && s.code() == StatusCode::kUnavailable &&
            (!incidents.empty() || !priors.empty())) {
          // The server is away: the incidents and priors wait on disk; the
          // drop count of this batch is lost.
          to_spool(true);
          s = Status::Ok();
        }
      } catch (const std::exception& e) {
        s = Status::ResourceExhausted(std::string("knowledge base writer: ") + e.what());
      }
      if (!spool_error.ok() && s.ok()) s = spool_error;
      std::lock_guard<std::mutex> lock(mu_);
      processed_ += batch.size();
      if (spooled > 0) {
        stats_.spooled += spooled;
        stats_.spool_pending = spool_->pending();
        if (!spool_has_data_) next_retry = std::chrono::steady_clock::now() +
                                           std::chrono::milliseconds(options_.retry_interval_ms);
        spool_has_data_ = true;
      }
      // What did not go to the spool reached the store, or (on an error) is lost.
      const int64_t not_spooled = static_cast<int64_t>(batch.size()) - spooled;
      if (s.ok()) {
        stats_.written += not_spooled;
      } else {
        const int64_t lost = not_spooled;
        stats_.write_errors += lost;
        stats_.last_error = s.ToString();
        if (flush_error_.ok()) flush_error_ = s;
        // The first failure and then every 100th, so a dead disk does not flood the log.
        if (failures_++ % 100 == 0)
          Logger()->warn("knowledge base: {} incident operation(s) lost: {}", lost, s.ToString());
      }
      done_cv_.notify_all();
    }
  }

  const std::string path_;
  const KnowledgeBaseOptions options_;
  QueueSink sink_;

  mutable std::mutex mu_;  // guards everything below up to reader_mu_
  std::condition_variable work_cv_, done_cv_;
  std::deque<Op> queue_;
  uint64_t queued_ = 0, processed_ = 0;
  int64_t unrecorded_drops_ = 0;
  int64_t failures_ = 0;
  bool stop_ = false;
  SinkStats stats_;
  Status flush_error_;
  std::map<std::string, SessionPrior> session_priors_;
  bool spool_has_data_ = false;  // the spool holds incidents (ours or orphans)
  bool drain_requested_ = false;  // Flush asks the writer to try the server now
  uint64_t drain_attempts_ = 0;

  std::unique_ptr<kb::Spool> spool_;  // writer thread only; set for a server

  std::unique_ptr<kb::Store> writer_store_;  // writer thread only
  std::mutex reader_mu_;                     // guards reader_store_
  std::unique_ptr<kb::Store> reader_store_;
  std::thread writer_;
};

void QueueSink::Record(const Incident& incident) { kb_->Enqueue(incident, true); }
void QueueSink::UpdateOutcome(const Incident& incident) { kb_->Enqueue(incident, false); }

}  // namespace

KnowledgeBase::~KnowledgeBase() = default;

int KnowledgeBase::SchemaVersion() { return kb::kSchemaVersion; }

namespace {

// KnowledgeBaseOptions.spool_dir's default for a server URL.
std::string DefaultSpoolDir(const std::string& redacted_url) {
  if (const char* env = std::getenv("OOMGUARD_KB_SPOOL"); env != nullptr && *env != '\0') return env;
  std::string base;
  if (const char* state = std::getenv("XDG_STATE_HOME"); state != nullptr && *state == '/') {
    base = state;
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home == '/') {
    base = std::string(home) + "/.local/state";
  } else {
    base = "/tmp";
  }
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016zx", std::hash<std::string>{}(redacted_url));
  return base + "/oomguard/kb-spool/" + hash;
}

}  // namespace

StatusOr<std::unique_ptr<KnowledgeBase>> KnowledgeBase::Open(const std::string& path,
                                                             const KnowledgeBaseOptions& options) {
  if (options.queue_capacity == 0)
    return Status::InvalidArgument("KnowledgeBaseOptions.queue_capacity must be >= 1 (got 0)");
  if (options.read_only) {
    auto reader = kb::Store::OpenReadOnly(path, options.busy_timeout_ms);
    if (!reader.ok()) return reader.status();
    const std::string shown = (*reader)->path();
    return std::unique_ptr<KnowledgeBase>(
        new KnowledgeBaseImpl(shown, options, nullptr, std::move(reader).value()));
  }
  if (kb::IsServerUrl(path)) {
    if (options.retry_interval_ms < 1)
      return Status::InvalidArgument("KnowledgeBaseOptions.retry_interval_ms must be >= 1");
    // A job starts while the server is away: it spools until the server answers.
    auto writer = kb::Store::Open(path, options.busy_timeout_ms, options.create_if_missing, true);
    if (!writer.ok()) return writer.status();
    auto reader = kb::Store::Open(path, options.busy_timeout_ms, false, true);
    if (!reader.ok()) return reader.status();
    const std::string shown = (*writer)->path();
    auto spool = kb::Spool::Open(options.spool_dir.empty() ? DefaultSpoolDir(shown) : options.spool_dir,
                                 options.spool_max_bytes);
    if (!spool.ok()) return Status(spool.status().code(), "knowledge base " + shown + ": " + spool.status().message());
    return std::unique_ptr<KnowledgeBase>(new KnowledgeBaseImpl(
        shown, options, std::move(writer).value(), std::move(reader).value(), std::move(spool).value()));
  }
  auto writer = kb::Store::Open(path, options.busy_timeout_ms, options.create_if_missing);
  if (!writer.ok()) return writer.status();
  auto reader = kb::Store::Open(path, options.busy_timeout_ms, false);
  if (!reader.ok()) return reader.status();
  return std::unique_ptr<KnowledgeBase>(
      new KnowledgeBaseImpl(path, options, std::move(writer).value(), std::move(reader).value()));
}

}  // namespace oomguard
