"""One rank of test_distributed_vote.py: two gloo ranks step a guard whose
sync is WORDS float64 on the host, through TorchDistributedCoordinator with
its collectives counted; rank 1 runs out of memory at the sync site of step 1.

    vote_sum_worker.py RANK INIT_FILE WORDS

Prints one JSON line: the collectives run and what each apply saw.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import oomguard
import oomguard.torch as ogt


class Counting(ogt.TorchDistributedCoordinator):
    def __init__(self) -> None:
        super().__init__()
        self.allgathers = 0
        self.sums = 0

    def allgather(self, mine, deadline_s):
        self.allgathers += 1
        return super().allgather(mine, deadline_s)

    def allreduce_sum(self, buffers, deadline_s):
        self.sums += 1
        return super().allreduce_sum(buffers, deadline_s)


def main() -> int:
    rank, init_file, words = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    coordinator = Counting()
    guard = oomguard.Guard(coordinator=coordinator, vote_deadline_ms=30000, device=None)
    oomguard.set_fault_rules("oom@step=1,rank=1,site=sync")
    buf = torch.zeros(words, dtype=torch.float64)
    applied, redone = [], []

    def micro(mb):
        buf.add_(mb.weight * (1.0 + rank))

    for _ in range(3):
        report = guard.step(4 + 8 * rank, micro, apply=lambda: applied.append(buf.tolist()),  # shares 1/4, 3/4
                            reset=lambda: buf.zero_(), sync=lambda: [buf])
        redone.append(report.redone)
        buf.zero_()
    oomguard.clear_fault_rules()
    print(json.dumps({"rank": rank, "allgathers": coordinator.allgathers, "sums": coordinator.sums,
                      "applied": applied, "redone": redone}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
