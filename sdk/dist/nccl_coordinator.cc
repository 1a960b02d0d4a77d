#include "oomguard/nccl_coordinator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <thread>

namespace oomguard {
namespace {

Status CudaStatus(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice)
    return Status::Unavailable(std::string(what) + ": no GPU is visible (" + cudaGetErrorString(e) + ")");
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

Status NcclStatus(const char* what, ncclResult_t r) {
  if (r == ncclSuccess) return Status::Ok();
  return Status::Unavailable(std::string(what) + ": " + ncclGetErrorString(r));
}

class NcclCoordinator final : public Coordinator {
 public:
  NcclCoordinator(ncclComm_t comm, cudaStream_t stream, int rank, int size, int device)
      : comm_(comm), stream_(stream), rank_(rank), size_(size), device_(device) {}

  ~NcclCoordinator() override {
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (!broken_) ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string engine() const override { return "nccl"; }

  StatusOr<VoteResult> Vote(const VoteInput& in, std::chrono::milliseconds deadline) override {
    int64_t w[kVoteWords];
    PackVote(in, w);
    Status s = Reduce("vote", w, kVoteWords, ncclInt64, ncclMax, deadline);
    if (!s.ok()) return s;
    return UnpackVote(w);
  }

  StatusOr<std::vector<RankMemory>> GatherMemory(const RankMemory& mine, std::chrono::milliseconds deadline) override {
    // An allgather written as a sum of one-hot rows keeps to one primitive.
    std::vector<int64_t> rows(static_cast<size_t>(4 * size_), 0);
    rows[4 * rank_] = rank_;
    rows[4 * rank_ + 1] = mine.allocated;
    rows[4 * rank_ + 2] = mine.reserved;
    rows[4 * rank_ + 3] = mine.peak_allocated;
    Status s = Reduce("gather memory", rows.data(), rows.size(), ncclInt64, ncclSum, deadline);
    if (!s.ok()) return s;
    std::vector<RankMemory> out(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r)
      out[r] = RankMemory{static_cast<int>(rows[4 * r]), rows[4 * r + 1], rows[4 * r + 2], rows[4 * r + 3]};
    return out;
  }

  Status Barrier(std::chrono::milliseconds deadline) override {
    int64_t one = 1;
    return Reduce("barrier", &one, 1, ncclInt64, ncclSum, deadline);
  }

  Status Broadcast(std::vector<uint8_t>* data, int root, std::chrono::milliseconds deadline) override {
    if (root < 0 || root >= size_) return Status::InvalidArgument("Broadcast: root outside the group");
    int64_t n = rank_ == root ? static_cast<int64_t>(data->size()) : 0;
    Status s = Reduce("broadcast", &n, 1, ncclInt64, ncclSum, deadline);  // only root contributes
    if (!s.ok()) return s;
    data->resize(static_cast<size_t>(n));
    if (n == 0) return Status::Ok();
    if (rank_ != root) std::memset(data->data(), 0, data->size());
    return Reduce("broadcast", data->data(), data->size(), ncclUint8, ncclMax, deadline);
  }

  Status AllreduceSum(std::span<double> data, std::chrono::milliseconds deadline) override {
    return Reduce("allreduce", data.data(), data.size(), ncclFloat64, ncclSum, deadline);
  }

  void Abort() override {
    if (!broken_) {
      broken_ = true;
      ncclCommAbort(comm_);
    }
  }

 private:
  // Host buffer -> device scratch -> ncclAllReduce -> host, then polls the
  // stream until done or the deadline.
  Status Reduce(const char* what, void* host, size_t count, ncclDataType_t type, ncclRedOp_t op,
                std::chrono::milliseconds deadline) {
    if (broken_) return Status::Unavailable(std::string(what) + ": coordinator is broken by an earlier timeout");
    size_t elem = type == ncclInt64 || type == ncclFloat64 ? 8 : 1;
    size_t bytes = count * elem;
    OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(device_)));
    if (bytes > scratch_bytes_) {
      if (scratch_ != nullptr) cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaMalloc", cudaMalloc(&scratch_, bytes)));
      scratch_bytes_ = bytes;
    }
    OOMGUARD_RETURN_IF_ERROR(
        CudaStatus("cudaMemcpyAsync", cudaMemcpyAsync(scratch_, host, bytes, cudaMemcpyHostToDevice, stream_)));
    OOMGUARD_RETURN_IF_ERROR(NcclStatus(what, ncclAllReduce(scratch_, scratch_, count, type, op, comm_, stream_)));
    OOMGUARD_RETURN_IF_ERROR(
        CudaStatus("cudaMemcpyAsync", cudaMemcpyAsync(host, scratch_, bytes, cudaMemcpyDeviceToHost, stream_)));
    const auto until = std::chrono::steady_clock::now() + deadline;
    for (;;) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady) return CudaStatus(what, q);
      if (std::chrono::steady_clock::now() >= until) {
        Abort();
        return Status::Unavailable(std::string(what) + ": peers did not answer within " +
                                   std::to_string(deadline.count()) + " ms; NCCL communicator aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_, size_, device_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  bool broken_ = false;
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

StatusOr<std::unique_ptr<Coordinator>> MakeNcclCoordinator(int rank, int size, const NcclId& id, int cuda_device) {
  if (size < 1 || rank < 0 || rank >= size)
    return Status::InvalidArgument("MakeNcclCoordinator: rank " + std::to_string(rank) + " of " + std::to_string(size));
  int n = 0;
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaGetDeviceCount", cudaGetDeviceCount(&n)));
  if (cuda_device < 0 || cuda_device >= n)
    return Status::InvalidArgument("MakeNcclCoordinator: CUDA device " + std::to_string(cuda_device) + " of " +
                                   std::to_string(n));
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaSetDevice", cudaSetDevice(cuda_device)));
  cudaStream_t stream;
  OOMGUARD_RETURN_IF_ERROR(CudaStatus("cudaStreamCreate", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), id.size());
  ncclComm_t comm;
  Status s = NcclStatus("ncclCommInitRank", ncclCommInitRank(&comm, size, uid, rank));
  if (!s.ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  return std::unique_ptr<Coordinator>(new NcclCoordinator(comm, stream, rank, size, cuda_device));
}

}  // namespace oomguard
