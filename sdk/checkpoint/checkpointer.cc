// The Checkpointer's creation (options validated, the directory made, the
// committed checkpoints found) and the registration of the state (paths
// checked, CUDA tensors' device found). The rest of its jobs live beside
// this file (checkpointer_impl.h lists them).
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

namespace ckpt_internal {

CheckpointerImpl::CheckpointerImpl(const CheckpointOptions& o) : o_(o) {
  int threads =
      o.threads > 0 ? o.threads : std::min(8, static_cast<int>(std::thread::hardware_concurrency()));
  pool_ = std::make_unique<ckpt::ThreadPool>(std::max(1, threads));
  const int stagers = o.stage_threads > 0
                          ? o.stage_threads
                          : std::min(4, std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  if (stagers > 1) stage_pool_ = std::make_unique<ckpt::ThreadPool>(stagers - 1);
  if (in_memory()) return;  // nothing on disk to find, nothing to write
  for (int64_t step : CommittedSteps(o_.dir)) steps_.Committed(step, fs::exists(ShardPath(step)));
  RemoveLeftovers();
  writer_ = std::thread([this] { WriterLoop(); });
}

CheckpointerImpl::~CheckpointerImpl() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    saves_.Stop();
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

Status CheckpointerImpl::AddTensor(std::string path, DType dtype, std::vector<int64_t> shape, void* data,
                                   MemoryLocation location) {
  OOMGUARD_RETURN_IF_ERROR(CheckNewPath(path));
  OOMGUARD_RETURN_IF_ERROR(CheckRegistrationOpen("AddTensor", path));
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

Status CheckpointerImpl::AddObject(std::string path, std::function<std::vector<uint8_t>()> save,
                                   std::function<Status(std::span<const uint8_t>)> load) {
  OOMGUARD_RETURN_IF_ERROR(CheckNewPath(path));
  OOMGUARD_RETURN_IF_ERROR(CheckRegistrationOpen("AddObject", path));
  if (!save || !load) return Status::InvalidArgument("AddObject(" + path + "): save and load must be set");
  Entry e;
  e.path = std::move(path);
  e.is_object = true;
  e.save = std::move(save);
  e.load = std::move(load);
  entries_.push_back(std::move(e));
  return Status::Ok();
}

Status CheckpointerImpl::CopyOut(const Entry& e, int64_t begin, int64_t len, std::vector<uint8_t>* out) {
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

Status CheckpointerImpl::UseDeviceOf(const std::string& path, const void* data) {
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

Status CheckpointerImpl::BeginDeviceCopies() {
  std::vector<void*> streams;
  if (o_.cuda_streams) streams = o_.cuda_streams();
  return copier_->Begin(streams);
}

Status CheckpointerImpl::CheckRegistrationOpen(std::string_view call, const std::string& path) const {
  if (!state_used_) return Status::Ok();
  return Status::FailedPrecondition(
      std::string(call) + ": /" + ckpt::PrintableName(path) +
      " registered after the checkpointer was first used (a save, snapshot, load "
      "or restore): register all state before, or checkpoints would not hold it");
}

Status CheckpointerImpl::CheckNewPath(const std::string& path) const {
  const std::string shown = ckpt::PrintableName(path);
  if (path.empty() || path.front() == '/' || path.back() == '/' || path.find("//") != std::string::npos ||
      path.find('.') == 0)
    return Status::InvalidArgument("state path '" + shown + "' must look like 'model/fc1.weight'");
  if (path.find('\0') != std::string::npos)
    return Status::InvalidArgument("state path '" + shown + "' contains a NUL byte");
  if (("/" + path + "/").find("/./") != std::string::npos ||
      ("/" + path + "/").find("/../") != std::string::npos)
    return Status::InvalidArgument("state path '" + shown + "' has a '.' or '..' component");
  if (std::count(path.begin(), path.end(), '/') > ckpt::kMaxGroupDepth)
    return Status::InvalidArgument("state path '" + shown + "' nests deeper than " +
                                   std::to_string(ckpt::kMaxGroupDepth) + " groups");
  for (const auto& e : entries_)
    if (e.path == path) return Status::InvalidArgument("state path '" + path + "' is registered twice");
  return Status::Ok();
}

std::vector<int64_t> CheckpointerImpl::StagingLayout() const {
  std::vector<int64_t> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.push_back(e.is_object ? -1 : e.bytes);
  return out;
}

std::vector<ShardTensor> CheckpointerImpl::Layout(
    const std::vector<std::vector<uint8_t>>* object_bytes) const {
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

}  // namespace ckpt_internal
}  // namespace oomguard
