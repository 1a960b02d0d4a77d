#!/usr/bin/env python3
"""The real peers against oomguard, on one model, one data set and one memory
budget that makes the configured batch run out of memory.

    PYTHONPATH=build/python scripts/python bench/peers/peers.py [--steps N] [--ranks 1,2] [--only S] [--json FILE]

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

Composer's ``device_train_microbatch_size="auto"`` runs in its own
environment (composer_peer.py; run.sh makes it). The same systems run at two
ranks over gloo with only rank 1 under a budget (--ranks; a run that gives no
result within --rank-timeout is reported as a hang, with where each rank
was). The oracle: the largest micro-batch (or batch) that fits, probed with
the plain loop. See bench/peers/README.md.
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
# The processes of a two-rank run (--worker): each rank gets PER of every
# global batch of GLOBAL samples (WORLD_SIZE and RANK from the environment).
WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
PER = GLOBAL // WORLD


_DATA = []


def _now():
    """(wall, this process's CPU time): the CPU time moves less with the
    machine's load than the wall time (one thread: OMP_NUM_THREADS=1)."""
    return time.perf_counter(), time.process_time()


def _since(t0):
    t1 = _now()
    return t1[0] - t0[0], t1[1] - t0[1]


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


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
        t0 = _now()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[k * batch:(k + 1) * batch]), y[k * batch:(k + 1) * batch]).backward()
        opt.step()
        times.append(_since(t0))
    return model, times


def fits(budget: int, micro: int, step_samples: int, steps: int) -> bool:
    """Whether the plain loop runs ``steps`` steps (the systems' number) of ``step_samples`` samples
    under the budget with micro-batches of ``micro`` samples (gradient
    accumulation when ``micro < step_samples``). A fresh model, optimizer and
    simulated device per probe."""
    gc.collect()
    model, opt = model_and_optimizer()
    x, y = dataset().tensors
    oomguard.budget.install(budget, caching_device=True)
    try:
        for k in range(steps):
            opt.zero_grad(set_to_none=True)
            for start in range(0, step_samples, micro):
                stop = min(start + micro, step_samples)
                lo = k * step_samples
                (loss_fn(model(x[lo + start:lo + stop]), y[lo + start:lo + stop]) * ((stop - start) / step_samples)
                 ).backward()
            opt.step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, opt
        oomguard.budget.uninstall()


def oracle(budget: int, step_samples: int, accumulate: bool, steps: int) -> int:
    """The largest micro-batch that runs under the budget, probed from
    ``step_samples`` down: of the plain loop's step of ``step_samples`` by
    gradient accumulation (``accumulate``: what a system that keeps the batch
    can reach), or as the whole step (what a peer that shrinks the batch can
    reach); 0: none does."""
    for micro in range(step_samples, 0, -1):
        if fits(budget, micro, step_samples if accumulate else micro, steps):
            return micro
    return 0


def plain_accumulating(steps: int, micro: int):
    """The plain loop keeping the batch of GLOBAL by gradient accumulation in
    micro-batches of ``micro``: what exactness costs without oomguard."""
    model, opt = model_and_optimizer()
    x, y = dataset().tensors
    times = []
    for k in range(steps):
        t0 = _now()
        opt.zero_grad(set_to_none=True)
        for start in range(0, GLOBAL, micro):
            stop = min(start + micro, GLOBAL)
            lo = k * GLOBAL
            (loss_fn(model(x[lo + start:lo + stop]), y[lo + start:lo + stop]) * ((stop - start) / GLOBAL)).backward()
        opt.step()
        times.append(_since(t0))
    return model, times


# ---------------------------------------------------------------- the systems
# Each returns: ooms, samples_redone, final_batch, global_batch, params, step_times (of the final attempt).


def run_oomguard_train_step(steps: int) -> dict:
    model, opt = model_and_optimizer()
    x, y = dataset().tensors
    # the plain loop's order (batch k = block k; with two ranks, this rank's half of it)
    lo = [k * GLOBAL + RANK * PER for k in range(steps)]
    blocks = [(x[i:i + PER], y[i:i + PER]) for i in lo]
    if WORLD > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    train_step = ogt.TrainStep(model, opt, loss_fn)
    incidents = []
    step_times = []
    for k in range(steps):
        t0 = _now()
        train_step(*blocks[k])
        step_times.append(_since(t0))
        incidents.extend(train_step.last_report.incidents)
    stable_from = max([i.step for i in incidents], default=-1) + 1
    return {"ooms": len(incidents), "samples_redone": sum(i.micro_before for i in incidents if i.micro_before > 0),
            "final_batch": train_step.guard.micro_limit or PER, "global_batch": GLOBAL, "model": model,
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
            "final_batch": trainer.oomguard_step.guard.micro_limit or PER, "global_batch": GLOBAL,
            "model": model, "step_times": times.times[stable_from:]}


def run_oomguard_lightning(steps: int) -> dict:
    import lightning.pytorch as pl

    from oomguard.integrations.lightning import OomguardCallback

    module, times = _lightning_module(), _LightningTimes()
    cb = OomguardCallback()
    trainer = _lightning_trainer(steps, [cb, times], guarded=True)
    trainer.fit(module, _lightning_loader(PER))
    stable_from = max([i.step for i in cb.incidents], default=-1) + 1
    return {"ooms": len(cb.incidents), "samples_redone": sum(i.micro_before for i in cb.incidents
                                                             if i.micro_before > 0),
            "final_batch": cb.train_step.guard.micro_limit or PER, "global_batch": GLOBAL, "model": module.gpt,
            "step_times": times.times[stable_from:]}


def run_accelerate_find_executable_batch_size(steps: int) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    attempts = []

    @find_executable_batch_size(starting_batch_size=PER)
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
            t0 = _now()
            opt.zero_grad()
            accelerator.backward(loss_fn(model(x), y))
            opt.step()
            attempt["samples"] += batch_size
            attempt["times"].append(_since(t0))
        return accelerator.unwrap_model(model)

    model = train()
    failed = attempts[:-1]
    return {"ooms": len(failed), "samples_redone": sum(a["samples"] + a["batch"] for a in failed),
            "final_batch": attempts[-1]["batch"], "global_batch": attempts[-1]["batch"] * WORLD, "model": model,
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
            "final_batch": final, "global_batch": final * WORLD, "model": model,
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
        found = Tuner(trainer).scale_batch_size(module, mode="binsearch", init_val=PER, max_trials=6)
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
            "final_batch": found, "global_batch": found * WORLD, "model": module.gpt,
            "step_times": times.times[trials:]}


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
        output_dir=out_dir, per_device_train_batch_size=PER, max_steps=steps, learning_rate=3e-3,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch",
        logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, **(dict(ddp_backend="gloo") if WORLD > 1 else {}), **extra)


def _sequential_sampler(trainer, *args, **kwargs):
    return torch.utils.data.SequentialSampler(trainer.train_dataset)


def _hf_times_class():
    import transformers

    class Times(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.times, self._t0 = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = _now()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(_since(self._t0))

    return Times


def _HFTimes():
    return _hf_times_class()()


def _lightning_module():
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt, _ = model_and_optimizer()
            self.batch_size = PER

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


def _lightning_trainer(steps: int, callbacks: list, guarded: bool = False):
    import lightning.pytorch as pl

    from oomguard.integrations.lightning import GuardedDDPStrategy

    if not _ROOT:
        _ROOT.append(tempfile.TemporaryDirectory(prefix="peers-lightning-"))  # the Tuner's checkpoints go here
    strategy = (GuardedDDPStrategy if guarded else pl.strategies.DDPStrategy)(process_group_backend="gloo") \
        if WORLD > 1 else "auto"
    return pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
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
                self._t0 = _now()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.times.append(_since(self._t0))

        return Times()


def run_lightning_ddp_unconstrained(steps: int) -> dict:
    """Lightning's own DDP, no budget, no guard: the two-rank reference of the Lightning rows."""
    module, times = _lightning_module(), _LightningTimes()
    trainer = _lightning_trainer(steps, [times])
    trainer.fit(module, _lightning_loader(PER))
    return {"ooms": 0, "samples_redone": 0, "final_batch": PER, "global_batch": GLOBAL, "model": module.gpt,
            "step_times": times.times}


# two-rank runs without a budget on either rank, against which a trainer's rows are compared too
REFERENCES = {"Lightning": ("Lightning DDP, unconstrained", run_lightning_ddp_unconstrained)}

SYSTEMS = {
    "oomguard TrainStep": run_oomguard_train_step,
    "oomguard HF Trainer": run_oomguard_hf,
    "oomguard Lightning": run_oomguard_lightning,
    "Accelerate find_executable_batch_size": run_accelerate_find_executable_batch_size,
    "HF Trainer auto_find_batch_size": run_hf_auto_find_batch_size,
    "Lightning BatchSizeFinder": run_lightning_batch_size_finder,
}


def _quiet() -> None:
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    # The HF Trainer shuffles; the peers compare against one data order: the plain loop's.
    transformers.Trainer._get_train_sampler = _sequential_sampler


def _run_system(fn, steps: int, budget: int):
    """(result, error): ``fn(steps)`` under the budget (0: none)."""
    gc.collect()
    if budget:
        oomguard.budget.install(budget, caching_device=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the trainers print their logs
            return fn(steps), None
    except Exception as e:  # a peer that fails is a row too
        import traceback

        where = " < ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in
                           reversed(traceback.extract_tb(e.__traceback__)[-4:]))
        return None, f"{type(e).__name__}: {str(e)[:90]} (in {where})"
    finally:
        if budget:
            oomguard.budget.uninstall()


def measure_peak(steps: int, batch: int):
    """The plain loop's parameters, step times and peak bytes at ``batch`` samples per step."""
    gc.collect()
    gc.disable()
    oomguard.budget.install(0)
    oomguard.budget.reset_peak()
    model, times = plain(steps, batch)
    peak = oomguard.budget.peak()
    oomguard.budget.uninstall()
    gc.enable()
    gc.collect()
    return model, times, peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--budget-frac", type=float, default=0.6, help="the budget, a fraction of the plain run's peak")
    p.add_argument("--only", default="", help="comma-separated systems (default: all)")
    p.add_argument("--ranks", default="1,2", help="the tables to make: 1 (one process), 2 (two ranks), or 1,2")
    p.add_argument("--rank-timeout", type=float, default=240.0,
                   help="seconds a two-rank run may take before it counts as a hang and is killed")
    p.add_argument("--json", default="", help="also write the results as JSON to this file")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # one rank of a two-rank run
    p.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    _quiet()
    dataset()
    only = [s for s in a.only.split(",") if s]
    selected = {name: fn for name, fn in SYSTEMS.items() if not only or any(o.lower() in name.lower() for o in only)}
    reference, plain_times, peak = measure_peak(a.steps, GLOBAL)
    ref = flat(reference)
    results = {"steps": a.steps, "global_batch": GLOBAL}
    tables = []
    if "1" in a.ranks.split(","):
        results["one_rank"] = one_rank(a, selected, ref, plain_times, peak)
        tables.append(table(results["one_rank"]))
    if "2" in a.ranks.split(","):
        results["two_ranks"] = two_ranks(a, selected, ref)
        tables.append(table_ranks(results["two_ranks"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\n\n".join(tables))
    return 0


def one_rank(a, selected: dict, ref: torch.Tensor, plain_times: list, peak: int) -> dict:
    budget = int(peak * a.budget_frac)
    oracles = {"accumulate": oracle(budget, GLOBAL, True, a.steps), "batch": oracle(budget, GLOBAL, False, a.steps)}
    rows = [dict({"system": "unconstrained (plain loop)", "ooms": 0, "samples_redone": 0, "final_batch": GLOBAL,
                  "oracle": GLOBAL, "global_batch_kept": True, "max_rel_diff": 0.0}, **_timing(plain_times, GLOBAL))]
    # What keeping the batch costs without oomguard: the plain loop accumulating the largest
    # micro-batch that runs the whole run, from the oracle down (at the oracle's edge whether a
    # size fits can depend on the allocation order: a probe and a run may disagree).
    for micro in range(oracles["accumulate"], 0, -1):
        r, error = _run_system(lambda steps, micro=micro: plain_accumulating(steps, micro), a.steps, budget)
        if r is None:
            continue
        params = flat(r[0])
        rows.append(dict({"system": f"plain loop, accumulating micro-batches of {micro} (not a peer: what keeping "
                                    f"the batch costs; the largest from the oracle down that ran)",
                          "ooms": 0, "samples_redone": 0, "final_batch": micro, "oracle": oracles["accumulate"],
                          "global_batch_kept": True,
                          "max_rel_diff": float((params - ref).abs().max() / ref.abs().max())},
                         **_timing(r[1], GLOBAL)))
        break
    systems = dict(selected)
    if not a.only or "composer" in a.only.lower():
        systems["Composer device_train_microbatch_size=auto"] = None
    for name, fn in systems.items():
        if fn is None:
            r, error = composer(a.steps, budget)
        else:
            r, error = _run_system(fn, a.steps, budget)
        if r is None:
            rows.append({"system": name, "error": error})
            continue
        params = flat(r["model"]) if "model" in r else torch.tensor(r["params"], dtype=torch.float64)
        rows.append(dict({"system": name, "ooms": r["ooms"], "samples_redone": r["samples_redone"],
                          "final_batch": r["final_batch"],
                          "oracle": oracles["accumulate" if r["global_batch"] == GLOBAL else "batch"],
                          "global_batch_kept": r["global_batch"] == GLOBAL,
                          "max_rel_diff": float((params - ref).abs().max() / ref.abs().max())},
                         **_timing(r["step_times"], r["global_batch"])))
    return {"steps": a.steps, "global_batch": GLOBAL, "peak_bytes": peak, "budget_bytes": budget,
            "oracle_micro_batch": oracles["accumulate"], "oracle_batch": oracles["batch"], "rows": rows}


# ---------------------------------------------------------------- Composer (its own environment)


def composer(steps: int, budget: int, ranks: int = 1, budget_ranks: str = "all", timeout: float = 0):
    """(result, error) of bench/peers/composer_peer.py in Composer's
    environment (PEERS_COMPOSER_PYTHON, PEERS_COMPOSER_PYTHONPATH: run.sh
    makes them); ranks > 1: that many processes over gloo."""
    python, path = os.environ.get("PEERS_COMPOSER_PYTHON"), os.environ.get("PEERS_COMPOSER_PYTHONPATH")
    if not python:
        return None, "not run: no Composer environment (bench/peers/run.sh makes it; PEERS_COMPOSER_PYTHON)"
    with tempfile.TemporaryDirectory() as d:
        args = lambda rank: [python, os.path.join(HERE, "composer_peer.py"), "--steps", str(steps), "--budget",
                             str(budget), "--budget-ranks", budget_ranks, "--out", os.path.join(d, f"r{rank}.json")]
        done = _spawn(args, ranks, timeout or 600, {"PYTHONPATH": path})
        if "hang" in done:
            return None, done["hang"]
        outs = []
        for rank in range(ranks):
            try:
                with open(os.path.join(d, f"r{rank}.json")) as f:
                    outs.append(json.load(f))
            except OSError:
                return None, f"crashed (rank {rank} wrote no result): {_last_words(done['logs'])}"
    if ranks > 1:
        return outs, None
    if "error" in outs[0]:
        return None, outs[0]["error"]
    return outs[0], None


# ---------------------------------------------------------------- two ranks


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(argv_of_rank, ranks: int, timeout: float, env_extra: dict) -> dict:
    """Starts ``ranks`` processes (torchrun's environment variables) and waits
    ``timeout`` seconds for all; after it, both are killed: {"hang": what
    each rank was doing (the stacks faulthandler dumped before the
    deadline)}. Else {"logs": each rank's output}."""
    import subprocess

    port = _free_port()
    procs, logs = [], []
    for rank in range(ranks):
        env = dict(os.environ, WORLD_SIZE=str(ranks), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks),
                   NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PEERS_DUMP_STACKS_AT=str(time.time() + max(5.0, timeout - 15)), **env_extra)
        if ranks == 1:
            for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(k)
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen(argv_of_rank(rank), env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    hung = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        time.sleep(2)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    if hung:
        return {"hang": f"hang: no result in {timeout:.0f} s, killed; " + "; ".join(
            f"rank {r} {_stuck_in(t)}" for r, t in enumerate(texts))}
    return {"logs": texts}


def _last_words(logs: list) -> str:
    """Each rank's last line of output (what a crashed run said)."""
    said = []
    for rank, text in enumerate(logs):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        said.append(f"rank {rank}: {' '.join(lines[-2:])[-160:] if lines else '(no output)'}")
    return "; ".join(said)


def _stuck_in(text: str) -> str:
    """Where faulthandler's dump (the main thread's innermost frames) says a rank was."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Thread ") and "most recent call first" in ln
              or ln.startswith("Current thread")]
    if not starts:
        last = [ln for ln in lines if ln.strip()][-1:] or ["(no output)"]
        return f"gave no stack (last output: {last[0][:120]})"
    frames = []
    for ln in lines[starts[-1] + 1:]:
        ln = ln.strip()
        if not ln.startswith("File "):
            break
        parts = ln.split('"')
        frames.append((parts[1] if len(parts) > 1 else "?", ln.rsplit(" in ", 1)[-1]))
    if not frames:
        return "gave no stack"
    # the innermost frame (torch's), and the innermost of the trainer's own code that led there
    owners = ("site-packages/accelerate/", "site-packages/transformers/", "site-packages/lightning/",
              "site-packages/composer/", "python/oomguard/", "bench/peers/")
    outer = next((f for f in frames[1:] if any(o in f[0] for o in owners)), None)
    said = [frames[0]] + ([outer] if outer else [])
    return "in " + " < ".join(f"{os.path.basename(path)}:{name}" for path, name in said)


def worker(a) -> int:
    """One rank of a two-rank run of system ``a.worker``: writes its result to ``a.out``."""
    import faulthandler

    # the stacks, for the parent to say where a hung rank was: before its deadline
    at = float(os.environ.get("PEERS_DUMP_STACKS_AT", "0"))
    if at:
        faulthandler.dump_traceback_later(max(1.0, at - time.time()), exit=False)
    _quiet()
    dataset()
    fn = SYSTEMS.get(a.worker) or dict(REFERENCES.values())[a.worker]
    r, error = _run_system(fn, a.steps, a.budget if RANK == 1 else 0)  # only rank 1 is short of memory
    out = {"error": error} if r is None else {
        "ooms": r["ooms"], "samples_redone": r["samples_redone"], "final_batch": r["final_batch"],
        "global_batch": r["global_batch"], "params": flat(r["model"]).tolist()}
    with open(a.out, "w") as f:
        json.dump(out, f)
    faulthandler.cancel_dump_traceback_later()
    return 0


def two_ranks(a, selected: dict, ref: torch.Tensor) -> dict:
    """Every system at two ranks over gloo, each rank PER samples of each
    global batch; only rank 1 has a budget (the fraction of the plain loop's
    peak at PER samples per step), so only rank 1 runs out of memory."""
    per = GLOBAL // 2
    _, _, peak = measure_peak(a.steps, per)
    budget = int(peak * a.budget_frac)
    oracles = {"accumulate": oracle(budget, per, True, a.steps), "batch": oracle(budget, per, False, a.steps)}
    rows = []
    systems = dict(selected)
    if not a.only or "composer" in a.only.lower():
        systems["Composer device_train_microbatch_size=auto"] = None
    own = {}  # trainer -> its unconstrained two-rank parameters
    for trainer, (name, fn) in REFERENCES.items():
        if any(trainer in n for n in systems):
            systems = {name: fn, **systems}
    for name in systems:
        reference_of = next((t for t, (n, _) in REFERENCES.items() if n == name), None)
        if systems[name] is None:
            outs, error = composer(a.steps, budget, ranks=2, budget_ranks="1", timeout=a.rank_timeout)
        else:
            with tempfile.TemporaryDirectory() as d:
                argv = lambda rank: [sys.executable, os.path.abspath(__file__), "--worker", name, "--steps",
                                     str(a.steps), "--budget", str(0 if reference_of else budget),
                                     "--out", os.path.join(d, f"r{rank}.json")]
                done = _spawn(argv, 2, a.rank_timeout, {})
                error, outs = done.get("hang"), []
                if error is None:
                    for rank in range(2):
                        try:
                            with open(os.path.join(d, f"r{rank}.json")) as f:
                                outs.append(json.load(f))
                        except OSError:
                            error = f"crashed (rank {rank} wrote no result): {_last_words(done['logs'])}"
                            break
        row = {"system": name}
        if error is not None:
            row["outcome"] = error
            rows.append(row)
            continue
        errors = [f"rank {r}: {o['error']}" for r, o in enumerate(outs) if "error" in o]
        if errors:
            row["outcome"] = "failed: " + "; ".join(errors)
            rows.append(row)
            continue
        params = [torch.tensor(o["params"], dtype=torch.float64) for o in outs]
        kept = all(o["global_batch"] == GLOBAL for o in outs)
        row.update(outcome="finished", ooms=[o["ooms"] for o in outs], samples_redone=[o["samples_redone"] for o in outs],
                   final_batch=[o["final_batch"] for o in outs],
                   oracle=oracles["accumulate" if kept else "batch"],
                   global_batch=[o["global_batch"] for o in outs], global_batch_kept=kept,
                   ranks_agree=bool(torch.equal(params[0], params[1])),
                   max_rel_diff=max(float((q - ref).abs().max() / ref.abs().max()) for q in params))
        if reference_of:
            own[reference_of] = params[0]
            row["outcome"] = "finished (no budget on either rank)"
        for trainer, theirs in own.items():
            if trainer in name and not reference_of:
                row["rel_diff_own"] = (trainer, max(float((q - theirs).abs().max() / theirs.abs().max())
                                                    for q in params))
        rows.append(row)
    return {"steps": a.steps, "global_batch": GLOBAL, "per_rank": per, "peak_bytes": peak, "budget_bytes": budget,
            "oracle_micro_batch": oracles["accumulate"], "oracle_batch": oracles["batch"], "rows": rows}


def table_ranks(out: dict) -> str:
    lines = [f"Two ranks (gloo), {out['per_rank']} samples per rank of each global batch of {out['global_batch']}, "
             f"{out['steps']} steps; only rank 1 has a budget: {out['budget_bytes']} bytes "
             f"({out['budget_bytes'] / out['peak_bytes']:.0%} of the plain loop's peak at {out['per_rank']} samples). "
             f"Oracle on rank 1: micro-batch {out['oracle_micro_batch']} (accumulating {out['per_rank']}), "
             f"batch {out['oracle_batch']}.",
             "",
             "| system | outcome | OOMs (rank 0, 1) | samples redone (rank 0, 1) | final (micro-)batch (rank 0, 1) / "
             "oracle | global batch | ranks' params equal | max rel diff of params |",
             "|---|---|---:|---:|---:|---|---|---:|"]
    for r in out["rows"]:
        if not r.get("outcome", "").startswith("finished"):
            lines.append(f"| {r['system']} | {r['outcome']} | – | – | – | – | – | – |")
            continue
        gb = r["global_batch"]
        own = f" ({r['rel_diff_own'][1]:.1e} from {r['rel_diff_own'][0]}'s own unconstrained 2-rank run)" \
            if "rel_diff_own" in r else ""
        lines.append(f"| {r['system']} | {r['outcome']} | {r['ooms'][0]}, {r['ooms'][1]} | "
                     f"{r['samples_redone'][0]}, {r['samples_redone'][1]} | "
                     f"{r['final_batch'][0]}, {r['final_batch'][1]} / {r['oracle']} | "
                     f"{gb[0] if gb[0] == gb[1] else f'{gb[0]} / {gb[1]}'}"
                     f"{' (kept)' if r['global_batch_kept'] else ''} | {'yes' if r['ranks_agree'] else 'no'} | "
                     f"{r['max_rel_diff']:.1e}{own} |")
    return "\n".join(lines)


def _timing(step_times: list, samples: int) -> dict:
    """Medians over the steps once stable: wall ms per step and per sample, CPU ms per sample."""
    if not step_times:
        return {"ms_per_step_stable": None, "ms_per_sample_stable": None, "cpu_ms_per_sample_stable": None}
    wall, cpu = _median([t[0] for t in step_times]), _median([t[1] for t in step_times])
    return {"ms_per_step_stable": round(1000 * wall, 2), "ms_per_sample_stable": round(1000 * wall / samples, 3),
            "cpu_ms_per_sample_stable": round(1000 * cpu / samples, 3)}


def table(out: dict) -> str:
    lines = [f"{out['steps']} steps, global batch {out['global_batch']}, budget {out['budget_bytes']} bytes "
             f"({out['budget_bytes'] / out['peak_bytes']:.0%} of the unconstrained peak, simulated caching device); "
             f"oracle: the largest micro-batch of the plain loop's step of {out['global_batch']} (gradient "
             f"accumulation) that fits: {out['oracle_micro_batch']}, the largest batch of a step that fits: "
             f"{out['oracle_batch']}",
             "",
             "| system | OOMs | samples redone | final (micro-)batch / oracle | global batch kept "
             "| max rel diff of params | ms/step once stable | ms/sample once stable | CPU ms/sample once stable |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in out["rows"]:
        if "error" in r:
            lines.append(f"| {r['system']} | – | – | – | – | failed: {r['error']} | – | – | – |")
            continue
        lines.append(f"| {r['system']} | {r['ooms']} | {r['samples_redone']} | {r['final_batch']} / {r['oracle']} | "
                     f"{'yes' if r['global_batch_kept'] else 'no'} | {r['max_rel_diff']:.1e} | "
                     f"{r['ms_per_step_stable']} | {r['ms_per_sample_stable']} | {r['cpu_ms_per_sample_stable']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
