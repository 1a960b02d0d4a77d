"""What hf_trainer.py and lightning_train.py share: their command line,
launching --ranks processes (as torchrun would: WORLD_SIZE, RANK, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), and the report (--json, --dump-params)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
from typing import Callable, List, Optional


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch and process")
    p.add_argument("--accumulate", type=int, default=2, help="batches accumulated into one optimizer step")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    p.add_argument("--budget-mib", type=float, default=0, help="CPU allocator budget per process in MiB (0: none)")
    p.add_argument("--ranks", type=int, default=1, help="processes, over gloo")
    p.add_argument("--plain", action="store_true", help="the reference: the trainer without oomguard")
    p.add_argument("--faults", default="", help="fault rules, as OOMGUARD_FAULTS (e.g. oom@step=2,site=optimizer)")
    p.add_argument("--kb", default="", help="the knowledge base incidents go to (SQLite file)")
    p.add_argument("--dump-params", default="", metavar="PATH",
                   help="write all parameters as raw little-endian float64 (rank 0)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line (rank 0)")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("steps", "batch", "accumulate", "ranks"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1 (got {getattr(args, name)})")
    if args.budget_mib < 0:
        p.error("--budget-mib must be >= 0")
    if args.plain and (args.budget_mib or args.faults):
        p.error("--plain is the reference run: no --budget-mib or --faults")
    if args.faults:
        import oomguard

        try:
            oomguard.set_fault_rules(args.faults)
        except ValueError as e:
            p.error(f"--faults: {e}")
        oomguard.clear_fault_rules()


def launch(argv: List[str], ranks: int) -> Optional[int]:
    """In the first process of a --ranks run: starts one process a rank (this
    script again, with torchrun's variables), forwards rank 0's output, returns
    the first failing exit code (0: all passed). None: this process is a rank."""
    if ranks == 1 or "RANK" in os.environ:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(ranks):
        env = dict(os.environ, WORLD_SIZE=str(ranks), RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, sys.argv[0], *argv], env=env,
                                      stdout=None if r == 0 else subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    for r, code in enumerate(codes):
        if code != 0:
            print(f"rank {r} ended with exit code {code}", file=sys.stderr)
            return code if code > 0 else 1
    return 0


def start(description: str, argv: Optional[List[str]]) -> tuple:
    """The common start of an example's main: parses and checks the command
    line, and in the first process of a --ranks run starts the ranks.
    Returns (args, exit code); the code is None in a process that trains."""
    p = parser(description)
    args = p.parse_args(argv)
    check(p, args)
    return args, launch(sys.argv[1:] if argv is None else argv, args.ranks)


def rank_and_world() -> tuple:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def gather(params, ooms: int, world: int) -> list:
    """Every rank's digest of its parameters and its OOM count (collective
    while the process group is up; the ranks must agree on the parameters)."""
    import torch
    import torch.distributed as dist

    flat = params.detach().to(torch.float64).contiguous()
    mine = {"rank": rank_and_world()[0], "ooms": ooms,
            "params_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]}
    if world > 1 and dist.is_available() and dist.is_initialized():
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        return ranks
    return [mine]


def report(args: argparse.Namespace, rank: int, world: int, params, ranks: list, summary: dict) -> None:
    """Rank 0 writes --dump-params and prints --json; every rank then leaves
    the process group (one that is left up at exit can abort the process)."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return
    if args.dump_params:
        params.detach().to(torch.float64).contiguous().numpy().astype("<f8").tofile(args.dump_params)
    if args.json:
        out = dict(summary)
        out.update(world_size=world, ranks=ranks, identical=len({r["params_sha256"] for r in ranks}) == 1,
                   ooms=sum(r["ooms"] for r in ranks))
        print(json.dumps(out))


def with_budget(args: argparse.Namespace, run: Callable[[], object]):
    """run() under --budget-mib (oomguard.budget) and --faults."""
    import oomguard
    import oomguard.budget

    if args.faults:
        oomguard.set_fault_rules(args.faults)
    if args.budget_mib:
        oomguard.budget.install(int(args.budget_mib * (1 << 20)))
    try:
        return run()
    finally:
        if args.budget_mib:
            oomguard.budget.uninstall()
        oomguard.clear_fault_rules()
