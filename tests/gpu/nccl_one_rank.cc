// The NCCL coordinator with one rank, on a real GPU: every collective returns
// the rank's own input (sums scaled), a guarded step runs its protocol through
// NCCL and recovers an injected OOM, an aborted coordinator refuses further
// calls, and joining a two-rank communicator alone ends at its deadline. Without a
// visible GPU it exits with kSkip (ctest SKIP_RETURN_CODE), so the test is
// reported as skipped rather than passed.
//
// Plain main rather than gtest: the skip must be the process's exit code.
#include <cuda_runtime_api.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/nccl_coordinator.h"

namespace {

constexpr int kSkip = 77;
constexpr auto kDeadline = std::chrono::milliseconds(30000);

int failures = 0;

void Check(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

}  // namespace

int main() {
  using namespace oomguard;
  auto id = NewNcclId();
  if (!id.ok()) {
    if (id.status().code() == StatusCode::kUnavailable) {
      std::printf("SKIP: %s\n", id.status().ToString().c_str());
      return kSkip;
    }
    std::printf("FAIL  NewNcclId: %s\n", id.status().ToString().c_str());
    return 1;
  }
  auto made = MakeNcclCoordinator(/*rank=*/0, /*size=*/1, *id, /*cuda_device=*/0);
  if (!made.ok()) {
    std::printf("FAIL  MakeNcclCoordinator: %s\n", made.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<Coordinator> nccl = std::move(made).value();
  Check(nccl->rank() == 0 && nccl->size() == 1, "rank 0 of 1");
  Check(nccl->engine() == "nccl", "engine is nccl (got " + nccl->engine() + ")");

  // Allgather over one rank is the identity.
  std::vector<int64_t> mine = {41, -42, INT64_MIN, 96};
  std::vector<int64_t> all(4);
  Status g = nccl->Allgather(mine, all, kDeadline);
  Check(g.ok() && all == mine, "Allgather over one rank returns the rank's record: " + g.ToString());

  // Sums: a host buffer (staged through the coordinator's scratch), scaled.
  std::vector<double> values = {1.5, -2.25, 1e300, 0.0};
  SumBuffer host = SumBuffer::Host(values.data(), 4);
  host.scale = 0.5;
  Status sum = nccl->AllreduceSum(std::vector<SumBuffer>{host}, kDeadline);
  Check(sum.ok() && values == std::vector<double>({0.75, -1.125, 5e299, 0.0}),
        "AllreduceSum over one rank applies the scale: " + sum.ToString());
  // A device buffer, summed in place with a pre-multiplied sum.
  float* dev = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&dev), 3 * sizeof(float)) == cudaSuccess, "cudaMalloc");
  const float f[3] = {2.0f, 4.0f, -8.0f};
  cudaMemcpy(dev, f, sizeof(f), cudaMemcpyHostToDevice);
  SumBuffer db;
  db.data = dev;
  db.count = 3;
  db.dtype = DType::kFloat32;
  db.device = 0;
  db.scale = 0.25;
  Status dsum = nccl->AllreduceSum(std::vector<SumBuffer>{db}, kDeadline);
  float back[3] = {0, 0, 0};
  cudaMemcpy(back, dev, sizeof(back), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  Check(dsum.ok() && back[0] == 0.5f && back[1] == 1.0f && back[2] == -2.0f,
        "AllreduceSum of a device buffer applies the scale inside the reduction: " + dsum.ToString());

  // A guarded step whose vote travels through NCCL, with an injected OOM.
  Status rules = SetFaultRules("oom@step=1,site=micro_batch");
  Check(rules.ok(), "fault rules: " + rules.ToString());
  GuardOptions opts;
  opts.coordinator = nccl.get();
  opts.initial_micro_batch = 8;
  auto guard_or = Guard::Create(opts);
  Check(guard_or.ok(), "Guard::Create: " + guard_or.status().ToString());
  if (guard_or.ok()) {
    std::unique_ptr<Guard> guard = std::move(guard_or).value();
    int64_t ooms = 0, commits = 0;
    for (int s = 0; s < 3; ++s) {
      int64_t seen = 0;
      StepRequest req;
      req.samples = 8;
      req.micro = [&](const MicroBatch& mb) { seen += mb.size; };
      req.reset = [&] { seen = 0; };
      req.apply = [&] { ++commits; };
      StepReport report;
      Status st = guard->Step(req, &report);
      Check(st.ok(), "guarded step " + std::to_string(s) + ": " + st.ToString());
      Check(seen == 8, "step " + std::to_string(s) + " covers all 8 samples once");
      ooms += report.ooms;
    }
    Check(ooms == 1 && commits == 3, "the injected OOM is recovered (ooms " + std::to_string(ooms) + ", commits " +
                                         std::to_string(commits) + ")");
  }
  ClearFaultRules();

  nccl->Abort();
  Status after = nccl->Allgather(mine, all, kDeadline);
  Check(!after.ok(), "an aborted coordinator refuses the next collective: " + after.ToString());

  // A deadline that fires: a communicator of two ranks that only this rank
  // joins. Joining is non-blocking, so the wait ends at the deadline with
  // kUnavailable instead of hanging in ncclCommInitRank.
  auto lonely_id = NewNcclId();
  if (lonely_id.ok()) {
    const auto t0 = std::chrono::steady_clock::now();
    auto lonely = MakeNcclCoordinator(/*rank=*/0, /*size=*/2, *lonely_id, /*cuda_device=*/0,
                                      std::chrono::milliseconds(2000));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    Check(!lonely.ok() && lonely.status().code() == StatusCode::kUnavailable && s < 10.0,
          "joining a communicator whose peer never comes ends at the deadline (" + std::to_string(s) +
              " s): " + lonely.status().ToString());
  }

  std::printf("nccl_one_rank: %s\n", failures == 0 ? "all checks passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
