#include "oomguard/coordinator.h"

namespace oomguard {

Coordinator::~Coordinator() = default;

namespace {

// One rank: every collective is the identity, and nothing can time out.
class LocalCoordinator final : public Coordinator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  StatusOr<VoteResult> Vote(const VoteInput& in, std::chrono::milliseconds) override {
    VoteResult r;
    r.status = in.status;
    r.min_durable_step = in.durable_step;
    r.min_micro_limit = in.micro_limit;
    return r;
  }
  StatusOr<std::vector<RankMemory>> GatherMemory(const RankMemory& mine, std::chrono::milliseconds) override {
    return std::vector<RankMemory>{mine};
  }
};

}  // namespace

std::unique_ptr<Coordinator> MakeLocalCoordinator() { return std::make_unique<LocalCoordinator>(); }

}  // namespace oomguard
