// Loading: one step's shard verified and read into the registered state
// (through the shared checker of shard_check.h), the newest checkpoint that
// verifies, and Restore — exactly the step asked for, from the in-memory
// snapshot or from disk, never another.
#include "sdk/checkpoint/checkpointer_impl.h"

namespace oomguard::ckpt_internal {

Status CheckpointerImpl::LoadStep(int64_t step) {
  if (in_memory()) return NothingOnDisk();
  state_used_ = true;
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
  std::vector<ckpt::ReadRequest> batch;
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
  inc.phase = Phase::kCheckpoint;
  inc.kind = IncidentKind::kHost;
  inc.exception_type = "oomguard::DataLoss";
  inc.message = why.message();
  inc.action = LadderAction::kRollback;
  inc.outcome = IncidentOutcome::kFailed;
  try {
    o_.incidents->Record(inc);
  } catch (...) {
    Logger()->warn("incident sink failed to record a corrupt checkpoint");
  }
}

StatusOr<int64_t> CheckpointerImpl::LoadLatest() {
  if (in_memory()) return NothingOnDisk();
  (void)Wait();
  std::vector<int64_t> steps = CommittedSteps(o_.dir, /*include_linked=*/true);
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
    if (buffers_.retained() && buffers_.retained()->step == step) snap = buffers_.retained();
  }
  if (snap) {
    state_used_ = true;
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
  if (in_memory())
    return Status::NotFound("cannot restore step " + std::to_string(step) +
                            ": it is not the snapshot held in memory, and this checkpointer has no directory");
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

}  // namespace oomguard::ckpt_internal
