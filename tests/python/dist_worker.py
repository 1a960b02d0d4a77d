"""One rank of the two-process torch.distributed test (test_distributed.py).

    dist_worker.py RANK WORLD_SIZE INIT_FILE OUT_PREFIX BUDGET_MIB [silent]

With WORLD_SIZE 1 it trains on every rank's data at once: the reference run.
Rank r's samples are rows [r*B, (r+1)*B) of each step's global batch.

With "silent", rank 1 joins the group and then never steps (a hung peer)
until rank 0 has written its summary; rank 0 must then fail the vote at its
deadline, not at gloo's own timeout, and exit with code 75.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import oomguard
import oomguard.budget
import oomguard.torch as ogt

STEPS, PER_RANK, RANKS = 5, 256, 2


def main() -> int:
    rank, world, init_file, out, budget_mib = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                               float(sys.argv[5]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 1)).double()
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, RANKS * PER_RANK, 32, generator=g, dtype=torch.float64)
    ys = torch.randn(STEPS, RANKS * PER_RANK, 1, generator=g, dtype=torch.float64)
    coordinator = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        model = torch.nn.parallel.DistributedDataParallel(model)
        coordinator = ogt.TorchDistributedCoordinator()
        xs = xs[:, rank * PER_RANK:(rank + 1) * PER_RANK]
        ys = ys[:, rank * PER_RANK:(rank + 1) * PER_RANK]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if len(sys.argv) > 6 and sys.argv[6] == "silent":
        return silent(rank, model, opt, coordinator, xs, ys, out)
    guard = oomguard.Guard(coordinator=coordinator, vote_deadline_ms=30000, grow_after=0)
    train_step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard)
    if budget_mib > 0:
        oomguard.budget.install(int(budget_mib * (1 << 20)))
    any_oom_steps = 0
    while guard.next_step < STEPS:
        train_step(xs[guard.next_step], ys[guard.next_step])
        any_oom_steps += bool(train_step.last_report.incidents and train_step.last_report.incidents[0].ranks)
    if budget_mib > 0:
        oomguard.budget.uninstall()
    ogt.flat_parameters(model).numpy().astype("<f8").tofile(out + ".f64")
    with open(out + ".json", "w") as f:
        json.dump({"rank": rank, "ooms": guard.total_ooms, "micro_limit": min(guard.micro_limit or PER_RANK, PER_RANK),
                   "steps": guard.next_step, "incidents_with_ranks": any_oom_steps,
                   "engine": coordinator.engine() if coordinator else "local"}, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def silent(rank, model, opt, coordinator, xs, ys, out) -> int:
    done = out.replace("rank1", "rank0") + ".json"
    if rank == 1:
        while not os.path.exists(done):  # a peer that hangs outside any collective
            time.sleep(0.05)
        os._exit(0)
    guard = oomguard.Guard(coordinator=coordinator, vote_deadline_ms=1500)
    train_step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard)
    start = time.monotonic()
    try:
        train_step(xs[0], ys[0])
        error = None
    except oomguard.CoordinationTimeoutError as e:
        error = f"{type(e).__name__}: {e}"
    with open(done + ".tmp", "w") as f:
        json.dump({"error": error, "seconds": time.monotonic() - start}, f)
    os.replace(done + ".tmp", done)
    sys.stdout.flush()
    os._exit(oomguard.EXIT_COORDINATION_TIMEOUT)  # the pending collective must not block the exit


if __name__ == "__main__":
    sys.exit(main())
