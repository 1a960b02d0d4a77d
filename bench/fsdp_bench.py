#!/usr/bin/env python3
"""Guarded FSDP2 against plain FSDP2: step time and collectives without OOMs,
same model, same ranks, alternating step by step in one run over gloo on the CPU.

    PYTHONPATH=build/python scripts/python bench/fsdp_bench.py --ranks 2 --pairs 20 --json

The model is examples/python/train_gpt.py's GPT, sharded with fully_shard per
block and on the model. Three modes, each with its own model, in a rotating
order every round: plain (each rank's whole share in one forward and
backward, clip_grad_norm_, AdamW), data (TrainStep with the agreement's flags
inside FSDP's all-gathers and reduce-scatters: no collective of its own but
the step's closing check) and check (TrainStep with a check before every FSDP
collective). Every torch.distributed collective of a step is counted, split
into data collectives (FSDP's) and small ones (checks, the units all-reduce,
clipping's norm, the guard's vote and agreement), per step and per
micro-batch, beside the anchor: one small collective per FSDP unshard per
micro-batch (Composer's flag before each FSDP1 unshard, forward and backward). The last line
(--json) is a JSON object with ``fsdp_ratio`` (median data / median plain step
time), ``fsdp_check_ratio`` (check over plain), the same as medians of the
per-round ratios, the medians, rank 0's CPU time per step, the counts, and
the time of one check on its own (``check_ms``, median of batches of 50):
on a loaded host the ratios are noisy, that time much less so.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "python"))
import train_gpt  # noqa: E402

import oomguard  # noqa: E402
import oomguard.torch as ogt  # noqa: E402


def build(args):
    torch.manual_seed(0)
    model = train_gpt.TinyGPT(args.vocab, args.width, args.layers, args.heads, args.context)
    train_gpt.shard_per_block(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


MODES = ("plain", "data", "check")
SMALL = 64  # elements: a collective this small is a flag, a check or a guard's record, not FSDP's data


class Counter:
    """Counts every torch.distributed collective this process issues (patched
    into the module: oomguard's agreement, its coordinator and FSDP call
    through it), split into small and data collectives, for the mode that is
    running."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
    FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor")  # DTensor's (clipping's norm)

    def __init__(self) -> None:
        import torch.distributed._functional_collectives as funcol

        self.mode: str = ""
        self.counts = {m: {"small": 0, "data": 0} for m in MODES}
        for module, names in ((dist, self.NAMES), (funcol, self.FUNCTIONAL)):
            for name in names:
                setattr(module, name, self._wrap(getattr(module, name)))

    def _wrap(self, inner):
        def call(*args, **kwargs):
            t = args[0] if args else next(iter(kwargs.values()))
            if isinstance(t, list):
                t = t[0]
            if self.mode:
                self.counts[self.mode]["small" if t.numel() <= SMALL else "data"] += 1
            return inner(*args, **kwargs)
        return call


def rank_main(rank: int, args, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.ranks,
                            timeout=timedelta(seconds=120))
    counter = Counter()
    world = args.ranks
    models = {m: build(args) for m in MODES}
    steps = {}
    for mode in ("data", "check"):
        model, opt = models[mode]
        guard = oomguard.Guard(coordinator=ogt.TorchDistributedCoordinator(), initial_micro_batch=args.micro,
                               grow_after=0, vote_deadline_ms=120000, **ogt.fsdp.GUARD_OPTIONS)
        steps[mode] = ogt.TrainStep(model, opt, train_gpt.token_loss, guard=guard,
                                    loss_units=train_gpt.valid_tokens, clip_grad_norm=1.0, fsdp_agreement=mode)
    plain, plain_opt = models["plain"]
    lo, hi = rank * args.batch // world, (rank + 1) * args.batch // world
    times = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}  # this process's CPU time (all its threads): less moved by other jobs' load
    measured = {m: {"small": 0, "data": 0} for m in MODES}

    def plain_step(tokens, labels):
        # The micro-batches of the guarded modes, accumulated: the same collectives FSDP runs there.
        units = torch.tensor([float((labels != -1).sum())], dtype=torch.float64)
        total = units.clone()
        dist.all_reduce(total)
        plain_opt.zero_grad(set_to_none=True)
        size = args.micro or len(tokens)
        for i in range(0, len(tokens), size):
            part = labels[i:i + size]
            w = float((part != -1).sum()) / units.item()
            loss = train_gpt.token_loss(plain(tokens[i:i + size]), part)
            (loss * w * (world * units.item() / total.item())).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()

    for i in range(args.warmup + args.pairs):
        tokens, labels = train_gpt.make_batch(0, i, args.batch, args.context, args.vocab)
        tokens, labels = tokens[lo:hi], labels[lo:hi]
        order = MODES[i % 3:] + MODES[:i % 3]
        for which in order:
            dist.barrier()
            before = dict(counter.counts[which])
            counter.mode = which
            t0, c0 = time.perf_counter(), time.process_time()
            if which == "plain":
                plain_step(tokens, labels)
            else:
                steps[which](tokens, labels)
            counter.mode = ""
            dist.barrier()
            if i >= args.warmup:
                times[which].append(time.perf_counter() - t0)
                cpu[which].append(time.process_time() - c0)
                for k in ("small", "data"):
                    measured[which][k] += counter.counts[which][k] - before[k]
    agreements = {m: steps[m]._fsdp for m in ("data", "check")}
    # One check on its own, timed in batches of 50 (a less noisy figure than the ratio on a loaded host).
    per_check = []
    for _ in range(10):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(50):
            agreements["check"]._exchange(False, False)
        per_check.append((time.perf_counter() - t0) / 50)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "cpu": cpu, "measured": measured, "check_ms": statistics.median(per_check) * 1e3,
                       "unshards": sum(1 for k in agreements["data"].schedules.get(True, []) if k[0] == "all_gather"),
                       "schedule": len(agreements["data"].schedules.get(True, [])),
                       "data_mode": bool(agreements["data"].schedules),
                       "fallbacks": agreements["data"].fallbacks,
                       "fallback_reason": agreements["data"].fallback_reason}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--micro", type=int, default=0, help="micro-batch per rank (0: the rank's whole share)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.ranks < 2 or args.pairs < 1 or args.batch < args.ranks:
        p.error("--ranks >= 2, --pairs >= 1, --batch >= --ranks")
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="fsdp_bench-") as tmp:
        out = os.path.join(tmp, "out.json")
        procs = [ctx.Process(target=rank_main, args=(r, args, os.path.join(tmp, "init"), out)) for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=1800)
            if proc.is_alive():
                proc.kill()
                print("a rank did not finish", file=sys.stderr)
                return 1
        if any(proc.exitcode for proc in procs):
            print("a rank failed", file=sys.stderr)
            return 1
        with open(out) as f:
            r = json.load(f)
    ms = {m: statistics.median(r["times"][m]) * 1e3 for m in MODES}
    micro_per_step = -(-(args.batch // args.ranks) // (args.micro or args.batch))
    per_step = {m: {k: round(v / args.pairs, 2) for k, v in r["measured"][m].items()} for m in MODES}
    result = {
        "ranks": args.ranks, "pairs": args.pairs,
        "model": f"TinyGPT w{args.width} l{args.layers} c{args.context} v{args.vocab}, batch {args.batch}",
        "micro_batches_per_step": micro_per_step,
        "plain_ms": round(ms["plain"], 2), "data_ms": round(ms["data"], 2), "check_ms_per_step": round(ms["check"], 2),
        "fsdp_ratio": round(ms["data"] / ms["plain"], 4),
        "fsdp_check_ratio": round(ms["check"] / ms["plain"], 4),
        # The median of the per-round ratios (each round ran the three modes back to back).
        "fsdp_ratio_of_rounds": round(statistics.median(
            d / p for d, p in zip(r["times"]["data"], r["times"]["plain"])), 4),
        "fsdp_check_ratio_of_rounds": round(statistics.median(
            c / p for c, p in zip(r["times"]["check"], r["times"]["plain"])), 4),
        "cpu_ms": {m: round(statistics.median(r["cpu"][m]) * 1e3, 2) for m in MODES},
        "collectives_per_step": per_step,
        "small_per_micro_batch": {m: round(per_step[m]["small"] / micro_per_step, 2) for m in MODES},
        "anchor_small_per_micro_batch": r["unshards"],
        "fsdp_collectives_per_micro_batch": r["schedule"],
        "data_mode_reached": r["data_mode"], "fallbacks": r["fallbacks"], "fallback_reason": r["fallback_reason"],
        "check_ms": round(r["check_ms"], 4),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    if not args.json:
        print(f"plain FSDP {ms['plain']:.1f} ms/step, data mode {ms['data']:.1f} ({result['fsdp_ratio']}), "
              f"check mode {ms['check']:.1f} ({result['fsdp_check_ratio']})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
