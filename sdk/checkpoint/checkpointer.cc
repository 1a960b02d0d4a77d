// The Checkpointer's creation: options validated, the directory made, the
// committed checkpoints found. The rest of its jobs live beside this file
// (checkpointer_impl.h lists them).
#include <system_error>

#include "sdk/checkpoint/checkpointer_impl.h"

namespace oomguard {

StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(const CheckpointOptions& o) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("CheckpointOptions." + m); };
  // Without a directory the checkpointer keeps its saves in host memory
  // only: the snapshot is then all it has, so it must be kept.
  if (o.dir.empty() && !o.keep_snapshot)
    return bad("keep_snapshot must be on when dir is empty (in memory only, the snapshot is all a save keeps)");
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
  if (o.compression != CheckpointCompression::kAuto && o.compression != CheckpointCompression::kNone &&
      o.compression != CheckpointCompression::kZstd)
    return bad("compression must be kAuto, kNone or kZstd");
  if (o.chunk_bytes < 4096 || o.chunk_bytes > (int64_t{1} << 30))
    return bad("chunk_bytes must be in [4 KiB, 1 GiB] (got " + std::to_string(o.chunk_bytes) + ")");
  if (o.staging_budget_bytes < 0) return bad("staging_budget_bytes must be >= 0");
  if (o.threads < 0 || o.threads > kMaxCheckpointThreads)
    return bad("threads must be in [0, " + std::to_string(kMaxCheckpointThreads) + "] (got " +
               std::to_string(o.threads) + ")");
  if (o.stage_threads < 0 || o.stage_threads > kMaxCheckpointThreads)
    return bad("stage_threads must be in [0, " + std::to_string(kMaxCheckpointThreads) + "] (got " +
               std::to_string(o.stage_threads) + ")");
  OOMGUARD_RETURN_IF_ERROR(ckpt::CheckReadsSetting());
  if (o.dir.empty()) {
    try {
      return std::unique_ptr<Checkpointer>(std::make_unique<ckpt_internal::CheckpointerImpl>(o));
    } catch (const std::system_error& e) {
      return Status::ResourceExhausted(std::string("cannot start the checkpointer's threads: ") + e.what());
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(o.dir, ec);
  if (ec)
    return Status::InvalidArgument("CheckpointOptions.dir: cannot create " + o.dir + ": " + ec.message());
  auto lock = ckpt::DirLock::Acquire(o.dir, o.rank);
  if (!lock.ok()) return lock.status();
  std::unique_ptr<ckpt_internal::CheckpointerImpl> impl;
  try {
    impl = std::make_unique<ckpt_internal::CheckpointerImpl>(o);
  } catch (const std::system_error& e) {  // a thread could not be started
    return Status::ResourceExhausted(std::string("cannot start the checkpointer's threads: ") + e.what());
  }
  impl->HoldLock(std::move(lock).value());
  return std::unique_ptr<Checkpointer>(std::move(impl));
}

Checkpointer::~Checkpointer() = default;


}  // namespace oomguard
