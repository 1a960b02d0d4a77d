"""oomguard inside Lightning's ``Trainer`` (automatic optimisation): every
optimizer step guarded.

    from oomguard.integrations.lightning import OomguardCallback, GuardedDDPStrategy
    trainer = L.Trainer(callbacks=[OomguardCallback(knowledge_base="incidents.sqlite")],
                        accumulate_grad_batches=4, gradient_clip_val=1.0,
                        strategy=GuardedDDPStrategy(process_group_backend="gloo"), devices=2)  # or one process
    trainer.fit(module, loader)

What changes: the ``accumulate_grad_batches`` batches of one optimizer step run
as one ``oomguard.torch.TrainStep`` step, at the step's last batch. The
callback wraps the module's ``training_step`` (which then only collects the
batch and returns a zero that is no function of the model: Lightning's
backward has nothing to do) and ``optimizer_step`` (which
runs the guarded step: the collected batches split into micro-batches that
fit, pieces of Lightning's batches, each through your ``training_step``; then
your ``optimizer_step``, so that Lightning's gradient clipping,
``on_before_optimizer_step`` hooks, precision plugin and LR schedulers run as
before). The gradient stays Lightning's: each batch's loss divided by
``accumulate_grad_batches``, whatever the batches' sizes; a piece of a batch
counts for its share of the batch's samples, or of its loss units
(``loss_units``: e.g. valid tokens, when ``training_step`` returns a mean over
tokens).

Several ranks: ``GuardedDDPStrategy`` is Lightning's ``DDPStrategy`` without
the ``DistributedDataParallel`` wrapper: the guard sums the gradients over
ranks after its vote (a rank that hit an OOM never leaves the others blocked
inside DDP's all-reduce), weighing each rank by its samples.

Rollback: an OOM in the optimizer step restores the snapshot of the model,
optimizer and RNG taken before the step (``rollback=True``: a
Checkpointer without a directory that copies the state into host memory after
every step) and the step is redone with the same batches.

Not guarded: the validation loop and Lightning's checkpoint writer (an OOM
in ``validation_step`` is recorded as an incident, phase ``eval``, caches are
released and the batch retried once, then it is raised), and manual
optimisation (``automatic_optimization = False``: use
``oomguard.torch.TrainStep`` inside your ``training_step``; docs/integrations/lightning.md).
What ``training_step`` logs with ``self.log`` is logged per micro-batch piece;
the loss Lightning itself sees (its progress bar's ``loss``, the
``outputs`` of ``on_train_batch_end``) is that zero: the guarded step's loss
is in ``callback.losses`` and logged as ``oomguard_loss``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("oomguard.integrations.lightning needs lightning: pip install oomguard[lightning]") from e

from .. import KnowledgeBase
from .._guard import Guard
from ..checkpoint import Checkpointer
from ..torch import TorchDevice, TorchDistributedCoordinator, TrainStep, register_state
from ..torch import distributed as _distributed
from ._group import Group, OptimizerState, StepThrough, run_step, run_unguarded, split_group

__all__ = ["GuardedDDPStrategy", "OomguardCallback"]


class GuardedDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy (process group, samplers, launch) without the
    ``DistributedDataParallel`` wrapper: ``OomguardCallback``'s guard sums the
    gradients over ranks after its vote. Use it only with the callback (a
    plain run would never sum the ranks' gradients)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


class OomguardCallback(pl.Callback):
    """Guards every optimizer step of Lightning's automatic optimisation (see the module).

    Args:
        knowledge_base: an ``oomguard.KnowledgeBase`` or a path to one.
        workload: the name incidents and the knowledge base's prior carry
            (default: the module's class name).
        rollback: snapshot the state before each step, so that an OOM in the
            optimizer step is rolled back and redone (default True).
        loss_units: ``loss_units(batch)`` -> the loss units of each sample
            (e.g. valid tokens), when ``training_step``'s loss is a mean over
            units rather than samples: a piece of a batch then counts for its
            share of the batch's units.
        **guard_options: more keywords for ``oomguard.Guard``.
    """

    def __init__(self, knowledge_base: Any = None, workload: str = "", rollback: bool = True,
                 loss_units: Optional[Callable[[Any], Any]] = None, **guard_options: Any) -> None:
        for reserved in ("coordinator", "knowledge_base", "recovery"):
            if reserved in guard_options:
                raise ValueError(f"OomguardCallback({reserved}=...): the callback sets it")
        if isinstance(knowledge_base, (str, os.PathLike)):
            knowledge_base = KnowledgeBase(os.fspath(knowledge_base))
        self.knowledge_base = knowledge_base
        self.workload = workload
        self.rollback = bool(rollback)
        if loss_units is not None and not callable(loss_units):
            raise TypeError(f"OomguardCallback(loss_units=...) must be callable, got {type(loss_units).__name__}")
        self.loss_units = loss_units
        self.guard_options = guard_options
        self.train_step: Optional[TrainStep] = None
        self.losses: List[float] = []
        self.incidents: list = []
        self._group: List[Any] = []
        self._no_loss = torch.zeros((), requires_grad=True)
        self._module: Optional[pl.LightningModule] = None
        self._originals: dict = {}

    # -- Lightning's hooks --------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError("OomguardCallback guards automatic optimisation; with automatic_optimization=False "
                             "call oomguard.torch.TrainStep in your training_step (docs/integrations/lightning.md)")
        strategy = trainer.strategy
        if _distributed.world_size() > 1 and not isinstance(strategy, GuardedDDPStrategy):
            raise ValueError(f"OomguardCallback with {_distributed.world_size()} ranks needs "
                             f"strategy=GuardedDDPStrategy(...), not {type(strategy).__name__}: the guard sums the "
                             "gradients over ranks, DistributedDataParallel would sum them inside backward")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"OomguardCallback guards one optimizer, the module configured {len(trainer.optimizers)}")
        self._module = pl_module
        self._originals = {"training_step": pl_module.training_step,
                           "optimizer_step": pl_module.optimizer_step,
                           "validation_step": getattr(pl_module, "validation_step", None)}
        pl_module.training_step = self._collect
        pl_module.optimizer_step = self._optimizer_step
        if self._originals["validation_step"] is not None:
            pl_module.validation_step = self._validation_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.train_step is not None:
            self.train_step.guard.finish()  # collective, while Lightning's process group is up
        for name in self._originals:
            pl_module.__dict__.pop(name, None)  # the class's methods again
        self._originals = {}

    # -- the wrapped module methods -------------------------------------------

    def _collect(self, batch: Any, batch_idx: int, *args: Any) -> torch.Tensor:
        self._group.append((batch, batch_idx, args))
        # Lightning refuses None from training_step with several ranks; a zero
        # on a leaf of its own gives its backward nothing to do to the model.
        return self._no_loss * 0.0

    def _optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if optimizer_closure is not None:
            optimizer_closure()  # runs _collect for the step's last batch (and Lightning's zero_grad)
        trainer = self._module.trainer
        entries, self._group = self._group, []
        group = Group([b for b, _, _ in entries])
        # Lightning's gradient: each batch's loss (a mean over its samples, or
        # over its loss units) divided by accumulate_grad_batches. A piece of
        # batch b counts for its share of b's units (samples by default); the
        # guard then weighs the micro-batch by its share of the step's samples,
        # which the forward divides out again: exact for batches of any size.
        units = [self._units(b) for b in group.batches]
        totals = [float(u.sum()) for u in units]
        accumulate = trainer.accumulate_grad_batches
        train_step = self._train_step(trainer, optimizer)

        def forward(module: pl.LightningModule, pieces: list) -> torch.Tensor:
            total = None
            samples = 0
            for index, start, piece in pieces:
                _, idx, extra = entries[index]
                out = self._originals["training_step"](piece, idx, *extra)
                loss = out["loss"] if isinstance(out, dict) else out
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(f"training_step returned {type(out).__name__}; OomguardCallback needs the loss "
                                    "(a tensor, or a dict with 'loss')")
                n = _samples(piece)
                share = float(units[index][start:start + n].sum()) / totals[index] if totals[index] else 0.0
                weighted = loss * (share / accumulate)
                total = weighted if total is None else total + weighted
                samples += n
            return total * (group.samples / samples)

        self._forward = forward

        def apply() -> None:
            self._originals["optimizer_step"](epoch, batch_idx, optimizer, optimizer_closure=_nothing)

        self._apply = apply
        fx = self._module._current_fx_name
        self._module._current_fx_name = "training_step"  # self.log in training_step: as Lightning's own
        try:
            loss = run_step(train_step, group, samples=group.samples, incidents=self.incidents)
        finally:
            self._module._current_fx_name = fx
        self.losses.append(loss)
        self._module.log("oomguard_loss", loss, on_step=True, prog_bar=True, batch_size=group.samples)

    def _validation_step(self, *args: Any, **kwargs: Any) -> Any:
        validation_step = self._originals["validation_step"]
        if self.train_step is None:
            return validation_step(*args, **kwargs)
        return run_unguarded(self.train_step.guard, lambda: validation_step(*args, **kwargs), self.incidents)

    def _units(self, batch: Any) -> torch.Tensor:
        n = _samples(batch)
        if self.loss_units is None:
            return torch.ones(n, dtype=torch.float64)
        units = torch.as_tensor(self.loss_units(batch)).detach().to("cpu", torch.float64).reshape(-1)
        if units.numel() != n:
            raise ValueError(f"loss_units gave {units.numel()} counts for a batch of {n} samples")
        return units

    # -- the guarded step -------------------------------------------------------

    def _train_step(self, trainer: pl.Trainer, optimizer: Any) -> TrainStep:
        if self.train_step is not None:
            return self.train_step
        module = self._module
        coordinator = TorchDistributedCoordinator() if _distributed.world_size() > 1 else None
        recovery = None
        if self.rollback:
            recovery = Checkpointer("", every_steps=1)  # in memory: the state after each step
            # Not the LR schedulers: Lightning steps them after the guarded step,
            # after the snapshot; a rollback to this step's start finds them (and
            # the hyperparameters they set in the optimizer: OptimizerState) right.
            register_state(recovery, model=module, optimizer=OptimizerState(_torch_optimizer(optimizer)))
        options = dict(self.guard_options)
        options.setdefault("device", TorchDevice(module.device))
        guard = Guard(coordinator=coordinator, knowledge_base=self.knowledge_base, recovery=recovery,
                      workload=self.workload or f"lightning-{type(module).__name__}", **options)
        guard.next_step = trainer.global_step
        self.train_step = TrainStep(module, StepThrough(_torch_optimizer(optimizer), lambda: self._apply()),
                                    forward=lambda m, g: self._forward(m, g), guard=guard, split=split_group)
        return self.train_step


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps it


def _nothing() -> None:
    return None


def _samples(batch: Any) -> int:
    from ..torch.step import batch_samples

    return batch_samples([batch])



