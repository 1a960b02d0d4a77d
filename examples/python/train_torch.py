#!/usr/bin/env python3
"""A small real PyTorch model trained through oomguard, under a memory budget.

The budget (``--budget-mib``) caps torch's CPU allocator, so activations of a
too-large micro-batch raise torch's own out-of-memory error; the guard splits
the step into smaller micro-batches with the same global batch, and the run
ends with the same parameters as a run without OOMs (with float64, within
1e-10 relative; compare two runs with ``--dump-params``).

    PYTHONPATH=build/python scripts/python examples/python/train_torch.py \\
        --steps 20 --global-batch 512 --budget-mib 24 --dtype float64 --json

Data for step k is a pure function of (seed, k), so a rolled-back or resumed
run sees the same batches. Exit codes: 0 done, 1 training failed, 2 bad
arguments, 4 done but the knowledge base lost incidents (``incident_ops_lost``
in the JSON line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import oomguard
import oomguard.budget
import oomguard.torch as ogt

IN_FEATURES = 32
HIDDEN = 512


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


def make_data(seed: int, steps: int, batch: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(steps, batch, IN_FEATURES, generator=g, dtype=torch.float64)
    w = torch.randn(IN_FEATURES, 1, generator=g, dtype=torch.float64)
    y = torch.sin(x @ w) + 0.1 * torch.randn(steps, batch, 1, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=512, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, default=0, help="initial micro-batch (0: the whole batch)")
    p.add_argument("--budget-mib", type=float, default=0, help="CPU allocator budget in MiB (0: none)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--ckpt-dir", default="", help="checkpoint directory (empty: no checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=5, help="save every N steps")
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --ckpt-dir")
    p.add_argument("--kb", default=os.environ.get("OOMGUARD_KB_URL", ""),
                   help="incident knowledge base: an SQLite file or a postgresql:// URL (default: $OOMGUARD_KB_URL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dump-params", default="", metavar="PATH",
                   help="write all parameters in state_dict order as raw little-endian float64")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = p.parse_args(argv)
    # float() accepts "nan" and "inf", and every comparison with NaN is false:
    # check finiteness before ranges.
    for flag, value in (("--lr", args.lr), ("--budget-mib", args.budget_mib)):
        if not math.isfinite(value):
            p.error(f"{flag} must be a finite number, got {value}")
    if args.steps < 1 or args.global_batch < 1 or args.micro_batch < 0 or args.budget_mib < 0:
        p.error("--steps and --global-batch must be >= 1; --micro-batch and --budget-mib >= 0")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if 0 < args.budget_mib * (1 << 20) < 1:
        p.error(f"--budget-mib {args.budget_mib} is less than one byte (0 means no budget)")
    if args.ckpt_every < 1:
        p.error(f"--ckpt-every must be >= 1, got {args.ckpt_every}")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    return args


def json_number(x):
    """A float for JSON: None (null) for NaN and infinities (a diverged loss), which JSON cannot spell."""
    return x if x is not None and math.isfinite(x) else None


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    model = make_model().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    xs, ys = make_data(args.seed, args.steps, args.global_batch, dtype)
    workload = f"train_torch-mlp{IN_FEATURES}x{HIDDEN}-{args.dtype}-b{args.global_batch}"

    kb = oomguard.KnowledgeBase(args.kb) if args.kb else None
    initial = args.micro_batch
    if kb is not None and initial == 0:
        initial = kb.prior_micro_batch(workload) or 0
    ckpt = None
    if args.ckpt_dir:
        ckpt = oomguard.Checkpointer(args.ckpt_dir, every_steps=args.ckpt_every)
        ogt.register_state(ckpt, model=model, optimizer=optimizer)

    guard = oomguard.Guard(initial_micro_batch=initial, workload=workload, knowledge_base=kb, recovery=ckpt)
    if args.resume:
        resumed = ckpt.load_latest()
        if resumed is not None:
            guard.next_step = resumed + 1
            print(f"resumed from step {resumed}", file=sys.stderr)
    train_step = ogt.TrainStep(model, optimizer, torch.nn.functional.mse_loss, guard=guard)

    if args.budget_mib > 0:
        oomguard.budget.install(int(args.budget_mib * (1 << 20)))
    loss_first = loss_last = None
    t0 = time.monotonic()
    try:
        while guard.next_step < args.steps:
            step = guard.next_step
            try:
                loss = train_step(xs[step], ys[step])
            except oomguard.RolledBackError as e:
                print(f"step {step}: {e}; continuing from step {e.next_step}", file=sys.stderr)
                continue
            if loss_first is None:
                loss_first = loss
            loss_last = loss
            report = train_step.last_report
            if kb is not None:
                kb.record_clean_micro_batch(workload, report.largest_micro)
            if not args.json:
                print(f"step {step:4d}  loss {loss:.6f}  micro-batches {report.micro_batches}"
                      f"  ooms {report.ooms}")
    finally:
        if args.budget_mib > 0:
            oomguard.budget.uninstall()
    wall_s = time.monotonic() - t0
    if ckpt is not None:
        ckpt.wait()
    # Incidents the knowledge base did not store are part of the result (the
    # JSON line and exit code 4), not only a log line.
    lost = 0
    if kb is not None:
        try:
            kb.flush()
        except oomguard.OomguardError as e:
            print(f"train_torch: --kb: {e}", file=sys.stderr)
        lost = kb.sink_stats.lost
        if lost:
            print(f"train_torch: --kb {kb.path}: {lost} incident operation(s) were not recorded", file=sys.stderr)
    if args.dump_params:
        ogt.flat_parameters(model).numpy().astype("<f8").tofile(args.dump_params)
    if args.json:
        print(json.dumps({
            "steps": args.steps,
            "global_batch": args.global_batch,
            "initial_micro_batch": min(initial, args.global_batch) if initial > 0 else args.global_batch,
            "final_micro_batch": min(guard.micro_limit or args.global_batch, args.global_batch),
            "ooms": guard.total_ooms,
            "loss_first": json_number(loss_first),
            "loss_last": json_number(loss_last),
            "wall_s": round(wall_s, 3),
            "incident_ops_lost": lost,
        }, allow_nan=False))
    return 4 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
