"""``fit``: one call for a PyTorch training loop that survives out-of-memory errors.

    import oomguard.torch as ogt
    result = ogt.fit(model, optimizer, torch.nn.functional.cross_entropy, dataset,
                     global_batch=256, steps=10_000, ckpt_dir="ckpt", scheduler=scheduler,
                     eval_data=val_set, eval_every=500)
    print(result.losses[-1], result.ooms, result.micro_batch)

The same script runs in one process and under torchrun: ``fit`` owns the
parts a guarded loop otherwise wires by hand (the Checkpointer and what it
holds, the coordinator and DDP when there are several ranks, the
step-indexed loader, resume, rollbacks, guarded evaluation, ``finish`` and
the exit code) and returns a summary. ``TrainStep`` stays for loops of your own.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .. import errors as _errors
from .._guard import Guard
from .._oomguard import Incident, KnowledgeBase
from ..checkpoint import Checkpointer
from . import distributed as _distributed
from . import fsdp as _fsdp
from ._model import DDP, ddp_of, model_device, unwrap
from .data import StepBatchSampler, StepLoader
from .device import TorchDevice
from .distributed import TorchDistributedCoordinator
from .state import register_state
from .step import TrainStep, _combine, batch_samples, evaluate

__all__ = ["fit", "FitResult"]


@dataclasses.dataclass
class FitResult:
    """What ``fit`` did.

    ``losses[i]`` is the global batch's mean loss of step ``first_step + i``
    (over every rank; the value the step that counted computed, also after a
    rollback replayed it). ``evals`` maps a step to the evaluation that ran
    after it. ``ooms`` and ``incidents`` cover this process's steps and
    evaluations; ``micro_batch`` is the micro-batch limit at the end (None:
    every step fitted whole)."""

    losses: List[float]
    first_step: int
    steps: int
    evals: Dict[int, Any]
    ooms: int
    incidents: List[Incident]
    micro_batch: Optional[int]
    rollbacks: int
    resumed_from: Optional[int]
    checkpoint_step: int
    skipped_steps: int
    wall_s: float


class _LoopState:
    """What the loop keeps beside the model: checkpointed with it, so that a
    rollback or a resume to step S brings back the losses up to S and says
    which steps' after-step work (evaluation, on_step) is still to do."""

    def __init__(self) -> None:
        self.losses: Dict[int, float] = {}
        self.evals: Dict[int, Any] = {}
        self.after_done = -1  # the last step whose after-step work ran

    def state_dict(self) -> dict:
        return {"losses": dict(self.losses), "evals": dict(self.evals), "after_done": self.after_done}

    def load_state_dict(self, state: dict) -> None:
        self.losses = dict(state["losses"])
        self.evals = dict(state["evals"])
        self.after_done = int(state["after_done"])


def _init_distributed_from_env(model: torch.nn.Module) -> None:
    """Under torchrun (WORLD_SIZE > 1 in the environment) with no process group
    yet: starts the default one (nccl for a CUDA model, else gloo)."""
    if not dist.is_available() or dist.is_initialized():
        return
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None
    if world <= 1:
        return
    device = model_device(model)
    backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)


def _loader(data: Any, global_batch: int, steps: int, *, seed: int, shuffle: bool, num_workers: int,
            collate_fn: Optional[Callable[..., Any]]) -> torch.utils.data.DataLoader:
    """A DataLoader whose batch k is the global batch of step k (this rank's share)."""
    DataLoader = torch.utils.data.DataLoader
    if isinstance(data, DataLoader):
        if isinstance(data.batch_sampler, StepBatchSampler):
            if data.batch_sampler.batch_size != global_batch:
                raise ValueError(f"fit(global_batch={global_batch}) but the loader's StepBatchSampler has "
                                 f"batch_size={data.batch_sampler.batch_size} (the global batch)")
            return data
        # Same dataset and collation; batches by step so that a rollback replays them.
        dataset, collate_fn = data.dataset, data.collate_fn
        num_workers = data.num_workers
        pin_memory = data.pin_memory
    else:
        dataset, pin_memory = data, False
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(f"fit needs a map-style dataset (indexable, with len()) so that a rollback or a resume "
                        f"replays the batches of its steps; got {type(dataset).__name__}. Use TrainStep in a loop "
                        "of your own for streams")
    sampler = StepBatchSampler(len(dataset), global_batch, shuffle=shuffle, seed=seed, steps=steps)
    kwargs: Dict[str, Any] = {"batch_sampler": sampler, "num_workers": num_workers, "pin_memory": pin_memory}
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    return DataLoader(dataset, **kwargs)


def _eval_loader(data: Any, batch_size: int, num_workers: int,
                 collate_fn: Optional[Callable[..., Any]]) -> torch.utils.data.DataLoader:
    if isinstance(data, torch.utils.data.DataLoader):
        return data
    kwargs: Dict[str, Any] = {"batch_size": batch_size, "shuffle": False, "num_workers": num_workers}
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    return torch.utils.data.DataLoader(data, **kwargs)


def _args(batch: Any) -> Sequence[Any]:
    """The positional arguments of a step for one collated batch: a tuple or
    list is (inputs, targets, ...); a dict or a tensor is one argument."""
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        return tuple(batch)
    return (batch,)


def _warn_split_dependent(model: torch.nn.Module) -> None:
    norms = [name for name, m in unwrap(model).named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        warnings.warn(f"fit: BatchNorm layers ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) compute "
                      "batch statistics per micro-batch, so once an OOM splits a step the result differs from "
                      "the unsplit run; GroupNorm or LayerNorm do not depend on the split", stacklevel=3)


def fit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Optional[Callable[..., torch.Tensor]] = None,
    data: Any = None,
    *,
    global_batch: int,
    steps: int,
    forward: Optional[Callable[..., torch.Tensor]] = None,
    ckpt_dir: Optional[Union[str, os.PathLike]] = None,
    ckpt_every: int = 100,
    keep: int = 3,
    resume: bool = True,
    loss_units: Optional[Callable[..., Any]] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[Any] = None,
    clip_grad_norm: Optional[float] = None,
    eval_data: Any = None,
    eval_every: int = 0,
    eval_forward: Optional[Callable[..., Any]] = None,
    eval_batch: Optional[int] = None,
    on_step: Optional[Callable[[int, float], Any]] = None,
    seed: int = 0,
    shuffle: bool = True,
    num_workers: int = 0,
    collate_fn: Optional[Callable[..., Any]] = None,
    knowledge_base: Optional[Union[str, os.PathLike, KnowledgeBase]] = None,
    workload: str = "",
    exit_on_lost_peer: bool = True,
    **guard_options: Any,
) -> FitResult:
    """Trains ``model`` for ``steps`` optimizer steps of ``global_batch`` samples,
    guarded against out-of-memory errors, and returns a ``FitResult``.

    The loss: ``loss_fn(model(inputs), targets)`` for batches of (inputs,
    targets), or ``forward(model, *batch)`` (e.g. ``forward=lambda m, b:
    m(**b).loss`` for dict batches) returning the micro-batch's mean loss.
    ``data`` is a map-style dataset, or a DataLoader whose dataset, collation
    and workers are kept while its batches are drawn by step
    (``StepBatchSampler``: batch k is a pure function of seed and k, each rank
    its share), so that rollbacks and resumes replay the right batches.
    ``global_batch`` is the batch over every rank; it never changes, however
    the guard splits it.

    With ``ckpt_dir``, a Checkpointer there holds the model, the optimizer,
    the scheduler, the scaler, the RNG state and the loop's own record,
    saved every ``ckpt_every`` steps, after a recovered OOM and at the end,
    ``keep`` of them kept; with ``resume`` (default) a run starts from the newest
    checkpoint every rank holds. Without ``ckpt_dir`` OOMs in the micro-batches
    are still survived, but one in the optimizer step (which may leave the
    parameters half-updated) ends the run: there is nothing to roll back to.

    Several ranks: under torchrun (or after init_process_group) the model is
    wrapped in DistributedDataParallel (buffers are not broadcast inside
    forward) unless it already is, the guard's collectives go over
    torch.distributed, and each rank loads its share. A rank whose peers
    stopped answering exits with ``oomguard.EXIT_COORDINATION_TIMEOUT`` (75)
    when ``exit_on_lost_peer``: restart every rank, they resume.

    After each step: every ``eval_every`` steps (and after the last) the model
    is evaluated on ``eval_data`` (in eval mode, under no_grad, guarded: an
    OOM splits the evaluation batch; each rank evaluates all of it) with
    ``eval_forward(model, *batch)`` (default: the loss), and ``on_step(step,
    loss)`` is called. That work is redone for the step a rollback or a
    resume returns to, so on_step may see a step twice: key what it records
    by step.

    ``knowledge_base``: a path or an open ``oomguard.KnowledgeBase`` that
    records every incident and gives the learned micro-batch for
    ``workload``. Other keywords go to ``oomguard.Guard``
    (``initial_micro_batch``, ``min_micro_batch``, ``max_micro_batch``,
    ``controller``, ...). Exactness: as ``TrainStep`` says (dropout masks and
    BatchNorm statistics depend on the split; fit warns about BatchNorm).
    """
    started = time.monotonic()
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"fit(global_batch=...) must be a positive int, got {global_batch!r}")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"fit(steps=...) must be an int >= 0, got {steps!r}")
    if data is None:
        raise ValueError("fit needs data: a map-style dataset or a DataLoader")
    if eval_every < 0 or (eval_every > 0 and eval_data is None):
        raise ValueError(f"fit(eval_every={eval_every}) needs eval_data and a value >= 0")
    if ckpt_every < 0:
        raise ValueError(f"fit(ckpt_every={ckpt_every}) must be >= 0 (0: no periodic checkpoints)")
    for name in ("guard", "coordinator", "recovery", "knowledge_base_path"):
        if name in guard_options:
            raise ValueError(f"fit makes its own {name}; use TrainStep for a loop with your own")

    _init_distributed_from_env(model)
    world = _distributed.world_size()
    sharded = _fsdp.is_fsdp(unwrap(model))
    if sharded:  # FSDP2: no DDP wrap; the guard shrinks the same way on every rank (docs/distributed.md)
        guard_options = {**_fsdp.GUARD_OPTIONS, **guard_options}
    if world > 1 and ddp_of(model) is None and not sharded:
        device = model_device(model)
        ids = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device is not None and device.type == "cuda" else None
        model = DDP(model, device_ids=ids, broadcast_buffers=False)
    _warn_split_dependent(model)

    state = _LoopState()
    ckpt = None
    if ckpt_dir is not None:
        ckpt = Checkpointer(str(ckpt_dir), every_steps=ckpt_every, keep=keep)
        register_state(ckpt, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, fit=state)
    kb = KnowledgeBase(str(knowledge_base)) if isinstance(knowledge_base, (str, os.PathLike)) else knowledge_base
    guard = Guard(coordinator=TorchDistributedCoordinator() if world > 1 else None, knowledge_base=kb,
                  recovery=ckpt, device=TorchDevice(model_device(model)), workload=workload, **guard_options)

    def record_loss() -> None:
        # Inside the step, before its checkpoint is taken: the step's loss is part of it.
        state.losses[guard.next_step] = float(train_step.loss_tensor)

    train_step = TrainStep(model, optimizer, loss_fn, forward=forward, guard=guard, loss_units=loss_units,
                           scheduler=scheduler, scaler=scaler, clip_grad_norm=clip_grad_norm,
                           after_apply=record_loss)
    loader = _loader(data, global_batch, steps, seed=seed, shuffle=shuffle, num_workers=num_workers,
                     collate_fn=collate_fn)
    evaluation = None if eval_data is None else _eval_loader(eval_data, eval_batch or global_batch, num_workers,
                                                             collate_fn)
    incidents: List[Incident] = []

    def run_eval() -> Any:
        was_training = model.training
        model.eval()
        try:
            parts = []
            for batch in evaluation:
                args = _args(batch)
                n = batch_samples(args) or 0
                out = evaluate(model, *args, forward=eval_forward or train_step.forward, guard=guard,
                               loss_units=loss_units if eval_forward is None else None, report_to=incidents)
                parts.append((n, n, out))
            total = sum(n for n, _, _ in parts)
            return None if not parts else _combine([(n, n / total if total else 0.0, o) for n, _, o in parts])
        finally:
            model.train(was_training)

    def after_step(step: int) -> None:
        if evaluation is not None and eval_every > 0 and ((step + 1) % eval_every == 0 or step + 1 == steps):
            state.evals[step] = run_eval()
        if on_step is not None:
            on_step(step, state.losses.get(step, float("nan")))
        state.after_done = step

    def catch_up() -> None:
        # After a rollback or a resume to step S the record holds S's loss (it
        # was saved inside S) but not what ran after S: run that again.
        restored = guard.next_step - 1
        if restored >= 0 and state.after_done < restored:
            after_step(restored)

    rollbacks = 0
    resumed_from = None
    try:
        if ckpt is not None and resume:
            resumed_from = guard.resume()
            if resumed_from is not None:
                catch_up()
        for batch in StepLoader(loader, guard, steps):
            step = guard.next_step
            try:
                train_step(*_args(batch))
            except _errors.RolledBackError as e:
                rollbacks += 1
                if e.report is not None:
                    incidents.extend(e.report.incidents)
                catch_up()
                continue
            incidents.extend(train_step.last_report.incidents)
            after_step(step)
        last = guard.next_step - 1
        if ckpt is not None and last >= 0 and (ckpt_every == 0 or (last + 1) % ckpt_every != 0):
            # The end of the run is a checkpoint too (with its after-step work
            # done), so that a run with more steps resumes from it. Every rank
            # saves; finish() commits it once every shard is durable.
            ckpt.save_async(last)
        checkpoint_step = guard.finish()
    except _errors.CoordinationTimeoutError as e:
        if not exit_on_lost_peer:
            raise
        warnings.warn(f"fit: {e}; exiting with {_errors.EXIT_COORDINATION_TIMEOUT} so that the launcher restarts "
                      "every rank (they resume from the newest complete checkpoint)")
        raise SystemExit(_errors.EXIT_COORDINATION_TIMEOUT) from e
    first = min(state.losses) if state.losses else guard.next_step
    return FitResult(
        losses=[state.losses[s] for s in range(first, guard.next_step) if s in state.losses],
        first_step=first,
        steps=guard.next_step,
        evals=dict(state.evals),
        ooms=guard.total_ooms,
        incidents=incidents,
        micro_batch=guard.micro_limit,
        rollbacks=rollbacks,
        resumed_from=resumed_from,
        checkpoint_step=checkpoint_step,
        skipped_steps=train_step.skipped_steps,
        wall_s=time.monotonic() - started,
    )
