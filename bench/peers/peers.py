#!/usr/bin/env python3
"""The real peers against oomguard, on one model, one data set and one memory
budget that makes the configured batch run out of memory.

    PYTHONPATH=build/python scripts/python bench/peers/peers.py [--steps N] [--json]

Every system trains the same float64 TinyGPT (examples/python/train_gpt.py:
2 layers, width 32, a vocabulary of 64, 32 tokens) with AdamW (constant LR, no
weight decay: the HF Trainer would exempt biases and norms from it) on the same
sequences, configured for a global batch of 32, under oomguard.budget's
simulated caching device (a CPU byte budget worded and behaving as a GPU
allocator's, whose OOM message every peer recognises) at a fraction of the
unconstrained run's peak. Per system: OOMs until stable, samples computed and
thrown away (redone), the final (micro-)batch, whether the global batch
stayed 32, the max relative difference of the final parameters from the
unconstrained run (same data order), and the wall time per step once stable
(after the last OOM). The peers are the libraries themselves
(transformers, lightning, accelerate from requirements.txt), not
re-implementations of their rules.

Composer is not measured: it pins an older torch than this environment's
2.11 (its own environment would need a second torch wheel, 3 GB); see
bench/peers/README.md.
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
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "python"))

import oomguard  # noqa: E402
import oomguard.budget  # noqa: E402
import oomguard.torch as ogt  # noqa: E402
from train_gpt import TinyGPT  # noqa: E402

VOCAB, CONTEXT, WIDTH, GLOBAL, N = 64, 32, 32, 32, 512


_DATA = []


def dataset() -> torch.utils.data.TensorDataset:
    """The sequences, made once (before any budget is installed: the data are
    not what the budget is about) and shared by every system."""
    if not _DATA:
        _DATA.append(_make_dataset())
    return _DATA[0]


def _make_dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    seq = torch.empty(N, CONTEXT + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (N,), generator=g)
    for t in range(1, CONTEXT + 1):
        seq[:, t] = (3 * seq[:, t - 1] + 1) % VOCAB
    noise = torch.rand(N, CONTEXT + 1, generator=g) < 0.1
    seq[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
    return torch.utils.data.TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def model_and_optimizer():
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, WIDTH, 2, 2, CONTEXT).double()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def plain(steps: int, batch: int = GLOBAL):
    """The unconstrained loop: batch k is samples [k*batch, (k+1)*batch)."""
    model, opt = model_and_optimizer()
    x, y = dataset().tensors
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[k * batch:(k + 1) * batch]), y[k * batch:(k + 1) * batch]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return model, times


# ---------------------------------------------------------------- the systems
# Each returns: ooms, samples_redone, final_batch, global_batch, params, step_times (of the final attempt).


def run_oomguard_train_step(steps: int) -> dict:
    model, opt = model_and_optimizer()
    x, y = dataset().tensors
    # the plain loop's order (batch k = block k)
    blocks = [(x[k * GLOBAL:(k + 1) * GLOBAL], y[k * GLOBAL:(k + 1) * GLOBAL]) for k in range(steps)]
    train_step = ogt.TrainStep(model, opt, loss_fn)
    incidents = []
    step_times = []
    for k in range(steps):
        t0 = time.perf_counter()
        train_step(*blocks[k])
        step_times.append(time.perf_counter() - t0)
        incidents.extend(train_step.last_report.incidents)
    stable_from = max([i.step for i in incidents], default=-1) + 1
    return {"ooms": len(incidents), "samples_redone": sum(i.micro_before for i in incidents if i.micro_before > 0),
            "final_batch": train_step.guard.micro_limit or GLOBAL, "global_batch": GLOBAL, "model": model,
            "step_times": step_times[stable_from:]}


def run_oomguard_hf(steps: int) -> dict:
    import transformers

    from oomguard.integrations.hf import OomguardTrainer

    model, _ = model_and_optimizer()
    wrapped = _HFWrapper(model)
    times = _HFTimes()
    with tempfile.TemporaryDirectory() as d:
        trainer = OomguardTrainer(model=wrapped, args=_hf_args(d, steps), train_dataset=_DictSet(),
                                  callbacks=[times])
        trainer.train()
    incidents = trainer.oomguard_incidents
    stable_from = max([i.step for i in incidents], default=-1) + 1
    return {"ooms": len(incidents), "samples_redone": sum(i.micro_before for i in incidents if i.micro_before > 0),
            "final_batch": trainer.oomguard_step.guard.micro_limit or GLOBAL, "global_batch": GLOBAL,
            "model": model, "step_times": times.times[stable_from:]}


def run_oomguard_lightning(steps: int) -> dict:
    import lightning.pytorch as pl

    from oomguard.integrations.lightning import OomguardCallback

    module, times = _lightning_module(), _LightningTimes()
    cb = OomguardCallback()
    trainer = _lightning_trainer(steps, [cb, times])
    trainer.fit(module, _lightning_loader(GLOBAL))
    stable_from = max([i.step for i in cb.incidents], default=-1) + 1
    return {"ooms": len(cb.incidents), "samples_redone": sum(i.micro_before for i in cb.incidents
                                                             if i.micro_before > 0),
            "final_batch": cb.train_step.guard.micro_limit or GLOBAL, "global_batch": GLOBAL, "model": module.gpt,
            "step_times": times.times[stable_from:]}


def run_accelerate_find_executable_batch_size(steps: int) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    attempts = []

    @find_executable_batch_size(starting_batch_size=GLOBAL)
    def train(batch_size):
        attempt = {"batch": batch_size, "samples": 0, "times": []}
        attempts.append(attempt)
        accelerator = Accelerator(cpu=True)
        model, opt = model_and_optimizer()
        loader = torch.utils.data.DataLoader(dataset(), batch_size=batch_size, shuffle=False)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        for k, (x, y) in enumerate(loader):
            if k == steps:
                break
            t0 = time.perf_counter()
            opt.zero_grad()
            accelerator.backward(loss_fn(model(x), y))
            opt.step()
            attempt["samples"] += batch_size
            attempt["times"].append(time.perf_counter() - t0)
        return accelerator.unwrap_model(model)

    model = train()
    failed = attempts[:-1]
    return {"ooms": len(failed), "samples_redone": sum(a["samples"] + a["batch"] for a in failed),
            "final_batch": attempts[-1]["batch"], "global_batch": attempts[-1]["batch"], "model": model,
            "step_times": attempts[-1]["times"]}


def run_hf_auto_find_batch_size(steps: int) -> dict:
    model_holder = []
    times = _HFTimes()
    attempts = []

    import transformers

    class Counting(transformers.Trainer):
        def _inner_training_loop(self, batch_size=None, *args, **kwargs):
            attempts.append({"batch": batch_size, "steps": len(times.times)})
            return super()._inner_training_loop(batch_size, *args, **kwargs)

    model, _ = model_and_optimizer()
    with tempfile.TemporaryDirectory() as d:
        args = _hf_args(d, steps, auto_find_batch_size=True)
        trainer = Counting(model=_HFWrapper(model), args=args, train_dataset=_DictSet(), callbacks=[times])
        trainer.train()
    failed = attempts[:-1]
    done = [attempts[i + 1]["steps"] - attempts[i]["steps"] for i in range(len(failed))]
    final = attempts[-1]["batch"]
    return {"ooms": len(failed), "samples_redone": sum((n + 1) * a["batch"] for n, a in zip(done, failed)),
            "final_batch": final, "global_batch": final, "model": model,
            "step_times": times.times[attempts[-1]["steps"]:]}


def run_lightning_batch_size_finder(steps: int) -> dict:
    import lightning.pytorch.tuner.batch_size_scaling as bss
    from lightning.pytorch.tuner import Tuner
    from lightning.pytorch.utilities.parsing import lightning_getattr

    module, times = _lightning_module(), _LightningTimes()
    trainer = _lightning_trainer(steps, [times])
    failed = []
    adjust, is_oom = bss._adjust_batch_size, bss.is_oom_error

    def counting(trainer, batch_arg_name="batch_size", *args, **kwargs):
        if kwargs.get("desc") == "failed":
            failed.append(lightning_getattr(trainer.lightning_module, batch_arg_name))
        return adjust(trainer, batch_arg_name, *args, **kwargs)

    # Lightning recognises an OOM by "CUDA" and "out of memory" in its message; the simulated
    # device's says "Budget device out of memory": widened to the type a CUDA OOM has.
    bss._adjust_batch_size = counting
    bss.is_oom_error = lambda e: isinstance(e, torch.OutOfMemoryError) or is_oom(e)
    try:
        # binsearch from the configured batch: down on every OOM, then up between the bounds
        found = Tuner(trainer).scale_batch_size(module, mode="binsearch", init_val=GLOBAL, max_trials=6)
    finally:
        bss._adjust_batch_size, bss.is_oom_error = adjust, is_oom
    trials = len(times.times)
    trainer = _lightning_trainer(steps, [times])
    try:
        trainer.fit(module)
    except torch.OutOfMemoryError as e:
        raise RuntimeError(f"OOM in training with the batch of {found} the search found "
                           f"({len(failed)} OOMs in the search): {str(e)[:60]}") from None
    return {"ooms": len(failed), "samples_redone": sum(failed),
            "final_batch": found, "global_batch": found, "model": module.gpt, "step_times": times.times[trials:]}


# ---------------------------------------------------------------- trainer glue


class _HFWrapper(torch.nn.Module):
    """TinyGPT with the Trainer's calling convention (input_ids, labels -> loss)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels):
        return {"loss": loss_fn(self.gpt(input_ids), labels)}


class _DictSet(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = dataset().tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def _hf_args(out_dir: str, steps: int, **extra):
    import transformers

    return transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=GLOBAL, max_steps=steps, learning_rate=3e-3,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch",
        logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, **extra)


def _sequential_sampler(trainer, *args, **kwargs):
    return torch.utils.data.SequentialSampler(trainer.train_dataset)


def _hf_times_class():
    import transformers

    class Times(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.times, self._t0 = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

    return Times


def _HFTimes():
    return _hf_times_class()()


def _lightning_module():
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt, _ = model_and_optimizer()
            self.batch_size = GLOBAL

        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_fn(self.gpt(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)

        def train_dataloader(self):
            return _lightning_loader(self.batch_size)

    return Module()


def _lightning_loader(batch: int):
    return torch.utils.data.DataLoader(dataset(), batch_size=batch, shuffle=False)


def _lightning_trainer(steps: int, callbacks: list):
    import lightning.pytorch as pl

    if not _ROOT:
        _ROOT.append(tempfile.TemporaryDirectory(prefix="peers-lightning-"))  # the Tuner's checkpoints go here
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                      default_root_dir=_ROOT[0].name)


_ROOT: list = []


class _LightningTimes:
    def __new__(cls):
        import lightning.pytorch as pl

        class Times(pl.Callback):
            def __init__(self) -> None:
                self.times, self._t0 = [], None

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self._t0 = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.times.append(time.perf_counter() - self._t0)

        return Times()


SYSTEMS = {
    "oomguard TrainStep": run_oomguard_train_step,
    "oomguard HF Trainer": run_oomguard_hf,
    "oomguard Lightning": run_oomguard_lightning,
    "Accelerate find_executable_batch_size": run_accelerate_find_executable_batch_size,
    "HF Trainer auto_find_batch_size": run_hf_auto_find_batch_size,
    "Lightning BatchSizeFinder": run_lightning_batch_size_finder,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--budget-frac", type=float, default=0.6, help="the budget, a fraction of the plain run's peak")
    p.add_argument("--only", default="", help="comma-separated systems (default: all)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    # The HF Trainer shuffles; the peers compare against one data order: the plain loop's.
    transformers.Trainer._get_train_sampler = _sequential_sampler

    dataset()
    gc.collect()
    gc.disable()
    oomguard.budget.install(0)
    oomguard.budget.reset_peak()
    reference, plain_times = plain(a.steps)
    peak = oomguard.budget.peak()
    oomguard.budget.uninstall()
    gc.enable()
    gc.collect()
    budget = int(peak * a.budget_frac)
    ref = flat(reference)
    rows = [{"system": "unconstrained (plain loop)", "ooms": 0, "samples_redone": 0, "final_batch": GLOBAL,
             "global_batch_kept": True, "max_rel_diff": 0.0,
             "ms_per_step_stable": round(1000 * sorted(plain_times)[len(plain_times) // 2], 2),
             "ms_per_sample_stable": round(1000 * sorted(plain_times)[len(plain_times) // 2] / GLOBAL, 3)}]
    only = [s for s in a.only.split(",") if s]
    for name, fn in SYSTEMS.items():
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        gc.collect()
        oomguard.budget.install(budget, caching_device=True)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the trainers print their logs
                r = fn(a.steps)
            error = None
        except Exception as e:  # a peer that fails is a row too
            import traceback

            where = " < ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in
                               reversed(traceback.extract_tb(e.__traceback__)[-4:]))
            r, error = None, f"{type(e).__name__}: {str(e)[:90]} (in {where})"
        finally:
            oomguard.budget.uninstall()
        if r is None:
            rows.append({"system": name, "error": error})
            continue
        params = flat(r["model"])
        times = sorted(r["step_times"])
        rows.append({"system": name, "ooms": r["ooms"], "samples_redone": r["samples_redone"],
                     "final_batch": r["final_batch"], "global_batch_kept": r["global_batch"] == GLOBAL,
                     "max_rel_diff": float((params - ref).abs().max() / ref.abs().max()),
                     "ms_per_step_stable": round(1000 * times[len(times) // 2], 2) if times else None,
                     "ms_per_sample_stable": round(1000 * times[len(times) // 2] / r["global_batch"], 3)
                     if times else None})
    out = {"steps": a.steps, "global_batch": GLOBAL, "peak_bytes": peak, "budget_bytes": budget, "rows": rows}
    if a.json:
        print(json.dumps(out))
    else:
        print(table(out))
    return 0


def table(out: dict) -> str:
    lines = [f"{out['steps']} steps, global batch {out['global_batch']}, budget {out['budget_bytes']} bytes "
             f"({out['budget_bytes'] / out['peak_bytes']:.0%} of the unconstrained peak, simulated caching device)",
             "",
             "| system | OOMs | samples redone | final (micro-)batch | global batch kept | max rel diff of params "
             "| ms/step once stable | ms/sample once stable |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in out["rows"]:
        if "error" in r:
            lines.append(f"| {r['system']} | – | – | – | – | failed: {r['error']} | – | – |")
            continue
        lines.append(f"| {r['system']} | {r['ooms']} | {r['samples_redone']} | {r['final_batch']} | "
                     f"{'yes' if r['global_batch_kept'] else 'no'} | {r['max_rel_diff']:.1e} | "
                     f"{r['ms_per_step_stable']} | {r['ms_per_sample_stable']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
