// The commit of a checkpoint: MANIFEST.json, written last, names every rank's
// shard (its size and whole-file hash); retention keeps the newest committed
// ones; DurableSteps says which steps this rank can load.
#include <cerrno>
#include <cstdio>

#include "sdk/checkpoint/checkpointer_impl.h"

namespace oomguard::ckpt_internal {

std::vector<int64_t> CommittedSteps(const std::string& dir, bool include_linked) {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    auto step = ckpt::ParseStepDirName(e.path().filename().string());
    if (!step) continue;
    std::error_code lec;
    if (e.is_symlink(lec) && !include_linked) continue;
    if (fs::exists(e.path() / ckpt::kManifestName, ec)) out.push_back(*step);
  }
  std::sort(out.begin(), out.end());
  return out;
}


Status CheckpointerImpl::CommitManifest(int64_t step, int world_size) {
  std::lock_guard<std::mutex> commit_lock(commit_mu_);
  FaultPoint(FaultSite::kCkptManifest, FaultContext{step, o_.rank, -1, 0});
  const std::string dir = StepDir(step);
  OOMGUARD_RETURN_IF_ERROR(UsableStepDir(step));
  ckpt::Manifest m;
  m.format = std::string(kCheckpointFormat);
  m.step = step;
  m.world_size = world_size;
  m.created_unix = internal::NowUnixMs() / 1000;
  for (int r = 0; r < world_size; ++r) {
    const std::optional<ckpt::ManifestShard> own = steps_.OwnShard(step, r);
    if (own) {
      m.shards.push_back(*own);
      continue;
    }
    // Another rank's shard (shared filesystem): its size, digest and
    // compression from disk.
    ckpt::ManifestShard sh;
    sh.rank = r;
    sh.file = ckpt::ShardFileName(r);
    auto d = ckpt::DigestShardFile(dir + "/" + sh.file);
    if (!d.ok())
      return Status::FailedPrecondition("cannot commit step " + std::to_string(step) + ": " +
                                        d.status().message());
    sh.bytes = d->bytes;
    sh.digest = d->digest;
    sh.compression = d->compression;
    sh.auto_choice = d->compression_auto;
    m.shards.push_back(std::move(sh));
  }
  OOMGUARD_RETURN_IF_ERROR(
      ckpt::WriteFileDurably(dir + "/" + ckpt::kManifestName, ckpt::ManifestToJson(m), o_.fsync));
  steps_.Committed(step, fs::exists(ShardPath(step)));
  {
    std::lock_guard<std::mutex> lk(mu_);
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
    // Never through a link: it may lead to another run's checkpoint.
    if (Status usable = ckpt::CheckStepDir(StepDir(s)); !usable.ok()) {
      if (usable.code() != StatusCode::kNotFound) Logger()->warn("retention leaves alone: {}", usable.message());
      continue;
    }
    // Remove the manifest first: a crash mid-delete leaves an uncommitted directory, never a
    // committed one with shards missing.
    fs::remove(StepDir(s) + "/" + ckpt::kManifestName, ec);
    // Out of the way under a hidden name now, deleted in the background
    // (reaper.h): the save that committed `newest_committed` does not wait
    // for the blocks to be freed.
    const std::string hidden =
        o_.dir + "/" + ckpt::kRemovingPrefix + ckpt::StepDirName(s) + "-" + internal::RandomHex16();
    if (std::rename(StepDir(s).c_str(), hidden.c_str()) == 0) {
      reaper_.Remove(hidden);
      continue;
    }
    if (errno == ENOENT) continue;  // another rank sharing the directory took it
    if (const std::error_code gone = ckpt::RemoveTree(StepDir(s)); gone && gone != std::errc::no_such_file_or_directory)
      Logger()->warn("retention: cannot remove {}: {}", StepDir(s), gone.message());
  }
  if (!doomed.empty() && o_.fsync) (void)ckpt::FsyncPath(o_.dir, true);
}

void CheckpointerImpl::RemoveLeftovers() {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(o_.dir, ec))
    if (e.path().filename().string().rfind(ckpt::kRemovingPrefix, 0) == 0) reaper_.Remove(e.path().string());
}

std::vector<int64_t> CheckpointerImpl::DurableSteps() {
  // The newest ones are what a rollback wants; older shards may have been
  // removed by retention on another rank's behalf, so each is checked.
  constexpr size_t kMostRecent = 16;
  const std::vector<int64_t> candidates = steps_.Newest(kMostRecent);
  std::vector<int64_t> out, gone;
  for (int64_t step : candidates) {
    struct stat st {};
    (::stat(ShardPath(step).c_str(), &st) == 0 ? out : gone).push_back(step);
  }
  if (!gone.empty()) steps_.Forget(gone);
  std::reverse(out.begin(), out.end());
  return out;
}


Status CheckpointerImpl::Commit(int64_t step, int world_size) {
  if (CommitsLocally()) return Status::Ok();  // the writer commits its own saves
  if (in_memory()) return Status::Ok();       // nothing is ever written
  if (step < 0 || step > kMaxStep)
    return Status::InvalidArgument("Commit(" + std::to_string(step) + "): a step is in [0, " +
                                   std::to_string(kMaxStep) + "]");
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

}  // namespace oomguard::ckpt_internal
