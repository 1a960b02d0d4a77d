// The single-process coordinator: rank 0 of 1. Every collective is the
// identity (AllreduceSum applies the scale), and nothing can time out.
#include <algorithm>
#include <atomic>

#include "oomguard/coordinator.h"
#include "sdk/dist/host_buffers.h"

namespace oomguard {

Coordinator::~Coordinator() = default;

namespace {

class LocalCoordinator final : public Coordinator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string engine() const override { return "local"; }

  Status Allgather(std::span<const int64_t> mine, std::span<int64_t> all, std::chrono::milliseconds) override {
    if (all.size() != mine.size())
      return Status::InvalidArgument("Allgather: `all` holds " + std::to_string(all.size()) + " words, expected " +
                                     std::to_string(mine.size()));
    if (aborted_) return Status::Aborted("coordinator aborted");
    std::copy(mine.begin(), mine.end(), all.begin());
    return Status::Ok();
  }

  // The sum over one rank is the buffer itself: only a scale other than 1
  // needs arithmetic, which this engine does on host memory.
  Status AllreduceSum(std::span<const SumBuffer> buffers, std::chrono::milliseconds) override {
    for (const SumBuffer& b : buffers)
      if (b.scale != 1.0) OOMGUARD_RETURN_IF_ERROR(dist::CheckHostBuffers({&b, 1}, "local"));
    if (aborted_) return Status::Aborted("coordinator aborted");
    for (const SumBuffer& b : buffers) dist::ScaleInPlace(b);
    return Status::Ok();
  }

  void Abort() override { aborted_ = true; }

 private:
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Coordinator> MakeLocalCoordinator() { return std::make_unique<LocalCoordinator>(); }

}  // namespace oomguard
