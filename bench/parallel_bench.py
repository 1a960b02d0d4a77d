#!/usr/bin/env python3
"""What guarding a DDP or FSDP2 step costs, on a link where communication takes
wall time without taking CPU: plain DDP against TrainStep in today's mode (every
micro-batch under no_sync, the guard sums the gradients after backward) and in
the overlap mode (DDP's bucketed all-reduce overlapped with the last backward,
through oomguard's comm hook), and plain FSDP2 against TrainStep on the same
sharded model (the agreement's flags inside FSDP's collectives, and the check
mode: a check before every FSDP collective); same model, same ranks,
alternating in one run (each round starts with the next mode).

The two ranks run in two network namespaces joined by a veth pair whose
bandwidth is limited with tc (tbf, --rate), gloo over that link. On a 2-core
machine a plain run cannot show overlap (compute and gloo's copies compete
for the same CPUs); through the limited link the wire time is real wall time.

    sudo scripts/python bench/parallel_bench.py --json         # root: netns, veth, tc
    scripts/python bench/parallel_bench.py --backend nccl --json   # 2 GPUs, NCCL, no link

With ``--backend nccl`` the two ranks run on the first two CUDA devices over
NCCL (whatever joins them: NVLink, PCIe), with no namespaces and no tc; step
times are taken after a device synchronisation. NCCL runs one rank per GPU, so
this needs two devices and says so otherwise. The FSDP modes run the check
agreement there (data mode is CPU/gloo only; docs/distributed.md).

The last line of --json is a JSON object with ``<mode>_ms`` (median step
time per mode) and ``ddp_overlap_ratio``, ``ddp_today_ratio`` (guarded DDP over
plain DDP) and ``fsdp_ratio`` (TrainStep on the model sharded with FSDP2, one
unit per Linear, over the plain FSDP2 step; ``fsdp_check_ratio`` the same in
check mode): the median of the per-round
ratios, each round running every mode back to back. Next to each ratio:
``<ratio>_of_medians`` (median step time over median step time) and
``<ratio>_spread`` (the 25th and 75th percentiles of the per-round ratios);
``load`` is the machine's load average before and after. Modes are the rows
of MODES (``--modes`` picks some), ratios the rows of RATIOS whose modes ran.

On a loaded machine one round's ratio moves by tens of percent: take many
rounds (``--rounds``, each mode ``--steps`` steps per round), ``--repeat`` the
whole run (fresh ranks each time; the rounds of every repeat are pooled, and
each repeat's own ratios are listed), and ``--pin`` each rank to a CPU of its
own so that the two ranks do not migrate onto one core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from typing import Callable, Dict, List, Optional

SUBNET = "10.231.{}.{}"


# ---- the network: two namespaces, one veth pair, tbf on both ends ----

class Link:
    """Two network namespaces joined by a veth pair limited to ``rate`` by tbf
    on both ends; removed on exit (and on errors)."""

    def __init__(self, rate: str, burst: str) -> None:
        if os.geteuid() != 0:
            raise SystemExit("parallel_bench: needs root (ip netns, veth and tc); run it with sudo")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise SystemExit(f"parallel_bench: '{tool}' not found (iproute2)")
        tag = uuid.uuid4().hex[:6]
        self.ns = [f"ogb{tag}a", f"ogb{tag}b"]
        self.dev = [f"ogv{tag}a", f"ogv{tag}b"]
        octet = int(tag[:2], 16) % 200 + 20
        self.addr = [SUBNET.format(octet, 1), SUBNET.format(octet, 2)]
        self.rate, self.burst = rate, burst
        self._made: List[str] = []

    def _ip(self, *args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"parallel_bench: 'ip {' '.join(args)}' failed: {r.stderr.strip()} "
                             "(network namespaces unavailable here?)")

    def __enter__(self) -> "Link":
        try:
            for ns in self.ns:
                self._ip("netns", "add", ns)
                self._made.append(ns)
            self._ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                    "rate", self.rate, "burst", self.burst, "latency", "200ms"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"parallel_bench: tc tbf failed: {r.stderr.strip()}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self._made:  # deleting a namespace removes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []


# ---- one rank ----

def build(args, torch):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(args.width, 1))
    return torch.nn.Sequential(*layers).to(args.device)


def _ddp(args, torch):
    model = build(args, torch)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False,
                                                          bucket_cap_mb=args.bucket_mb)
    return ddp_model, torch.optim.SGD(model.parameters(), lr=1e-4)


def _fsdp(args, torch):
    """The same model sharded with FSDP2: one unit per Linear, the rest in the root's."""
    from torch.distributed.fsdp import fully_shard

    model = build(args, torch)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def _plain(wrap):
    def mode(args, torch, ogt, oomguard):
        model, opt = wrap(args, torch)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return step
    return mode


def _guarded(wrap, **train_step_options):
    def mode(args, torch, ogt, oomguard):
        model, opt = wrap(args, torch)
        options = dict(vote_deadline_ms=120000, initial_micro_batch=args.batch, grow_after=0)
        if wrap is _fsdp:
            options.update(ogt.fsdp.GUARD_OPTIONS)
        guard = oomguard.Guard(coordinator=ogt.TorchDistributedCoordinator(), **options)
        ts = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard, **train_step_options)
        return lambda x, y: ts(x, y)
    return mode


# The modes, measured in this order in every round.
MODES: Dict[str, Callable] = {
    "plain": _plain(_ddp),
    "ddp_today": _guarded(_ddp, ddp_overlap=False),
    "ddp_overlap": _guarded(_ddp, ddp_overlap=True),
    "fsdp_plain": _plain(_fsdp),
    "fsdp": _guarded(_fsdp),  # the flags inside FSDP's collectives (the default agreement)
    "fsdp_check": _guarded(_fsdp, fsdp_agreement="check"),  # a check before every FSDP collective
}
# Each ratio: (guarded mode, its plain baseline).
RATIOS = {"ddp_today_ratio": ("ddp_today", "plain"), "ddp_overlap_ratio": ("ddp_overlap", "plain"),
          "fsdp_ratio": ("fsdp", "fsdp_plain"), "fsdp_check_ratio": ("fsdp_check", "fsdp_plain")}


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    import oomguard
    import oomguard.torch as ogt

    torch.set_num_threads(args.threads)
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[args.rank % len(cpus)]})
    if args.backend == "nccl":
        torch.cuda.set_device(args.rank)
        args.device = torch.device("cuda", args.rank)
        sync = torch.cuda.synchronize
    else:
        args.device = torch.device("cpu")
        sync = lambda: None  # noqa: E731 - the CPU's steps end when they return
    dist.init_process_group(args.backend, init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=2, timeout=timedelta(seconds=300))
    modes = args.modes.split(",")
    steps = {name: MODES[name](args, torch, ogt, oomguard) for name in modes}
    g = torch.Generator().manual_seed(1 + args.rank)
    x = torch.randn(args.batch, args.width, generator=g).to(args.device)
    y = torch.randn(args.batch, 1, generator=g).to(args.device)
    times: Dict[str, List[float]] = {name: [] for name in modes}
    for name, step in steps.items():  # warm-up: DDP rebuilds its buckets after its first synced step
        for _ in range(2):
            step(x, y)
    order = list(steps.items())
    for r in range(args.rounds):
        # Each round starts with another mode, so that none always runs first
        # (or last) in a round while the load on the machine drifts.
        for name, step in order[r % len(order):] + order[:r % len(order)]:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(x, y)
            sync()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    if args.rank == 0:
        print(json.dumps(times), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def summarize(times: Dict[str, List[float]]) -> dict:
    """Median step time per mode, and per ratio: the median of the per-round
    ratios, the ratio of the medians, and the per-round ratios' quartiles."""
    result = {f"{name}_ms": round(statistics.median(ts), 2) for name, ts in times.items()}
    for ratio, (name, base) in RATIOS.items():
        if name not in times or base not in times:
            continue
        # Per round: every mode ran back to back, so a ratio compares steps
        # taken under the same load.
        per_round = [t / p for t, p in zip(times[name], times[base])]
        result[ratio] = round(statistics.median(per_round), 3)
        result[ratio.replace("_ratio", "_ratio_of_medians")] = round(
            statistics.median(times[name]) / statistics.median(times[base]), 3)
        q1, _, q3 = (statistics.quantiles(per_round, n=4, method="inclusive") if len(per_round) > 1
                     else per_round * 3)
        result[ratio + "_spread"] = [round(q1, 3), round(q3, 3)]
    return result


def run_once(args, link: Optional["Link"], port: int) -> Dict[str, List[float]]:
    """One run of both ranks; rank 0's step times per mode and round. No
    link: both ranks on this host's loopback (the NCCL backend)."""
    env = dict(os.environ)
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank)]
        if link is not None:
            cmd = ["ip", "netns", "exec", link.ns[rank]] + cmd + ["--master", link.addr[0]]
        else:
            cmd += ["--master", "127.0.0.1"]
        for flag in ("width", "layers", "batch", "bucket_mb", "steps", "rounds", "threads", "modes", "backend"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        cmd += ["--port", str(port)]
        if args.pin:
            cmd.append("--pin")
        rank_env = {**env, "GLOO_SOCKET_IFNAME": link.dev[rank]} if link is not None else env
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, text=True))
    try:
        out, _ = procs[0].communicate(timeout=3600)
        procs[1].wait(timeout=120)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    if any(q.returncode != 0 for q in procs):
        raise SystemExit(f"parallel_bench: a rank failed (exit codes {[q.returncode for q in procs]})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit", help="tbf rate of each direction of the link")
    p.add_argument("--burst", default="256kb", help="tbf burst")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="DDP bucket_cap_mb")
    p.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    p.add_argument("--rounds", type=int, default=12, help="rounds, each mode once per round")
    p.add_argument("--repeat", type=int, default=1, help="whole runs (fresh ranks), their rounds pooled")
    p.add_argument("--pin", action="store_true", help="pin rank r to the r-th CPU this process may use")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--modes", default=",".join(MODES), help=f"modes to run, comma-separated (of {','.join(MODES)})")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="gloo: CPU ranks over the limited link (root); nccl: the first two CUDA devices, no link")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29581, help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("width", "layers", "batch", "steps", "rounds", "repeat", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown} (modes: {', '.join(MODES)})")
    if args.worker:
        return worker(args)

    load_before = [round(x, 2) for x in os.getloadavg()]
    runs: List[Dict[str, List[float]]] = []
    if args.backend == "nccl":
        import torch

        found = torch.cuda.device_count()
        if found < 2:
            raise SystemExit(f"parallel_bench: --backend nccl needs 2 CUDA devices (NCCL runs one rank per GPU), "
                             f"found {found}")
        for i in range(args.repeat):
            runs.append(run_once(args, None, args.port + i))
    else:
        with Link(args.rate, args.burst) as link:
            for i in range(args.repeat):
                runs.append(run_once(args, link, args.port + i))
    times = {name: [t for run in runs for t in run[name]] for name in runs[0]}
    result = summarize(times)
    if args.repeat > 1:
        result["repeats"] = [{ratio: value for ratio, value in summarize(run).items() if ratio in RATIOS}
                             for run in runs]
    result.update({"load": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
                   "backend": args.backend, "rate": args.rate if args.backend == "gloo" else None, "params": (args.width * args.width + args.width) * args.layers + args.width + 1,
                   "batch_per_rank": args.batch, "bucket_mb": args.bucket_mb, "rounds": args.rounds,
                   "repeat": args.repeat, "pinned": args.pin, "steps_per_round": args.steps, "all_ms": times})
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            if k != "all_ms":
                print(f"{k:28s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
