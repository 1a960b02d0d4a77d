// The background writer thread: takes staged saves off the queue in order,
// writes each as this rank's shard (compression on the pool, outside the HDF5
// lock), and with local commit writes the manifest too. Its failures are
// counted and kept for Wait(); a later durable save supersedes them.
#include "sdk/checkpoint/checkpointer_impl.h"

namespace oomguard::ckpt_internal {

void CheckpointerImpl::WriterLoop() {
  for (;;) {
    WriteJob job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return saves_.HasWorkOrStop(); });
      if (!saves_.Pop(&job)) return;
    }
    Status s;
    try {
      s = Write(job);
    } catch (const std::bad_alloc& e) {
      // Injected faults (ckpt_write/ckpt_manifest oom rules) and allocation failures.
      s = Status::ResourceExhausted(std::string("checkpoint writer: ") + e.what());
    } catch (const std::exception& e) {
      s = (dynamic_cast<const DeviceOomError*>(&e) != nullptr)
              ? Status::ResourceExhausted(std::string("checkpoint writer: ") + e.what())
              : Status::Internal(std::string("checkpoint writer: ") + e.what());
    }
    if (!s.ok() && job.pieces) job.pieces->Abort();
    // Before the save counts as done, so that a save right after Wait()
    // finds the spare ready instead of faulting in a fresh buffer.
    if (job.snapshot) PrepareSpare(job.snapshot);
    {
      std::lock_guard<std::mutex> lk(mu_);
      saves_.Done();
      stats_.last_write_ms = MsSince(job.started);
      // A snapshot whose write failed is not a checkpoint, but it is still
      // a complete copy of that step's state: it stays usable for rollback.
      if (job.snapshot) buffers_.DoneWriting(job.snapshot);
      if (!s.ok()) {
        NoteSaveFailure(job.step, s);
      } else {
        saves_.NoteWritten(job.step);
      }
    }
    if (!s.ok()) Logger()->error("checkpoint of step {} failed: {}", job.step, s.ToString());
    cv_.notify_all();
  }
}

void CheckpointerImpl::PrepareSpare(const std::shared_ptr<StagedState>& written) {
  // After the first save with keep_snapshot, one buffer holds the retained
  // snapshot and the next save needs a second one: faulting that one in
  // inside the next stall cost 5x the copy (131k page faults for 512 MiB).
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (saves_.stopping() || buffers_.has_spare() || written != buffers_.retained()) return;
    const int64_t held = buffers_.inflight_bytes() + buffers_.RetainedIdle();
    if (o_.staging_budget_bytes > 0 && held + written->bytes > o_.staging_budget_bytes) return;
  }
  auto spare = std::make_shared<StagedState>();
  try {
    ShapeStagedState(*spare, written->layout);
    spare->arena.Prefault();
  } catch (const std::bad_alloc&) {
    return;  // the next save allocates its own, inside its stall
  }
  spare->device = written->device;
  for (size_t i = 0; i < written->pinned.size(); ++i) {
    if (written->pinned[i] == nullptr || spare->data[i].size() == 0) continue;
    if (ckpt::PinHost(spare->data[i].data(), spare->data[i].size(), spare->device))
      spare->pinned[i] = spare->data[i].data();
  }
  std::lock_guard<std::mutex> lk(mu_);
  buffers_.OfferSpare(std::move(spare));
}

Status CheckpointerImpl::Write(WriteJob& job) {
  const std::string dir = StepDir(job.step);
  // Whatever this rank held of the step before is being replaced.
  steps_.Replacing(job.step);
  OOMGUARD_RETURN_IF_ERROR(UsableStepDir(job.step));
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
  ChooseCompression(job, &wo);
  wo.chunk_bytes = o_.chunk_bytes;
  wo.fsync = o_.fsync;
  wo.frames = &frames_;
  const FaultContext ctx{job.step, o_.rank, -1, 0};
  wo.midway = [ctx] { FaultPoint(FaultSite::kCkptWrite, ctx); };
  const std::string file = ckpt::ShardFileName(o_.rank);
  const auto started = std::chrono::steady_clock::now();
  auto res = ckpt::WriteShard(dir + "/" + file, job.tensors, job.source.get(), pool_.get(), wo);
  if (!res.ok()) return res.status();
  // Only a large, fsynced file measures the disk rather than latency.
  if (o_.fsync && res->file_bytes >= ckpt::kAutoMinBytes && res->io_seconds > 0) {
    auto_.write_bytes_per_s = static_cast<double>(res->file_bytes) / res->io_seconds;
    // A compressed save against its compression alone at the sampled speed.
    if (wo.compress)
      auto_.calibration.Observe(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
          auto_.sampled_compress_seconds);
  }
  ckpt::ManifestShard own;
  own.rank = o_.rank;
  own.file = file;
  own.bytes = res->file_bytes;
  own.digest = res->digest;
  own.compression = res->compression;
  own.auto_choice = wo.compression_auto;
  // With local commit a step counts once its manifest is written (below).
  steps_.ShardWritten(job.step, std::move(own), /*durable_now=*/!CommitsLocally());
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.last_compression = res->compression;
    stats_.last_compression_auto = wo.compression_auto;
    ++stats_.checkpoints_written;
    stats_.last_file_bytes = res->file_bytes;
  }
  if (CommitsLocally()) return CommitManifest(job.step, o_.world_size);
  return Status::Ok();
}

void CheckpointerImpl::ChooseCompression(const WriteJob& job, ckpt::ShardWriteOptions* wo) {
  auto_.sampled_compress_seconds = 0;
  if (o_.compression != CheckpointCompression::kAuto) {
    wo->compress = o_.compression == CheckpointCompression::kZstd;
    return;
  }
  int64_t state_bytes = 0;
  for (const auto& t : job.tensors) state_bytes += t.bytes;
  std::optional<ckpt::CompressionSample> sample = auto_.last_sample;
  // The sample is taken only when there is a choice to make (the staged
  // snapshot is whole in memory; piece-wise saves reuse the last sample).
  if (state_bytes >= ckpt::kAutoMinBytes && auto_.write_bytes_per_s && job.snapshot) {
    std::vector<ckpt::SampleSource> state;
    for (size_t t = 0; t < job.tensors.size(); ++t) {
      const DType d = job.tensors[t].dtype;
      state.push_back(
          {job.snapshot->data[t], std::max<size_t>(1, DTypeSize(d)),
           d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat32 || d == DType::kFloat64});
    }
    sample = ckpt::SampleCompression(state, o_.compression_level, o_.chunk_bytes, pool_.get());
    auto_.last_sample = sample;
  }
  const ckpt::AutoCompression c = ckpt::ChooseCompression(state_bytes, o_.compression_level,
                                                          auto_.write_bytes_per_s, sample, auto_.calibration);
  wo->compress = c.compress;
  wo->compression_auto = c.why;
  auto_.sampled_compress_seconds = c.sampled_compress_seconds;
}

}  // namespace oomguard::ckpt_internal
