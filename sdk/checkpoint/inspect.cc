// Offline views of a checkpoint directory: list, verify, inspect. They never
// modify files, so the CLI may run them next to a training job.
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <thread>

#include "oomguard/checkpoint.h"
#include "sdk/checkpoint/codec.h"
#include "sdk/checkpoint/manifest.h"
#include "sdk/checkpoint/shard.h"
#include "sdk/checkpoint/shard_check.h"
#include "sdk/checkpoint/thread_pool.h"

namespace oomguard {

namespace fs = std::filesystem;

StatusOr<std::vector<CheckpointInfo>> ListCheckpoints(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return Status::NotFound(dir + " is not a directory");
  std::vector<CheckpointInfo> out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    auto step = ckpt::ParseStepDirName(e.path().filename().string());
    if (!step || !e.is_directory()) continue;
    CheckpointInfo info;
    info.step = *step;
    info.dir = e.path().string();
    if (Status usable = ckpt::CheckStepDir(info.dir); !usable.ok()) {
      info.problem = usable.message();  // a link: nothing is read through it
      out.push_back(std::move(info));
      continue;
    }
    int64_t on_disk = 0;
    for (const auto& f : fs::directory_iterator(e.path(), ec)) {
      const std::string name = f.path().filename().string();
      if (name.size() > 3 && name.compare(name.size() - 3, 3, ".h5") == 0) {
        info.shards.push_back(name);
        on_disk += static_cast<int64_t>(f.file_size(ec));
      }
    }
    std::sort(info.shards.begin(), info.shards.end());
    auto m = ckpt::ReadManifest(info.dir);
    if (m.ok()) {
      info.committed = true;
      info.world_size = m->world_size;
      info.created_unix = m->created_unix;
      for (const auto& s : m->shards) info.bytes += s.bytes;
    } else {
      info.bytes = on_disk;
      if (m.status().code() != StatusCode::kNotFound) info.problem = m.status().message();
    }
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

Status VerifyCheckpoint(const std::string& dir, int64_t step, int expected_world_size,
                        const std::function<void(int64_t, int64_t)>& progress) {
  OOMGUARD_RETURN_IF_ERROR(ckpt::CheckReadsSetting());
  const std::string sdir = dir + "/" + ckpt::StepDirName(step);
  std::error_code ec;
  if (!fs::is_directory(sdir, ec)) return Status::NotFound(sdir + " does not exist");
  auto m = ckpt::ReadStepManifest(sdir, step);
  if (!m.ok()) {
    if (m.status().code() == StatusCode::kNotFound)
      return Status::DataLoss(sdir + " has no MANIFEST.json (an incomplete checkpoint)");
    return m.status();
  }
  if (expected_world_size > 0 && m->world_size != expected_world_size)
    return Status::DataLoss(sdir + "/MANIFEST.json names world size " + std::to_string(m->world_size) +
                            ", expected " + std::to_string(expected_world_size));
  int64_t total = 0, done = 0;
  for (const auto& s : m->shards) total = s.bytes > INT64_MAX - total ? INT64_MAX : total + s.bytes;
  ckpt::ThreadPool pool(std::max(1, std::min(8, static_cast<int>(std::thread::hardware_concurrency()))));
  for (const auto& s : m->shards) {
    // The loader's checker (shard_check.h), so that verify accepts exactly
    // what a load accepts. Every tensor is decoded and its xxh3 checked
    // through a few recycled chunk buffers while the whole file is hashed.
    auto shard = ckpt::CheckedShard::Open(sdir, *m, s, /*hash_file=*/true);
    if (!shard.ok()) return shard.status();
    OOMGUARD_RETURN_IF_ERROR((*shard)->Finish((*shard)->ReadEverything(&pool)));
    done = s.bytes > INT64_MAX - done ? INT64_MAX : done + s.bytes;
    if (progress) progress(done, total);
  }
  return Status::Ok();
}

StatusOr<ShardInfo> InspectShard(const std::string& file) {
  auto reader = ckpt::ShardReader::Open(file);
  if (!reader.ok()) return reader.status();
  auto& r = **reader;
  OOMGUARD_RETURN_IF_ERROR(r.CheckRootRanges());
  ShardInfo info;
  info.file = file;
  info.format = r.format();
  info.step = r.step();
  info.rank = static_cast<int>(r.rank());  // in range (CheckRootRanges)
  info.world_size = static_cast<int>(r.world_size());
  std::error_code ec;
  info.file_bytes = static_cast<int64_t>(fs::file_size(file, ec));
  auto paths = r.DatasetPaths();
  if (!paths.ok()) return paths.status();
  for (const auto& p : *paths) {
    auto t = r.Info(p);
    if (!t.ok()) return t.status();
    info.tensors.push_back(std::move(t).value());
  }
  return info;
}

}  // namespace oomguard
