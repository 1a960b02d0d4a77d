"""oomguard inside ``transformers.Trainer``: every optimizer step guarded.

    from oomguard.integrations.hf import OomguardTrainer
    trainer = OomguardTrainer(model=model, args=args, train_dataset=ds, data_collator=collate,
                              knowledge_base="incidents.sqlite")
    trainer.train()

``OomguardTrainer`` is ``transformers.Trainer`` with ``GuardedTrainerMixin``;
put the mixin first in a Trainer subclass of your own
(``class MyTrainer(GuardedTrainerMixin, MyBaseTrainer)``).

What changes: the ``gradient_accumulation_steps`` batches of one optimizer
step (the Trainer fetches them together, ``get_batch_samples``) run as one
``oomguard.torch.TrainStep`` step. An OOM splits them into smaller
micro-batches (pieces of the Trainer's batches, each run through
``compute_loss`` on its own, so batches padded to different lengths are never
concatenated), keeps the completed ones, and grows back when memory allows;
the global batch (``per_device_train_batch_size`` x accumulation x ranks) and
the gradient stay those of the unguarded Trainer:

- with ``num_items_in_batch`` (models that take loss kwargs, or a
  ``compute_loss_func``): every micro-batch is weighed by its share of the
  step's loss units, counted as the Trainer counts them (labels != -100, over
  ``labels[..., 1:]`` for causal LMs), over every rank: the token-weighted
  mean the Trainer computes;
- otherwise: by its share of the step's samples (equal to the Trainer's mean
  of batch means when its batches have one size; the last, smaller batch of
  an epoch weighs less here than there).

The gradients are summed over ranks by the guard after its vote (the model's
DDP accumulates under ``no_sync``); clipping (``max_grad_norm``, the norm is
logged as ``grad_norm``) and ``optimizer.step()`` run inside the guarded step,
so an OOM in the optimizer step rolls the model, optimizer and RNG
back to the snapshot taken before the step (``rollback=True``: a Checkpointer
without a directory that copies the state into host memory after every step)
and the step is redone with the same batches; so is a step whose micro-batch
of one sample does not fit (until ``max_rollbacks_per_step``). The Trainer's own LR scheduler, logging, callbacks,
evaluation and checkpoints run as before.

Not guarded (the Trainer runs them outside any step the guard can split):
the evaluation loop and the checkpoint writer. An OOM there is recorded as an
incident (phase ``eval``: each runs as a ``Guard.evaluate`` of one unit), the
caches are released and it is run once more; a second OOM is raised.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

try:
    import transformers
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("oomguard.integrations.hf needs transformers: pip install oomguard[hf]") from e

from .. import KnowledgeBase
from .._guard import Guard
from ..checkpoint import Checkpointer
from ..torch import TorchDevice, TorchDistributedCoordinator, TrainStep, register_state
from ..torch import distributed as _distributed
from ..torch._model import unwrap
from ._group import Group, OptimizerState, StepThrough, run_step, run_unguarded, split_group

__all__ = ["GuardedTrainerMixin", "OomguardTrainer"]


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under Accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


class GuardedTrainerMixin:
    """Guards every optimizer step of a ``transformers.Trainer`` (see the module).

    Keyword arguments, besides the Trainer's:
        knowledge_base: an ``oomguard.KnowledgeBase`` or a path to one: where
            incidents are recorded.
        workload: the name incidents and the knowledge base's prior carry
            (default: the model's class and ``per_device_train_batch_size``).
        rollback: keep a snapshot of the training state before each step, so
            that an OOM in the optimizer step is rolled back and redone
            (default True; costs a copy of the parameters and the optimizer
            state in host memory, refreshed after every step).
        guard_options: more keywords for ``oomguard.Guard``
            (``initial_micro_batch``, ``controller``, ...).
    """

    def __init__(self, *args: Any, knowledge_base: Any = None, workload: str = "", rollback: bool = True,
                 guard_options: Optional[dict] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(knowledge_base, (str, os.PathLike)):
            knowledge_base = KnowledgeBase(os.fspath(knowledge_base))
        self.oomguard_knowledge_base = knowledge_base
        self._og_workload = workload
        self._og_rollback = bool(rollback)
        self._og_options = dict(guard_options or {})
        for reserved in ("coordinator", "knowledge_base", "recovery", "workload"):
            if reserved in self._og_options:
                raise ValueError(f"guard_options={{'{reserved}': ...}}: the integration sets it "
                                 f"(give knowledge_base=, workload=, rollback= to the trainer)")
        if self.args.world_size > 1 and not self.args.average_tokens_across_devices:
            raise ValueError("GuardedTrainerMixin with several ranks needs average_tokens_across_devices=True: the "
                             "guard weighs ranks by their share of the step's loss units (each rank's own mean, "
                             "averaged over ranks, would change with every split)")
        if self.args.world_size > 1 and self.args.ddp_broadcast_buffers is None:
            # A buffer broadcast inside forward is a collective before the guard's vote.
            self.args.ddp_broadcast_buffers = False
        self.oomguard_step: Optional[TrainStep] = None
        self.oomguard_incidents: list = []
        self.oomguard_losses: list = []
        self._og_group: Optional[Group] = None
        self._og_units: bool = False
        self._og_left = 0  # training_step calls of the group still to come
        self._og_skip_optimizer = False
        self._og_grad_norm: Optional[torch.Tensor] = None

    # -- the Trainer's hooks ------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        out = super().train(*args, **kwargs)
        if self.oomguard_step is not None:
            self.oomguard_step.guard.finish()  # collective: every rank ends its guard together
        return out

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> Any:
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._og_group = Group([self._prepare_inputs(b) for b in batch_samples]) if batch_samples else None
        self._og_units = num_items_in_batch is not None
        self._og_left = len(batch_samples)
        return batch_samples, num_items_in_batch

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if self._og_group is None or self._og_left <= 0:
            raise RuntimeError("GuardedTrainerMixin.training_step ran outside the Trainer's loop "
                               "(get_batch_samples did not collect this optimizer step's batches)")
        self._og_left -= 1
        if self._og_left > 0:  # the step runs once every batch of it is known, at its last batch
            return torch.zeros((), device=self.args.device)
        model.train()
        train_step = self._og_train_step(model)
        group, self._og_group = self._og_group, None
        loss = run_step(train_step, group, samples=group.samples, incidents=self.oomguard_incidents)
        self.oomguard_losses.append(loss)
        self._og_skip_optimizer = True  # the loop's own optimizer.step() follows: the step was taken
        return torch.tensor(loss, device=self.args.device)

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        # Clipped inside the guarded step, before its optimizer step; this is the norm it found.
        return self._og_grad_norm

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return self._og_unguarded("eval", lambda: super(GuardedTrainerMixin, self).evaluate(*args, **kwargs))

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        return self._og_unguarded("checkpoint_save",
                                  lambda: super(GuardedTrainerMixin, self)._save_checkpoint(*args, **kwargs))

    # -- the guarded step ---------------------------------------------------

    def _og_train_step(self, model: torch.nn.Module) -> TrainStep:
        if self.oomguard_step is not None and self.oomguard_step.model is model:
            return self.oomguard_step
        coordinator = TorchDistributedCoordinator() if _distributed.world_size() > 1 else None
        recovery = None
        if self._og_rollback:
            recovery = Checkpointer("", every_steps=1)  # in memory: the state after each step
            # Not the LR scheduler: the Trainer steps it after the guarded step,
            # after the snapshot; a rollback to this step's start finds it (and
            # the hyperparameters it set in the optimizer: OptimizerState) right.
            register_state(recovery, model=model, optimizer=OptimizerState(_inner_optimizer(self.optimizer)))
        options = dict(self._og_options)
        options.setdefault("device", TorchDevice(self.args.device))
        workload = self._og_workload or (f"hf-{type(unwrap(model)).__name__}-"
                                         f"b{self.args.per_device_train_batch_size}")
        guard = Guard(coordinator=coordinator, knowledge_base=self.oomguard_knowledge_base, recovery=recovery,
                      workload=workload, **options)
        guard.next_step = self.state.global_step
        original_step = self.optimizer.step

        def step_unless_taken(*args: Any, **kwargs: Any) -> Any:
            if self._og_skip_optimizer:
                self._og_skip_optimizer = False
                return None
            return original_step(*args, **kwargs)

        if hasattr(original_step, "_wrapped_by_lr_sched"):
            step_unless_taken._wrapped_by_lr_sched = True  # what torch's LR scheduler checks for
        self.optimizer.step = step_unless_taken  # the instance's, not the class's
        self.oomguard_step = TrainStep(
            model, StepThrough(self.optimizer, self._og_apply), forward=self._og_forward, guard=guard,
            split=split_group, loss_units=self._og_loss_units if self._og_units else None)
        return self.oomguard_step

    def _og_apply(self) -> None:
        """The optimizer step as the Trainer takes it (clip, then the
        AcceleratedOptimizer, whose step honours the GradScaler), inside the
        guarded step."""
        self._og_grad_norm = None
        if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
            model = self.oomguard_step.model
            self._og_grad_norm = super()._clip_grad_norm(model)
        _inner_optimizer(self.optimizer).step()
        # What torch's LR scheduler wrapper of the prepared optimizer's step records (the loop's call is skipped).
        self.optimizer._opt_called = True

    def _og_count(self, batch: Any) -> torch.Tensor:
        """Loss units per sample, counted as ``Trainer._get_num_items_in_batch`` counts them."""
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        elif getattr(self, "_loss_shifts_labels", False):
            labels = batch["labels"][..., 1:]
        else:
            labels = batch["labels"]
        return labels.ne(-100).reshape(labels.shape[0], -1).sum(dim=1)

    def _og_loss_units(self, group: Group) -> torch.Tensor:
        return torch.cat([self._og_count(b) for b in group.batches])

    def _og_forward(self, model: torch.nn.Module, pieces: list) -> torch.Tensor:
        """The mean loss of one micro-batch (pieces of the step's batches),
        through the Trainer's own ``compute_loss``: over its loss units (given
        as ``num_items_in_batch``), or over its samples."""
        scale = 1.0
        if self._og_units:
            units = sum(int(self._og_count(p).sum()) for _, _, p in pieces)
            if (self.args.average_tokens_across_devices
                    and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)):
                # compute_loss multiplies by the ranks, for DDP's average; the guard sums instead.
                scale = 1.0 / (self.accelerator.num_processes // self.get_tp_size())
        total = None
        samples = sum(_len(p) for _, _, p in pieces)
        for _, _, piece in pieces:
            with self.compute_loss_context_manager():
                if self._og_units:
                    loss = self.compute_loss(model, dict(piece), num_items_in_batch=units) * scale
                else:
                    loss = self.compute_loss(model, dict(piece)) * (_len(piece) / samples)
            total = loss if total is None else total + loss
        return total

    def _og_unguarded(self, phase: str, run: Any) -> Any:
        """The Trainer's evaluation loop or checkpoint writer, which the guard
        cannot split: an OOM is recorded and retried once (``run_unguarded``)."""
        if self.oomguard_step is None:
            return run()
        return run_unguarded(self.oomguard_step.guard, run, self.oomguard_incidents)


def _len(batch: Any) -> int:
    from ..torch.step import batch_samples

    return batch_samples([batch])


class OomguardTrainer(GuardedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with every optimizer step guarded by oomguard
    (``GuardedTrainerMixin``)."""
