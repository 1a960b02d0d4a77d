#!/usr/bin/env python3
"""Composer's ``device_train_microbatch_size="auto"`` on bench/peers' model,
data and budget, in Composer's own environment (bench/peers/run.sh makes it
from bench/peers/requirements-composer.txt: Composer pins torch<2.7.1).

    PYTHONPATH=BUILD/python python composer_peer.py --steps N --budget BYTES --out FILE.json

Writes the run's OOMs, samples redone, final micro-batch, the step times once
stable and the final parameters (for peers.py's table). With WORLD_SIZE=2
(RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) each rank trains on its half
of every global batch (Composer's DDP over gloo); ``--budget`` then applies to
the ranks named by ``--budget-ranks``.

What is widened, and nothing else: Composer refuses "auto" on another device
than a GPU (``_is_auto_microbatching``) and recognises an OOM by "CUDA out of
memory" in its message (``_is_cuda_oom``); the simulated device's OOM is a
``torch.OutOfMemoryError`` (the type of a CUDA OOM) worded "CPU out of memory
(oomguard budget)". The bench lets "auto" run on the CPU device and counts a
``torch.OutOfMemoryError`` as the OOM Composer looks for. Its thrash detector
(CUDA allocation retries) has nothing to read on the CPU and stays off, as it
does on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import peers  # noqa: E402  (the model, data and loss every system shares)


def widen_composer() -> None:
    import composer.trainer.trainer as ct

    auto, is_oom = ct._is_auto_microbatching, ct._is_cuda_oom

    def auto_on_cpu(size, device):
        if size == "auto":
            return True
        return auto(size, device)

    ct._is_auto_microbatching = auto_on_cpu
    ct._is_cuda_oom = lambda e: isinstance(e, torch.OutOfMemoryError) or is_oom(e)


def run(steps: int, world: int, rank: int) -> dict:
    import composer
    from composer import Callback, Trainer
    from composer.models import ComposerModel

    class Model(ComposerModel):
        def __init__(self, gpt: torch.nn.Module) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, batch):
            return self.gpt(batch[0])

        def loss(self, outputs, batch, *args, **kwargs):
            return peers.loss_fn(outputs, batch[1])

    record = {"attempt_samples": 0, "ooms": 0, "redone": 0, "times": [], "oom_batches": []}

    class Count(Callback):
        """Samples each try of a batch started; the batch's time (wall, CPU)."""

        def batch_start(self, state, logger):
            record["attempt_samples"], record["t0"] = 0, peers._now()
            record["micro_at_start"] = state.device_train_microbatch_size

        def before_forward(self, state, logger):
            record["attempt_samples"] += int(state.batch[0].shape[0])

        def batch_end(self, state, logger):
            record["times"].append(peers._since(record["t0"]))

    gpt, opt = peers.model_and_optimizer()
    model = Model(gpt)
    data = peers.dataset()
    per_rank = peers.GLOBAL // world
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) \
        if world > 1 else None
    # DistributedSampler deals samples round-robin; the reference's step k is
    # samples [32k, 32k+32): the same set per step, so the same mean gradient.
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank, shuffle=False, sampler=sampler)
    # Count a retry: Composer catches the OOM inside _train_batch and reruns the
    # whole batch with half the micro-batch; before_forward counts what was started.
    import composer.trainer.trainer as ct

    adjust = ct._adjust_device_train_microbatch_size

    def counting(state):
        record["ooms"] += 1
        record["redone"] += record["attempt_samples"]
        record["attempt_samples"] = 0
        record["oom_batches"].append(len(record["times"]))
        return adjust(state)

    ct._adjust_device_train_microbatch_size = counting
    trainer = Trainer(model=model, train_dataloader=loader, optimizers=opt, max_duration=f"{steps}ba",
                      device="cpu", device_train_microbatch_size="auto", callbacks=[Count()],
                      progress_bar=False, log_to_console=False, loggers=[], save_folder=None, seed=0)
    trainer.fit()
    stable_from = max(record["oom_batches"], default=-1) + 1
    times = record["times"][stable_from:]
    return {"ooms": record["ooms"], "samples_redone": record["redone"],
            "final_batch": trainer.state.device_train_microbatch_size, "global_batch": peers.GLOBAL,
            "step_times": times, "params": peers.flat(gpt).tolist(), "composer": composer.__version__,
            "torch": torch.__version__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--budget", type=int, required=True, help="bytes of the simulated caching device")
    p.add_argument("--budget-ranks", default="all", help="comma-separated ranks under the budget (default: all)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import logging

    import oomguard.budget

    warnings.filterwarnings("ignore")
    logging.getLogger("composer").setLevel(logging.ERROR)
    import faulthandler

    at = float(os.environ.get("PEERS_DUMP_STACKS_AT", "0"))
    if at:  # the stacks, for the parent to say where a hung rank was: before its deadline
        faulthandler.dump_traceback_later(max(1.0, at - time.time()), exit=False)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    widen_composer()
    peers.dataset()
    budgeted = a.budget_ranks == "all" or str(rank) in a.budget_ranks.split(",")
    gc.collect()
    if budgeted:
        oomguard.budget.install(a.budget, caching_device=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            out = run(a.steps, world, rank)
    except Exception as e:  # a failure is a row too
        out = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    finally:
        if budgeted:
            oomguard.budget.uninstall()
    with open(a.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
