// The NCCL engine.
//
// Deadlines that really fire: the communicator is created non-blocking
// (ncclConfig_t::blocking = 0), so neither joining nor enqueueing a collective
// can block on a peer that never comes; every wait polls — the communicator's
// asynchronous error (ncclCommGetAsyncError) while NCCL is still setting an
// operation up, then a CUDA event recorded after the collective and its copy
// back into pinned host memory — until done or the deadline, and a timeout
// aborts the communicator (ncclCommAbort) so that nothing stays inside it.
//
// No allocation inside a collective: the device scratch for records and for
// host buffers, the pinned host staging and NCCL's own buffers (a warm-up
// all-reduce) are all allocated when the coordinator is created, not in the
// vote that follows an out-of-memory error. A communicator error is a
// coordination failure (kUnavailable), never an OOM the guard would try to
// recover from: the communicator is unusable afterwards.
#include "oomguard/nccl_coordinator.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>

namespace oomguard {
namespace {

using Clock = std::chrono::steady_clock;

// Words of scratch per rank for Allgather records, and host-buffer bytes the
// sum can stage without allocating (the guard's sync status words).
constexpr size_t kRecordWordsPerRank = 64;
constexpr size_t kHostStageBytes = 64 << 10;

Status CudaStatus(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();  // not left behind as the thread's last error
  if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice)
    return Status::Unavailable(std::string(what) + ": no GPU is visible (" + cudaGetErrorString(e) + ")");
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

Status NcclStatus(const char* what, ncclResult_t r) {
  if (r == ncclSuccess || r == ncclInProgress) return Status::Ok();
  return Status::Unavailable(std::string(what) + ": " + ncclGetErrorString(r));
}

std::optional<ncclDataType_t> NcclType(DType t) {
  switch (t) {
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kInt64: return ncclInt64;
    default: return std::nullopt;
  }
}

// Polls the communicator until the operation NCCL is setting up is enqueued
// (non-blocking mode) or fails. False on timeout.
bool WaitEnqueued(ncclComm_t comm, Clock::time_point until, ncclResult_t* result) {
  for (;;) {
    ncclResult_t r = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm, &r);
    if (q != ncclSuccess) {
      *result = q;
      return true;
    }
    if (r != ncclInProgress) {
      *result = r;
      return true;
    }
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

class NcclCoordinator final : public Coordinator {
 public:
  NcclCoordinator(ncclComm_t comm, cudaStream_t stream, cudaEvent_t done, int rank, int size, int device)
      : comm_(comm), stream_(stream), done_(done), rank_(rank), size_(size), device_(device) {}

  ~NcclCoordinator() override {
    cudaSetDevice(device_);
    if (!broken_) ncclCommDestroy(comm_);
    if (records_ != nullptr) cudaFree(records_);
    if (stage_ != nullptr) cudaFree(stage_);
    if (host_ != nullptr) cudaFreeHost(host_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
    (void)cudaGetLastError();
  }

  // Allocates everything a collective needs and runs one all-reduce, so that
  // NCCL's own buffers exist before the first vote.
  Status Prepare(std::chrono::milliseconds deadline) {
    const size_t record_bytes = kRecordWordsPerRank * sizeof(int64_t) * static_cast<size_t>(size_);
    OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaMalloc (records)", cudaMalloc(&records_, record_bytes)));
    OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaMalloc (staging)", cudaMalloc(&stage_, kHostStageBytes)));
    host_bytes_ = std::max(record_bytes, kHostStageBytes);
    OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaMallocHost", cudaMallocHost(&host_, host_bytes_)));
    int64_t one = 1;
    SumBuffer warm;
    warm.data = &one;
    warm.count = 1;
    warm.dtype = DType::kInt64;
    return AllreduceSum({&warm, 1}, deadline);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string engine() const override { return "nccl"; }
  std::string job_id() const override { return job_id_; }
  void set_job_id(std::string id) { job_id_ = std::move(id); }

  Status Allgather(std::span<const int64_t> mine, std::span<int64_t> all,
                   std::chrono::milliseconds deadline) override {
    const size_t n = mine.size();
    if (all.size() != n * static_cast<size_t>(size_))
      return Status::InvalidArgument("Allgather: `all` holds " + std::to_string(all.size()) + " words, expected " +
                                     std::to_string(n * static_cast<size_t>(size_)));
    if (n > kRecordWordsPerRank)
      return Status::InvalidArgument("nccl Allgather: records of more than " + std::to_string(kRecordWordsPerRank) +
                                     " words");
    if (broken_) return Broken("allgather");
    const auto until = Clock::now() + deadline;
    OOMGUARD_RETURN_IF_ERROR(Cuda("cudaSetDevice", cudaSetDevice(device_)));
    const size_t bytes = n * sizeof(int64_t);
    int64_t* host = static_cast<int64_t*>(host_);
    std::memcpy(host, mine.data(), bytes);
    int64_t* mine_dev = static_cast<int64_t*>(records_) + static_cast<size_t>(rank_) * n;
    OOMGUARD_RETURN_IF_ERROR(Cuda("cudaMemcpyAsync", cudaMemcpyAsync(mine_dev, host, bytes, cudaMemcpyHostToDevice, stream_)));
    OOMGUARD_RETURN_IF_ERROR(Enqueue("allgather", until, [&] {
      return ncclAllGather(mine_dev, records_, n, ncclInt64, comm_, stream_);
    }));
    OOMGUARD_RETURN_IF_ERROR(Cuda("cudaMemcpyAsync", cudaMemcpyAsync(host, records_, bytes * static_cast<size_t>(size_),
                                                                   cudaMemcpyDeviceToHost, stream_)));
    OOMGUARD_RETURN_IF_ERROR(Finish("allgather", until, deadline));
    std::memcpy(all.data(), host, bytes * static_cast<size_t>(size_));
    return Status::Ok();
  }

  Status AllreduceSum(std::span<const SumBuffer> buffers, std::chrono::milliseconds deadline) override {
    size_t host_bytes = 0;
    for (size_t i = 0; i < buffers.size(); ++i) {
      const SumBuffer& b = buffers[i];
      auto bad = [&](const std::string& why) {
        return Status::InvalidArgument("nccl AllreduceSum: buffer " + std::to_string(i) + " " + why);
      };
      if (!NcclType(b.dtype)) return bad("is " + std::string(DTypeName(b.dtype)) + ", which NCCL cannot sum");
      if (b.count < 0 || (b.count > 0 && b.data == nullptr)) return bad("has no data");
      if (b.dtype == DType::kInt64 && b.scale != 1.0) return bad("is int64 with a scale other than 1");
      if (b.device >= 0 && b.device != device_)
        return bad("is on CUDA device " + std::to_string(b.device) + ", the coordinator on " + std::to_string(device_));
      if (b.device < 0) host_bytes += static_cast<size_t>(b.count) * DTypeSize(b.dtype);
    }
    if (host_bytes > kHostStageBytes)
      return Status::InvalidArgument("nccl AllreduceSum: " + std::to_string(host_bytes) +
                                     " bytes of host buffers; this engine stages at most " +
                                     std::to_string(kHostStageBytes) + " (keep large buffers on the device)");
    if (broken_) return Broken("allreduce");
    const auto until = Clock::now() + deadline;
    OOMGUARD_RETURN_IF_ERROR(Cuda("cudaSetDevice", cudaSetDevice(device_)));
    // Host buffers travel through the pinned staging area and the device scratch.
    uint8_t* host = static_cast<uint8_t*>(host_);
    uint8_t* stage = static_cast<uint8_t*>(stage_);
    size_t at = 0;
    for (const SumBuffer& b : buffers) {
      if (b.device >= 0) continue;
      const size_t n = static_cast<size_t>(b.count) * DTypeSize(b.dtype);
      std::memcpy(host + at, b.data, n);
      at += n;
    }
    if (at > 0)
      OOMGUARD_RETURN_IF_ERROR(Cuda("cudaMemcpyAsync", cudaMemcpyAsync(stage, host, at, cudaMemcpyHostToDevice, stream_)));
    // One reduction op per buffer: each rank's contribution multiplied by its
    // own scale inside the reduction (created before the group: they are
    // local objects, not collectives).
    std::vector<ncclRedOp_t> ops(buffers.size(), ncclSum);
    std::vector<ncclRedOp_t> created;
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (buffers[i].scale == 1.0) continue;
      ScalarBytes sc = Scalar(buffers[i].dtype, buffers[i].scale);
      ncclResult_t r =
          ncclRedOpCreatePreMulSum(&ops[i], sc.bytes, *NcclType(buffers[i].dtype), ncclScalarHostImmediate, comm_);
      if (r != ncclSuccess) {
        for (ncclRedOp_t op : created) ncclRedOpDestroy(op, comm_);
        Abort();
        return NcclStatus("ncclRedOpCreatePreMulSum", r);
      }
      created.push_back(ops[i]);
    }
    Status enq = Enqueue("allreduce", until, [&]() -> ncclResult_t {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      size_t off = 0;
      for (size_t i = 0; i < buffers.size(); ++i) {
        const SumBuffer& b = buffers[i];
        void* dev = b.data;
        if (b.device < 0) {
          dev = stage + off;
          off += static_cast<size_t>(b.count) * DTypeSize(b.dtype);
        }
        r = ncclAllReduce(dev, dev, static_cast<size_t>(b.count), *NcclType(b.dtype), ops[i], comm_, stream_);
        if (r != ncclSuccess && r != ncclInProgress) break;
      }
      ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess && r != ncclInProgress ? r : end;
    });
    if (enq.ok() && at > 0)
      enq = Cuda("cudaMemcpyAsync", cudaMemcpyAsync(host, stage, at, cudaMemcpyDeviceToHost, stream_));
    if (enq.ok()) enq = Finish("allreduce", until, deadline);
    if (!broken_)
      for (ncclRedOp_t op : created) ncclRedOpDestroy(op, comm_);
    if (!enq.ok()) return enq;
    at = 0;
    for (const SumBuffer& b : buffers) {
      if (b.device >= 0) continue;
      const size_t n = static_cast<size_t>(b.count) * DTypeSize(b.dtype);
      std::memcpy(b.data, host + at, n);
      at += n;
    }
    return Status::Ok();
  }

  void Abort() override {
    bool expected = false;
    if (broken_.compare_exchange_strong(expected, true)) ncclCommAbort(comm_);
  }

 private:
  struct ScalarBytes {
    alignas(8) unsigned char bytes[8];
  };
  static ScalarBytes Scalar(DType t, double v) {
    ScalarBytes s{};
    switch (t) {
      case DType::kFloat64: std::memcpy(s.bytes, &v, sizeof(v)); break;
      case DType::kFloat32: {
        float f = static_cast<float>(v);
        std::memcpy(s.bytes, &f, sizeof(f));
        break;
      }
      case DType::kFloat16: {
        __half h = __float2half(static_cast<float>(v));
        std::memcpy(s.bytes, &h, sizeof(h));
        break;
      }
      case DType::kBFloat16: {
        __nv_bfloat16 h = __float2bfloat16(static_cast<float>(v));
        std::memcpy(s.bytes, &h, sizeof(h));
        break;
      }
      default: break;
    }
    return s;
  }

  Status Broken(const char* what) const {
    return Status::Unavailable(std::string(what) + ": NCCL coordinator is broken by an earlier error or timeout");
  }

  // A CUDA error in a collective leaves the job's ranks out of step: the
  // coordinator is broken from then on.
  Status Cuda(const char* what, cudaError_t e) {
    Status s = CudaStatus(what, e);
    if (!s.ok()) Abort();
    return s;
  }

  // Runs the NCCL calls in `enqueue` and waits (bounded) until the
  // communicator has them queued on the stream.
  template <typename F>
  Status Enqueue(const char* what, Clock::time_point until, F&& enqueue) {
    ncclResult_t r = enqueue();
    if (r == ncclInProgress && !WaitEnqueued(comm_, until, &r)) return Timeout(what, "setting the collective up");
    if (r != ncclSuccess) {
      Abort();
      return NcclStatus(what, r);
    }
    return Status::Ok();
  }

  // Records the event after the queued work and polls it, and the
  // communicator's asynchronous error, until done or the deadline.
  Status Finish(const char* what, Clock::time_point until, std::chrono::milliseconds deadline) {
    OOMGUARD_RETURN_IF_ERROR(Cuda("cudaEventRecord", cudaEventRecord(done_, stream_)));
    auto sleep = std::chrono::microseconds(5);
    for (;;) {
      cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady) return Cuda(what, q);
      (void)cudaGetLastError();  // cudaErrorNotReady is no error: do not leave it as the last one
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
        Abort();
        return Status::Unavailable(std::string(what) + ": NCCL communicator failed: " + ncclGetErrorString(async));
      }
      if (Clock::now() >= until) return Timeout(what, std::to_string(deadline.count()) + " ms");
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(500));
    }
  }

  Status Timeout(const char* what, const std::string& while_doing) {
    Abort();
    return Status::Unavailable(std::string(what) + ": peers did not answer (" + while_doing + ", rank " +
                               std::to_string(rank_) + " of " + std::to_string(size_) +
                               "); NCCL communicator aborted");
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaEvent_t done_;
  int rank_, size_, device_;
  std::string job_id_;
  void* records_ = nullptr;  // device: size * kRecordWordsPerRank int64
  void* stage_ = nullptr;    // device: host buffers of a sum
  void* host_ = nullptr;     // pinned host staging
  size_t host_bytes_ = 0;
  std::atomic<bool> broken_{false};
};

}  // namespace

StatusOr<NcclId> NewNcclId() {
  int n = 0;
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaGetDeviceCount", cudaGetDeviceCount(&n)));
  if (n == 0) return Status::Unavailable("no GPU is visible");
  ncclUniqueId id;
  OOMGUARD_RETURN_IF_ERROR(NcclStatus("ncclGetUniqueId", ncclGetUniqueId(&id)));
  NcclId out;
  static_assert(sizeof(id.internal) == 128);
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

StatusOr<std::unique_ptr<Coordinator>> MakeNcclCoordinator(int rank, int size, const NcclId& id, int cuda_device,
                                                           std::chrono::milliseconds deadline) {
  if (size < 1 || rank < 0 || rank >= size)
    return Status::InvalidArgument("MakeNcclCoordinator: rank " + std::to_string(rank) + " of " + std::to_string(size));
  int n = 0;
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaGetDeviceCount", cudaGetDeviceCount(&n)));
  if (cuda_device < 0 || cuda_device >= n)
    return Status::InvalidArgument("MakeNcclCoordinator: CUDA device " + std::to_string(cuda_device) + " of " +
                                   std::to_string(n));
  const auto until = Clock::now() + deadline;
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(cuda_device)));
  cudaStream_t stream;
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaStreamCreate", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  cudaEvent_t done;
  if (Status s = CudaStatus("cudaEventCreate", cudaEventCreateWithFlags(&done, cudaEventDisableTiming)); !s.ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), id.size());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // joining must not block past the deadline on a peer that never comes
  ncclComm_t comm;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, uid, rank, &config);
  if (r == ncclInProgress && !WaitEnqueued(comm, until, &r)) {
    ncclCommAbort(comm);
    cudaEventDestroy(done);
    cudaStreamDestroy(stream);
    return Status::Unavailable("ncclCommInitRank: the other ranks did not join within " +
                               std::to_string(deadline.count()) + " ms");
  }
  if (r != ncclSuccess) {
    cudaEventDestroy(done);
    cudaStreamDestroy(stream);
    return NcclStatus("ncclCommInitRank", r);
  }
  auto coord = std::make_unique<NcclCoordinator>(comm, stream, done, rank, size, cuda_device);
  // The job's id from the communicator's unique id, which every rank holds:
  // 64-bit FNV-1a, the same on every rank and different for every job.
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : id) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  coord->set_job_id(hex);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
  OOMGUARD_RETURN_IF_ERROR(coord->Prepare(std::max(left, std::chrono::milliseconds(1))));
  return std::unique_ptr<Coordinator>(std::move(coord));
}

}  // namespace oomguard
