// The NCCL coordinator with one rank, on a real GPU: every collective returns
// the rank's own input, a guarded step votes through NCCL and recovers an
// injected OOM, and an aborted coordinator refuses further calls. Without a
// visible GPU it exits with kSkip (ctest SKIP_RETURN_CODE), so the test is
// reported as skipped rather than passed.
//
// Plain main rather than gtest: the skip must be the process's exit code.
#include <chrono>
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

  VoteInput in;
  in.status = VoteStatus::kRollback;
  in.durable_step = 41;
  in.snapshot_step = 42;
  in.micro_limit = 96;
  in.had_oom = true;
  auto vote = nccl->Vote(in, kDeadline);
  Check(vote.ok(), "Vote: " + vote.status().ToString());
  if (vote.ok()) {
    Check(vote->status == VoteStatus::kRollback && vote->min_durable_step == 41 && vote->min_snapshot_step == 42 &&
              vote->min_micro_limit == 96 && vote->any_oom,
          "a one-rank vote returns the rank's own input");
  }

  std::vector<double> values = {1.5, -2.25, 1e300, 0.0};
  const std::vector<double> expected = values;
  Status sum = nccl->AllreduceSum(values, kDeadline);
  Check(sum.ok() && values == expected, "AllreduceSum over one rank is the identity: " + sum.ToString());

  std::vector<uint8_t> bytes = {1, 2, 3, 250};
  Status bc = nccl->Broadcast(&bytes, 0, kDeadline);
  Check(bc.ok() && bytes == std::vector<uint8_t>({1, 2, 3, 250}), "Broadcast from rank 0: " + bc.ToString());
  Check(nccl->Broadcast(&bytes, 1, kDeadline).code() == StatusCode::kInvalidArgument,
        "Broadcast from a rank outside the group is kInvalidArgument");

  RankMemory mine;
  mine.allocated = 123456789;
  mine.reserved = 223456789;
  mine.peak_allocated = 323456789;
  auto rows = nccl->GatherMemory(mine, kDeadline);
  Check(rows.ok() && rows->size() == 1 && (*rows)[0].allocated == mine.allocated &&
            (*rows)[0].reserved == mine.reserved && (*rows)[0].peak_allocated == mine.peak_allocated,
        "GatherMemory returns this rank's figures");
  Check(nccl->Barrier(kDeadline).ok(), "Barrier");

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
      req.commit = [&] { ++commits; };
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
  auto after = nccl->Vote(in, kDeadline);
  Check(!after.ok(), "an aborted coordinator refuses the next vote: " + after.status().ToString());

  std::printf("nccl_one_rank: %s\n", failures == 0 ? "all checks passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
