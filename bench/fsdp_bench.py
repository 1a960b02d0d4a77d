#!/usr/bin/env python3
"""Guarded FSDP2 against plain FSDP2: step time without OOMs, same model, same
ranks, alternating step by step in one run over gloo on the CPU.

    PYTHONPATH=build/python scripts/python bench/fsdp_bench.py --ranks 2 --pairs 20 --json

The model is examples/python/train_gpt.py's GPT, sharded with fully_shard per
block and on the model. Plain: each rank's whole share in one forward and
backward, clip_grad_norm_, AdamW. Guarded: the same through TrainStep (one
micro-batch: no OOM happens), whose agreement adds one check before each FSDP
collective, one per micro-batch and one at the end, and the guard's vote, loss
sum and agreement. The last line (--json) is a JSON object with
``fsdp_ratio`` (median guarded / median plain step time), the medians, and the
collectives per step of each, and the time of one check on its own
(``check_ms``, median of batches of 50) times the checks per step: on a
loaded host the ratio is noisy, that product much less so.
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


def rank_main(rank: int, args, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.ranks,
                            timeout=timedelta(seconds=120))
    world = args.ranks
    plain, plain_opt = build(args)
    guarded, guarded_opt = build(args)
    guard = oomguard.Guard(coordinator=ogt.TorchDistributedCoordinator(), **ogt.fsdp.GUARD_OPTIONS)
    step = ogt.TrainStep(guarded, guarded_opt, train_gpt.token_loss, guard=guard, loss_units=train_gpt.valid_tokens,
                         clip_grad_norm=1.0)
    lo, hi = rank * args.batch // world, (rank + 1) * args.batch // world
    times = {"plain": [], "guarded": []}

    def plain_step(tokens, labels):
        units = torch.tensor([float((labels != -1).sum())], dtype=torch.float64)
        total = units.clone()
        dist.all_reduce(total)
        plain_opt.zero_grad(set_to_none=True)
        loss = train_gpt.token_loss(plain(tokens), labels)
        (loss * (world * units.item() / total.item())).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()

    for i in range(args.warmup + args.pairs):
        tokens, labels = train_gpt.make_batch(0, i, args.batch, args.context, args.vocab)
        tokens, labels = tokens[lo:hi], labels[lo:hi]
        order = ("plain", "guarded") if i % 2 == 0 else ("guarded", "plain")
        for which in order:
            dist.barrier()
            t0 = time.perf_counter()
            if which == "plain":
                plain_step(tokens, labels)
            else:
                step(tokens, labels)
            dist.barrier()
            if i >= args.warmup:
                times[which].append(time.perf_counter() - t0)
    a = step._fsdp
    steps = args.warmup + args.pairs
    checks, collectives = a.checks, a.collectives
    # One check on its own, timed in batches of 50 (a less noisy figure than the ratio on a loaded host).
    per_check = []
    for _ in range(10):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(50):
            a._exchange(False, False)
        per_check.append((time.perf_counter() - t0) / 50)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "checks_per_step": checks / steps,
                       "fsdp_collectives_per_step": collectives / steps,
                       "check_ms": statistics.median(per_check) * 1e3}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
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
    plain_ms = statistics.median(r["times"]["plain"]) * 1e3
    guarded_ms = statistics.median(r["times"]["guarded"]) * 1e3
    fsdp_coll = r["fsdp_collectives_per_step"]
    result = {
        "ranks": args.ranks, "pairs": args.pairs,
        "model": f"TinyGPT w{args.width} l{args.layers} c{args.context} v{args.vocab}, batch {args.batch}",
        "plain_ms": round(plain_ms, 2), "guarded_ms": round(guarded_ms, 2),
        "fsdp_ratio": round(guarded_ms / plain_ms, 4),
        "plain_collectives_per_step": fsdp_coll + 2,  # FSDP's + the units all-reduce and clip's norm
        "guarded_collectives_per_step": fsdp_coll + r["checks_per_step"] + 3,  # + checks + vote, sum, agreement
        "checks_per_step": r["checks_per_step"],
        "check_ms": round(r["check_ms"], 4),
        "checks_ms_per_step": round(r["check_ms"] * r["checks_per_step"], 3),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    if not args.json:
        print(f"plain FSDP {plain_ms:.1f} ms/step, guarded {guarded_ms:.1f} ms/step, ratio {result['fsdp_ratio']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
