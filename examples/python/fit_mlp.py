#!/usr/bin/env python3
"""oomguard.torch.fit on a small float64 MLP, with a CPU byte budget that the
whole batch does not fit in: real torch OOMs, recovered to the plain run's
parameters.

    scripts/python examples/python/fit_mlp.py --steps 30 --plain --dump-params /tmp/plain.f64
    scripts/python examples/python/fit_mlp.py --steps 30 --budget-mib 3 --ckpt-dir /tmp/ckpt \\
        --check-against /tmp/plain.f64

The same script runs under torchrun (``python -m torch.distributed.run
--nproc-per-node 2 ...``): fit() starts the process group from the
environment, wraps the model in DistributedDataParallel and gives each rank
its share of every global batch; the budget then applies to each rank.
Run again with the same --ckpt-dir after a kill and it resumes.

Exit codes: 0 done (and equal to --check-against within 1e-10), 1 training
failed or differs, 2 bad arguments, 75 a peer rank stopped answering.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

import oomguard
import oomguard.budget
import oomguard.torch as ogt

FEATURES, HIDDEN, SAMPLES = 32, 256, 8192


def make_parts(seed: int, device: str = "cpu"):
    """The model (float64, on ``device``), its optimizer and scheduler; the
    model is moved before the optimizer is made, so it holds the moved tensors."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)).to(device, torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    return model, optimizer, scheduler


def make_data(seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(SAMPLES + 512, FEATURES, generator=g, dtype=torch.float64)
    y = torch.sin(x @ torch.randn(FEATURES, 1, generator=g, dtype=torch.float64))
    train = torch.utils.data.TensorDataset(x[:SAMPLES], y[:SAMPLES])
    val = torch.utils.data.TensorDataset(x[SAMPLES:], y[SAMPLES:])
    return train, val


def plain(args) -> torch.nn.Module:
    """The loop fit() must equal: each step's whole global batch at once."""
    model, optimizer, scheduler = make_parts(args.seed)
    train, _ = make_data(args.seed)
    sampler = ogt.StepBatchSampler(len(train), args.global_batch, seed=args.seed)
    for step in range(args.steps):
        x, y = train[sampler.global_batch(step)]
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=512, help="samples per step over every rank")
    p.add_argument("--budget-mib", type=float, default=0, help="CPU allocator budget per rank (0: none)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoints here; resumes from them")
    p.add_argument("--kb", default=None, help="record incidents in this knowledge base (SQLite file)")
    p.add_argument("--plain", action="store_true", help="the plain loop instead of fit (one process)")
    p.add_argument("--dump-params", default=None, help="write the final parameters (float64, rank 0)")
    p.add_argument("--check-against", default=None, help="compare the final parameters with this dump")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="end with a JSON summary line")
    a = p.parse_args(argv)
    if a.steps < 1 or a.global_batch < 1 or a.budget_mib < 0:
        p.error("--steps and --global-batch must be >= 1 and --budget-mib >= 0")
    if a.global_batch > SAMPLES:
        p.error(f"--global-batch must be at most {SAMPLES} (the dataset)")
    if a.budget_mib and not oomguard.budget.available():
        p.error("--budget-mib needs oomguard.budget (built against this torch)")
    if a.plain and (a.budget_mib or a.ckpt_dir or a.kb):
        p.error("--plain runs the unguarded loop: no --budget-mib, --ckpt-dir or --kb")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plain:
        if ogt.distributed.world_size() > 1 or int(__import__("os").environ.get("WORLD_SIZE", "1")) > 1:
            print("--plain runs in one process", file=sys.stderr)
            return 2
        model, summary = plain(args), {"mode": "plain"}
    else:
        model, optimizer, scheduler = make_parts(args.seed)
        train, val = make_data(args.seed)
        if args.budget_mib:
            oomguard.budget.install(int(args.budget_mib * (1 << 20)))
        try:
            result = ogt.fit(model, optimizer, torch.nn.functional.mse_loss, train, global_batch=args.global_batch,
                             steps=args.steps, seed=args.seed, scheduler=scheduler, clip_grad_norm=1.0,
                             ckpt_dir=args.ckpt_dir, ckpt_every=5, eval_data=val, eval_every=10,
                             knowledge_base=args.kb, workload=f"fit_mlp-{HIDDEN}")
        except oomguard.OutOfMemoryError as e:
            print(f"fit_mlp: {e}", file=sys.stderr)
            return 1
        finally:
            if args.budget_mib:
                oomguard.budget.uninstall()
        summary = {"mode": "fit", "ranks": ogt.distributed.world_size(), "steps": result.steps,
                   "resumed_from": result.resumed_from, "ooms": result.ooms, "rollbacks": result.rollbacks,
                   "final_micro_batch": result.micro_batch, "loss_last": result.losses[-1] if result.losses else None,
                   "eval_last": float(result.evals[max(result.evals)]) if result.evals else None,
                   "checkpoint_step": result.checkpoint_step, "wall_s": round(result.wall_s, 3)}
        print(f"fit_mlp: {result.steps} steps, {result.ooms} OOMs recovered, {result.rollbacks} rollbacks, "
              f"final micro-batch {result.micro_batch or args.global_batch}"
              + (f", resumed from step {result.resumed_from}" if result.resumed_from is not None else ""),
              file=sys.stderr)
    status = 0
    if ogt.distributed.rank() == 0:
        params = ogt.flat_parameters(model).numpy()
        if args.dump_params:
            params.astype("<f8").tofile(args.dump_params)
        if args.check_against:
            ref = np.fromfile(args.check_against, dtype="<f8")
            rel = float(np.max(np.abs(params - ref)) / np.max(np.abs(ref))) if ref.size == params.size else None
            summary["max_rel_diff"] = rel
            ok = rel is not None and rel <= 1e-10
            print(f"final parameters vs {args.check_against}: "
                  + (f"max relative difference {rel:.2e} ({'equal within 1e-10' if ok else 'DIFFERENT'})"
                     if rel is not None else "different sizes"), file=sys.stderr)
            status = 0 if ok else 1
        if args.json:
            print(json.dumps(summary))
    return status


if __name__ == "__main__":
    sys.exit(main())
