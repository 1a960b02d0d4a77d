#!/usr/bin/env python3
"""examples/python/train_torch.py's model and data on CUDA, with the device full.

Trains the example's MLP (float64) through ``oomguard.torch.TrainStep`` twice in
one process: once without a limit, then again from the same seed with the
device genuinely filled — a plain tensor takes all of its free memory but
``--headroom-mib`` above what the model, optimizer and data already hold — so
that the whole batch's activations do not fit and torch's caching allocator
raises real CUDA OOMs (no memory-fraction setting: cudaMalloc itself fails).
``--fraction`` keeps the older way (set_per_process_memory_fraction) for
comparison.
Prints one JSON line: OOMs of each run, the final micro-batch, and the maximum
relative difference of the final parameters (the guard's promise: <= 1e-10).

Used by tests/gpu/run.sh; exits 0 when the run completed (the caller judges
the figures), 1 on an error, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))

import oomguard  # noqa: E402
import oomguard.torch as ogt  # noqa: E402
import train_torch as example  # noqa: E402


def train(args: argparse.Namespace, headroom_bytes: int) -> dict:
    torch.manual_seed(args.seed)
    model = example.make_model().to("cuda", torch.float64)
    # The example's optimizer and learning rate.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs, ys = example.make_data(args.seed, args.steps, args.global_batch, torch.float64)
    xs, ys = xs.cuda(), ys.cuda()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = 1.0
    filler = None
    if headroom_bytes > 0 and args.fraction:
        # Momentum buffers appear at the first optimizer step: counted in the headroom.
        fraction = min(1.0, (torch.cuda.memory_reserved() + headroom_bytes) / total)
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    elif headroom_bytes > 0:
        # Fill the device for real: what cudaMalloc can still give, less the headroom.
        free, _ = torch.cuda.mem_get_info()
        take = max(0, free - headroom_bytes)
        filler = torch.empty(take, dtype=torch.uint8, device="cuda")
        filler.fill_(1)  # touched, so the memory is really in use
    free_at_start = torch.cuda.mem_get_info()[0]
    guard = oomguard.Guard(workload=f"train_torch-cuda-b{args.global_batch}")
    train_step = ogt.TrainStep(model, optimizer, torch.nn.functional.mse_loss, guard=guard)
    t0 = time.monotonic()
    loss = None
    first_incident = ""
    figures = {}
    for step in range(args.steps):
        loss = train_step(xs[step], ys[step])
        if not first_incident and train_step.last_report.incidents:
            inc = train_step.last_report.incidents[0]
            first_incident = inc.message[:160]
            # What the incident recorded of torch's caching allocator (item 6 of
            # the GPU issue): torch.cuda.memory_stats figures at the OOM.
            m = inc.memory
            figures = {k: int(getattr(m, k)) for k in ("total", "free", "allocated", "reserved", "inactive_split",
                                                       "num_alloc_retries", "num_ooms")}
    torch.cuda.synchronize()
    out = {
        "ooms": guard.total_ooms,
        "final_micro_batch": min(guard.micro_limit or args.global_batch, args.global_batch),
        "loss_last": loss,
        "fraction": fraction,
        "filled_gib": 0 if filler is None else round(filler.numel() / (1 << 30), 2),
        "free_mib_at_start": round(free_at_start / (1 << 20), 1),
        "device_gib": round(total / (1 << 30), 1),
        "wall_s": round(time.monotonic() - t0, 3),
        "incident": first_incident,
        "incident_memory": figures,
        "params": ogt.flat_parameters(model).cpu(),
    }
    del train_step, guard, optimizer, model, xs, ys, filler
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=16384)
    p.add_argument("--headroom-mib", type=float, default=160)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--fraction", action="store_true",
                   help="limit with set_per_process_memory_fraction instead of filling the device")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("train_torch_cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    clean = train(args, 0)
    tight = train(args, int(args.headroom_mib * (1 << 20)))
    a, b = clean.pop("params"), tight.pop("params")
    rel = float((a - b).abs().max() / a.abs().max())
    print(json.dumps({"clean": clean, "tight": tight, "max_rel_diff": rel, "parameters": a.numel(),
                      "global_batch": args.global_batch, "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
