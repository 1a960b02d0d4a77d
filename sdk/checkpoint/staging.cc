// The blocking part of a save: copying the registered state into staging
// buffers — whole, on the calling thread and the stage pool's helpers (host)
// or through the device copier (CUDA), or in pieces that the writer consumes
// when the state is larger than the staging budget — and the in-memory
// snapshot kept for instant rollback.
#include "sdk/checkpoint/checkpointer_impl.h"

namespace oomguard::ckpt_internal {

void ShapeStagedState(StagedState& s, const std::vector<int64_t>& layout) {
  s.data.resize(layout.size());
  if (s.layout == layout) return;
  for (void* p : s.pinned) ckpt::UnpinHost(p, s.device);
  s.pinned.assign(layout.size(), nullptr);
  // Page-aligned runs: a CUDA entry's run is pinned on its own, and every run
  // starts where non-temporal stores want it.
  const int64_t page = 4096;
  int64_t total = 0;
  for (int64_t b : layout)
    if (b > 0) total += (b + page - 1) / page * page;
  s.layout.clear();
  s.arena = ckpt::HostBuffer(static_cast<size_t>(total));
  int64_t off = 0;
  for (size_t i = 0; i < layout.size(); ++i) {
    s.data[i] = ckpt::StagedBytes();
    if (layout[i] < 0) continue;
    s.data[i] = ckpt::StagedBytes(layout[i] > 0 ? s.arena.data() + off : nullptr, static_cast<size_t>(layout[i]));
    if (layout[i] > 0) off += (layout[i] + page - 1) / page * page;
  }
  s.layout = layout;
}

// Copies every range on the calling thread and the helpers of `pool` (if
// any), in slices handed out through one atomic counter. Small copies stay on
// the calling thread: waking helpers costs more than it saves. Streamed
// stores (host_buffer.h): nobody reads the staged bytes before the writer.
void ParallelCopy(const std::vector<CopyRange>& ranges, ckpt::ThreadPool* pool) {
  constexpr size_t kSlice = size_t{4} << 20;
  size_t total = 0;
  for (const auto& r : ranges) total += r.bytes;
  if (pool == nullptr || total < 4 * kSlice) {
    for (const auto& r : ranges) ckpt::StreamCopy(r.dst, r.src, r.bytes);
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
      ckpt::StreamCopy(slices[i].dst, slices[i].src, slices[i].bytes);
  };
  std::vector<std::future<void>> helpers;
  for (int h = 0; h < pool->size(); ++h) helpers.push_back(pool->Submit(work));
  work();
  for (auto& f : helpers) f.wait();
}

StatusOr<std::shared_ptr<StagedState>> CheckpointerImpl::StageWithinBudget(
    int64_t step, std::vector<std::vector<uint8_t>>& object_bytes, int64_t need) {
  const int64_t budget = o_.staging_budget_bytes;
  std::shared_ptr<StagedState> snap;
  {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      const int64_t retained_idle = buffers_.RetainedIdle();
      if (budget == 0 || buffers_.inflight_bytes() + retained_idle + need <= budget) break;
      if (retained_idle > 0) {
        // Its step is durable by now; rollback falls back to disk.
        buffers_.ReleaseRetained();
        continue;
      }
      cv_.wait(lk);  // back-pressure: a write must finish first
    }
    snap = buffers_.TakeSpare();
  }
  if (!snap) snap = std::make_shared<StagedState>();
  const std::vector<int64_t> layout = StagingLayout();
  if (snap->layout != layout) {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.stall_allocations;
  }
  ShapeStagedState(*snap, layout);
  snap->step = step;
  snap->bytes = need;
  bool device_copies = false;
  std::vector<CopyRange> host_copies;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.is_object) {
      snap->data[i] = ckpt::StagedBytes(std::move(object_bytes[i]));
      continue;
    }
    auto& buf = snap->data[i];
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
  buffers_.Retain(*snap);
  stats_.state_bytes = need;
  state_used_ = true;  // a step of the registered state is held
  return Status::Ok();
}

Status CheckpointerImpl::SaveAsync(int64_t step) {
  // A directory name no load would parse back (step--0000001) is refused
  // before anything is staged; it is a bad argument, not a failed save.
  if (step < 0 || step > kMaxStep)
    return Status::InvalidArgument("SaveAsync(" + std::to_string(step) + "): a step is in [0, " +
                                   std::to_string(kMaxStep) + "]");
  // The guard calls this between collectives, and a user's save callback, a
  // fault point or an allocation may throw inside: a std::exception becomes
  // the status. A failure before the save reached the writer is counted
  // here (the writer counts the others), so Stats() and Wait() see it.
  bool queued = false;
  Status s;
  try {
    s = Stage(step, &queued);
  } catch (const std::bad_alloc& e) {
    s = Status::ResourceExhausted("staging checkpoint of step " + std::to_string(step) +
                                  " ran out of host memory: " + e.what());
  } catch (const DeviceOomError& e) {
    s = Status::ResourceExhausted("staging checkpoint of step " + std::to_string(step) +
                                  " ran out of device memory: " + e.what());
  } catch (const std::exception& e) {
    s = Status::Internal("checkpoint of step " + std::to_string(step) + " failed: " + e.what());
  } catch (...) {
    // Not a std::exception: the host language's own (a Python
    // KeyboardInterrupt carried through a save callback). Counted, and
    // passed on: it is not the SDK's to swallow.
    if (!queued)
      RecordSaveFailure(step, Status::Cancelled("checkpoint of step " + std::to_string(step) +
                                                " stopped: a save callback raised an exception that is not a "
                                                "std::exception (passed on to the caller)"));
    throw;
  }
  if (!s.ok() && !queued) RecordSaveFailure(step, s);
  return s;
}

void CheckpointerImpl::NoteSaveFailure(int64_t step, const Status& s) {
  ++stats_.save_failures;
  stats_.last_error = s;
  saves_.NoteFailure(step, s);
}

void CheckpointerImpl::RecordSaveFailure(int64_t step, const Status& s) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    NoteSaveFailure(step, s);
  }
  Logger()->error("checkpoint of step {} failed: {}", step, s.ToString());
}

Status CheckpointerImpl::Stage(int64_t step, bool* queued) {
  const auto t0 = Clock::now();
  FaultPoint(FaultSite::kCkptStage, FaultContext{step, o_.rank, -1, 0});
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.saves_started;
  }
  if (in_memory()) {
    // No directory: the save is the in-memory snapshot (rollback without disk).
    OOMGUARD_RETURN_IF_ERROR(Snapshot(step));
    std::lock_guard<std::mutex> lk(mu_);
    stats_.stall_ms.push_back(MsSince(t0));
    return Status::Ok();
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
      buffers_.StartWriting(*snap);
      if (o_.keep_snapshot) buffers_.Retain(snap);
      stats_.state_bytes = need;
      stats_.stall_ms.push_back(MsSince(t0));
      saves_.Push(std::move(job));
      *queued = true;
      state_used_ = true;  // a step of the registered state is on its way to disk
    }
    cv_.notify_all();
  } else {
    // Larger than the budget: wait until nothing else holds staging memory,
    // then stream chunk copies to the writer.
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return saves_.Idle(); });
      buffers_.DropAll();
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
      saves_.Push(std::move(job));
      *queued = true;  // from here the writer reports what goes wrong
      state_used_ = true;
    }
    cv_.notify_all();
    // From here the writer waits for pieces: any way out of this function
    // that does not publish them all must tell it so.
    struct AbortUnlessDone {
      std::shared_ptr<PieceSource> pieces;
      bool done = false;
      ~AbortUnlessDone() {
        if (!done) pieces->Abort();
      }
    } abort_unless_done{pieces};
    std::vector<hsize_t> offset;
    int64_t pieces_published = 0;
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (!whole[i].empty() || entries_[i].bytes == 0) continue;
      ckpt::ChunkLayout L = ckpt::PlanChunks(tensors[i].shape, DTypeSize(tensors[i].dtype), o_.chunk_bytes);
      for (int64_t c = 0; c < L.count; ++c) {
        int64_t begin = 0, len = 0;
        ckpt::ChunkPosition(tensors[i].shape, L, c, &offset, &begin, &len);
        // Before each piece, with the piece's number as the micro index: a
        // fault here is a staging failure after the writer began consuming.
        FaultPoint(FaultSite::kCkptStage, FaultContext{step, o_.rank, static_cast<int>(pieces_published), 0});
        ++pieces_published;
        if (entries_[i].on_cuda) {
          std::vector<uint8_t> host;
          OOMGUARD_RETURN_IF_ERROR(CopyOut(entries_[i], begin, len, &host));
          pieces->Publish(i, begin, host.data(), len);
        } else {
          pieces->Publish(i, begin, static_cast<const uint8_t*>(entries_[i].data) + begin, len);
        }
      }
    }
    abort_unless_done.done = true;
    std::lock_guard<std::mutex> lk(mu_);
    stats_.stall_ms.push_back(MsSince(t0));
  }
  return Status::Ok();
}

}  // namespace oomguard::ckpt_internal
