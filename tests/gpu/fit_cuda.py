#!/usr/bin/env python3
"""oomguard.torch.fit() on CUDA with the device full: real CUDA OOMs, equal parameters.

Runs examples/python/fit_mlp.py's model, optimizer, scheduler and data
(float64) through ``oomguard.torch.fit`` from the same seed in one process:
once unconstrained, measuring how much memory its steps needed beyond the
model; then with the device genuinely filled — a plain tensor takes all the
free memory but a headroom, a share of that need — so that a whole batch's
activations do not fit and torch's caching allocator raises real CUDA OOMs
(cudaMalloc itself fails; no memory-fraction setting). ``--headroom-shares``
are tried in turn until a constrained run recovers from at least one OOM
(one share may leave room enough for every batch, another too little for a
single sample). Every run checkpoints into a directory of its own (a
rollback path exists) and evaluates on the validation set every
``--eval-every`` steps, guarded, on the device. Batches are drawn on the
host and moved per micro-batch, as a DataLoader's are.

Prints one JSON line: each run's OOMs, rollbacks, final micro-batch,
evaluation OOMs and newest checkpoint, the device filled and the headroom
left, the shares tried, and the largest relative differences of the final
parameters, the losses and the evaluations (the guard's promise: <= 1e-10).

``--device cpu`` is a dry run of the same where there is no GPU: the budgeted
CPU allocator (oomguard.budget) admits the same share, so the OOMs are
torch's own CPU ones.

Used by tests/gpu/run.sh and run_bundle.sh, which only read the exit status
and the figures. Exit status: 0 a constrained run recovered >= 1 OOM and
ended equal within 1e-10 (and every run checkpointed its last step); 3 it
differs; 4 no share gave a recovered OOM; 1 an error (the unconstrained run
hitting an OOM among them); 2 no CUDA device (or, with --device cpu, no
oomguard.budget).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from typing import Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))

import oomguard  # noqa: E402
import oomguard.torch as ogt  # noqa: E402
import fit_mlp as example  # noqa: E402

TOLERANCE = 1e-10
MIB = 1 << 20


class Memory:
    """What the device's allocator has handed out: torch's caching allocator on
    CUDA, the budgeted allocator (counting only, until limited) on the CPU."""

    def __init__(self, device: str) -> None:
        self.device = device

    def start(self) -> int:
        """Resets the peak; returns the bytes in use now."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        import oomguard.budget

        oomguard.budget.install(0)
        oomguard.budget.reset_peak()
        return oomguard.budget.allocated()

    def peak(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        import oomguard.budget

        try:
            return oomguard.budget.peak()
        finally:
            oomguard.budget.uninstall()

    @contextlib.contextmanager
    def limited(self, headroom: int, figures: dict) -> Iterator[None]:
        """Leaves ``headroom`` bytes for what runs inside: on CUDA one touched
        tensor takes the rest of the device's free memory; on the CPU the
        budget admits ``headroom`` bytes more than are in use now."""
        gc.collect()  # what an earlier run left in reference cycles would count against the headroom
        if self.device == "cpu":
            import oomguard.budget

            with oomguard.budget.limit(headroom):
                figures["headroom_mib"] = round(headroom / MIB, 1)
                yield
            return
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        filler = None
        take = max(0, torch.cuda.mem_get_info()[0] - headroom)
        for _ in range(16):  # the driver may not hand out every byte it reports free
            try:
                filler = torch.empty(take, dtype=torch.uint8, device="cuda")
                break
            except torch.OutOfMemoryError:
                take -= 64 * MIB
        if filler is None:
            raise RuntimeError(f"could not fill the device (last try {take / MIB:.0f} MiB)")
        filler.fill_(1)  # touched, so the memory is really in use
        torch.cuda.synchronize()
        figures["filled_gib"] = round(filler.numel() / (1 << 30), 2)
        figures["headroom_mib"] = round(torch.cuda.mem_get_info()[0] / MIB, 1)
        try:
            yield
        finally:
            del filler
            torch.cuda.empty_cache()


def run(args: argparse.Namespace, memory: Memory, headroom: int | None) -> dict:
    """One fit() from the seed; unconstrained when ``headroom`` is None."""
    device = args.device
    model, optimizer, scheduler = example.make_parts(args.seed, device)
    train, val = example.make_data(args.seed)

    def forward(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(x.to(device)), y.to(device))

    out: dict = {}
    in_use = memory.start() if headroom is None else 0
    with tempfile.TemporaryDirectory(prefix="fit_cuda-") as ckpt_dir:
        limit = memory.limited(headroom, out) if headroom is not None else contextlib.nullcontext()
        with limit:
            result = ogt.fit(model, optimizer, data=train, forward=forward, global_batch=args.global_batch,
                             steps=args.steps, seed=args.seed, scheduler=scheduler, clip_grad_norm=1.0,
                             ckpt_dir=ckpt_dir, ckpt_every=args.ckpt_every, eval_data=val,
                             eval_every=args.eval_every, workload=f"fit_cuda-{device}-b{args.global_batch}")
        if headroom is None:
            out["need_mib"] = round((memory.peak() - in_use) / MIB, 1)
    first = result.incidents[0] if result.incidents else None
    out.update({
        "ooms": result.ooms,
        "eval_ooms": sum(1 for i in result.incidents if i.phase == "eval"),
        "rollbacks": result.rollbacks,
        "final_micro_batch": min(result.micro_batch or args.global_batch, args.global_batch),
        "checkpoint_step": result.checkpoint_step,
        "evals": len(result.evals),
        "loss_last": result.losses[-1] if result.losses else None,
        "wall_s": round(result.wall_s, 3),
        "incident": "" if first is None else f"{first.exception_type} in {first.phase}: {first.message[:160]}",
        "_params": ogt.flat_parameters(model).cpu(),
        "_losses": torch.tensor(result.losses, dtype=torch.float64),
        "_evals": torch.tensor([float(result.evals[k]) for k in sorted(result.evals)], dtype=torch.float64),
    })
    del result, model, optimizer, scheduler
    return out


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-300))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=None,
                   help=f"samples per step (default {example.SAMPLES} on CUDA, 1024 on the CPU)")
    p.add_argument("--headroom-shares", default="0.5,0.25,0.75",
                   help="memory left free for a constrained run, as shares of what the unconstrained one needed, "
                        "tried in turn")
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    if args.global_batch is None:
        args.global_batch = example.SAMPLES if args.device == "cuda" else 1024
    try:
        shares = [float(x) for x in args.headroom_shares.split(",")]
    except ValueError:
        shares = []
    if not shares or not all(0 < x < 1 for x in shares) or args.steps < 1 or \
            not 1 <= args.global_batch <= example.SAMPLES:
        p.error(f"--headroom-shares must be numbers in (0, 1) separated by commas, --steps >= 1, --global-batch in "
                f"[1, {example.SAMPLES}]")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fit_cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.device == "cpu":
        import oomguard.budget

        if not oomguard.budget.available():
            print("fit_cuda: --device cpu needs oomguard.budget (built against this torch)", file=sys.stderr)
            return 2
    memory = Memory(args.device)
    try:
        clean = run(args, memory, None)
    except (oomguard.OutOfMemoryError, torch.OutOfMemoryError) as e:
        print(f"fit_cuda: the unconstrained run ran out of memory: {e}", file=sys.stderr)
        return 1
    if clean["ooms"]:
        print(f"fit_cuda: the unconstrained run hit {clean['ooms']} OOMs", file=sys.stderr)
        return 1
    tries = []
    tight = None
    for share in shares:
        try:
            attempt = run(args, memory, int(clean["need_mib"] * MIB * share))
        except (oomguard.OutOfMemoryError, torch.OutOfMemoryError) as e:
            # Too little room for one sample (or for the batch the loader
            # collates on the host, in the CPU dry run): the next share.
            tries.append({"share": share, "unrecovered": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        tries.append({"share": share, "ooms": attempt["ooms"], "headroom_mib": attempt["headroom_mib"]})
        if attempt["ooms"] >= 1:
            tight = attempt
            break
    report = {"device": args.device, "torch": torch.__version__, "global_batch": args.global_batch,
              "steps": args.steps, "tries": tries, "clean": {k: v for k, v in clean.items() if k[0] != "_"}}
    if tight is None:
        print(json.dumps(report))
        print(f"fit_cuda: no share gave a recovered OOM: {tries}", file=sys.stderr)
        return 4
    diffs = {
        "max_rel_diff": rel_diff(clean["_params"], tight["_params"]),
        "losses_max_rel_diff": rel_diff(clean["_losses"], tight["_losses"]),
        "evals_max_rel_diff": rel_diff(clean["_evals"], tight["_evals"]),
    }
    equal = all(v <= TOLERANCE for v in diffs.values()) and clean["evals"] == tight["evals"] >= 1
    checkpointed = clean["checkpoint_step"] == tight["checkpoint_step"] == args.steps - 1
    report.update({"headroom_share": tries[-1]["share"], "tight": {k: v for k, v in tight.items() if k[0] != "_"},
                   **diffs, "equal": equal, "checkpointed": checkpointed})
    print(json.dumps(report))
    if not equal or not checkpointed:
        print(f"fit_cuda: the runs DIFFER: {diffs}, evaluations {clean['evals']} vs {tight['evals']}, newest "
              f"checkpoints {clean['checkpoint_step']} vs {tight['checkpoint_step']} (want {args.steps - 1})",
              file=sys.stderr)
        return 3
    return 0

if __name__ == "__main__":
    sys.exit(main())
