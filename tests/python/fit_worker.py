"""One process of a fit() run, for the tests that need processes: a resume
after kill -9, ranks under torch.distributed (launched as torchrun would:
WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT in the environment), and the
plain loop those runs are compared with.

    python fit_worker.py OUT.f64 --mode fit|plain [--steps N] [--ckpt DIR] [--budget-frac F]

The script is the same for one process and for several: fit() starts the
process group from the environment. It writes the final parameters
(float64, rank 0) and a JSON summary next to them.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import oomguard
import oomguard.budget
import oomguard.torch as ogt

# Narrow and deep with a large batch: activations outweigh the parameters,
# their gradients and the momentum, so a byte budget can split a step.
N, D, H, GLOBAL = 1024, 16, 32, 256


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = (x[:, :1] * 0.7 - x[:, 1:2] * 0.2).tanh() + 0.05 * torch.randn(N, 1, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y)


def model_and_optimizer():
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, H), torch.nn.Tanh(),
                                torch.nn.Linear(H, H), torch.nn.Tanh(), torch.nn.Linear(H, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    return model, opt, sched


def plain(steps: int) -> torch.Tensor:
    """The loop fit() must equal: the whole global batch of each step at once."""
    model, opt, sched = model_and_optimizer()
    ds = data()
    sampler = ogt.StepBatchSampler(len(ds), GLOBAL, seed=0)
    for k in range(steps):
        x, y = ds[sampler.global_batch(k)]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return ogt.flat_parameters(model)


def peak_bytes(batch: int) -> int:
    """What one unconstrained process allocates at most over two steps of
    ``batch`` samples, besides the model: activations, gradients, momentum."""
    import gc

    model, opt, sched = model_and_optimizer()
    ds = data()
    oomguard.budget.install(0)
    oomguard.budget.reset_peak()
    try:
        ogt.fit(model, opt, torch.nn.functional.mse_loss, ds, global_batch=batch, steps=2, scheduler=sched,
                clip_grad_norm=1.0)
        return oomguard.budget.peak()
    finally:
        oomguard.budget.uninstall()
        gc.collect()  # what that run left in reference cycles would count against a later budget


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", choices=["fit", "plain"], default="fit")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--budget-bytes", type=int, default=0)
    a = p.parse_args(argv)
    if a.mode == "plain":
        params = plain(a.steps)
        summary = {}
    else:
        model, opt, sched = model_and_optimizer()
        ds = data()
        if a.budget_bytes:
            oomguard.budget.install(a.budget_bytes)
        result = ogt.fit(model, opt, torch.nn.functional.mse_loss, ds, global_batch=GLOBAL, steps=a.steps,
                         ckpt_dir=a.ckpt, ckpt_every=2, scheduler=sched, clip_grad_norm=1.0,
                         vote_deadline_ms=60000)
        if a.budget_bytes:
            oomguard.budget.uninstall()
        params = ogt.flat_parameters(model)
        summary = {"ooms": result.ooms, "steps": result.steps, "resumed_from": result.resumed_from,
                   "micro_batch": result.micro_batch, "losses": result.losses, "first_step": result.first_step,
                   "world": ogt.distributed.world_size(),
                   "checkpoint_step": result.checkpoint_step}
    if ogt.distributed.rank() == 0:
        params.numpy().astype("<f8").tofile(a.out)
    with open(f"{a.out}.{ogt.distributed.rank()}.json", "w") as f:
        json.dump(summary, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
