#include <atomic>

#include "oomguard/coordinator.h"

namespace oomguard {

Coordinator::~Coordinator() = default;

void PackVote(const VoteInput& in, int64_t out[kVoteWords]) {
  // One MAX-allreduce carries every field: minima travel negated.
  out[0] = static_cast<int64_t>(in.status);
  out[1] = -in.durable_step;
  out[2] = -in.snapshot_step;
  out[3] = in.snapshot_step;
  out[4] = -in.micro_limit;
  out[5] = in.had_oom ? 1 : 0;
}

VoteResult UnpackVote(const int64_t m[kVoteWords]) {
  VoteResult r;
  r.status = static_cast<VoteStatus>(m[0]);
  r.min_durable_step = -m[1];
  r.min_snapshot_step = -m[2];
  r.max_snapshot_step = m[3];
  r.min_micro_limit = -m[4];
  r.any_oom = m[5] != 0;
  return r;
}

namespace {

// One rank: every collective is the identity, and nothing can time out.
class LocalCoordinator final : public Coordinator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string engine() const override { return "local"; }
  StatusOr<VoteResult> Vote(const VoteInput& in, std::chrono::milliseconds) override {
    if (aborted_) return Status::Aborted("coordinator aborted");
    int64_t w[kVoteWords];
    PackVote(in, w);
    return UnpackVote(w);
  }
  StatusOr<std::vector<RankMemory>> GatherMemory(const RankMemory& mine, std::chrono::milliseconds) override {
    if (aborted_) return Status::Aborted("coordinator aborted");
    return std::vector<RankMemory>{mine};
  }
  Status Barrier(std::chrono::milliseconds) override {
    return aborted_ ? Status::Aborted("coordinator aborted") : Status::Ok();
  }
  Status Broadcast(std::vector<uint8_t>*, int root, std::chrono::milliseconds) override {
    if (root != 0) return Status::InvalidArgument("Broadcast: root " + std::to_string(root) + " outside [0, 1)");
    return aborted_ ? Status::Aborted("coordinator aborted") : Status::Ok();
  }
  Status AllreduceSum(std::span<double>, std::chrono::milliseconds) override {
    return aborted_ ? Status::Aborted("coordinator aborted") : Status::Ok();
  }
  void Abort() override { aborted_ = true; }

 private:
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Coordinator> MakeLocalCoordinator() { return std::make_unique<LocalCoordinator>(); }

}  // namespace oomguard
