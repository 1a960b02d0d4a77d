"""oomguard in a loop that uses Hugging Face Accelerate's ``prepare()``.

    from accelerate import Accelerator, DistributedDataParallelKwargs
    from oomguard.integrations.accelerate import train_step

    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step = train_step(accelerator, model, optimizer, F.cross_entropy, scheduler=scheduler, clip_grad_norm=1.0)
    for x, y in loader:
        loss = step(x, y)        # replaces zero_grad, backward, clip, optimizer.step, scheduler.step

The loader's batch (per process) stays the batch: an OOM splits it into
micro-batches that fit and the gradient is the whole batch's, summed over
the processes by the guard after its vote (the prepared model's DDP
accumulates under ``no_sync``). This replaces ``find_executable_batch_size``,
which reruns the whole training function with 0.9 of the batch on each
process alone: here the global batch, the LR schedule and the result stay
those of the configured batch, the processes agree on every split, and the
micro-batch grows back when memory allows.

The optimizer step is the prepared optimizer's (AcceleratedOptimizer) and the
scheduler the prepared scheduler (stepped as ``accelerator.prepare`` arranged:
once per process unless ``split_batches``), as in the plain loop. An OOM in
the optimizer step rolls the model, optimizer, scheduler and RNG back to the
snapshot taken before the step (``rollback=True``) and the step is redone with
the same batch. ``accelerator.save_state``/``load_state`` work with it: a
``load_state`` between two steps (a resume, or a jump back to an earlier
state) is what the next rollback restores. Not supported yet: fp16 with a GradScaler
(``mixed_precision="fp16"``), DeepSpeed and FSDP; bf16 and fp32 are.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

try:
    import accelerate
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("oomguard.integrations.accelerate needs accelerate: pip install oomguard[accelerate]") from e

from .. import KnowledgeBase
from .._guard import Guard
from ..checkpoint import Checkpointer
from ..torch import TorchDevice, TorchDistributedCoordinator, TrainStep, register_state
from ._group import run_step

__all__ = ["GuardedStep", "train_step"]


class GuardedStep:
    """A ``TrainStep`` whose calls redo a step that an OOM in its optimizer
    step rolled back (``oomguard.integrations.accelerate.train_step`` makes it).
    ``step(*batch)`` returns the global batch's mean loss; ``step.train_step``
    is the TrainStep, ``step.guard`` its guard."""

    def __init__(self, train_step: TrainStep) -> None:
        self.train_step = train_step
        self.guard = train_step.guard
        self.incidents: list = []
        self._stale_snapshot = False

    def __call__(self, *batch: Any, **kwargs: Any) -> float:
        if self._stale_snapshot:
            # accelerator.load_state replaced the state since the guard's last
            # snapshot: a rollback must restore the loaded state, not that one.
            self._stale_snapshot = False
            self.guard.recovery.snapshot(self.guard.next_step - 1)
        return run_step(self.train_step, *batch, incidents=self.incidents, **kwargs)

    def _state_loading(self) -> None:
        """``accelerator.load_state``'s pre-hook (registered when ``rollback``)."""
        self._stale_snapshot = True

    def finish(self) -> int:
        """Ends the run (collective: every process calls it after its last step)."""
        return self.guard.finish()

    def evaluate(self, *batch: Any, **kwargs: Any) -> Any:
        """The guarded evaluation of ``TrainStep.evaluate`` (an OOM splits the batch)."""
        return self.train_step.evaluate(*batch, **kwargs)


def train_step(accelerator: "accelerate.Accelerator", model: torch.nn.Module, optimizer: Any,
               loss_fn: Optional[Callable[..., torch.Tensor]] = None, *, forward: Optional[Callable[..., Any]] = None,
               scheduler: Any = None, clip_grad_norm: Optional[float] = None,
               loss_units: Optional[Callable[..., Any]] = None, knowledge_base: Any = None, workload: str = "",
               rollback: bool = True, **guard_options: Any) -> GuardedStep:
    """The guarded step of an Accelerate loop: ``model``, ``optimizer`` and
    ``scheduler`` as ``accelerator.prepare`` returned them; ``loss_fn`` or
    ``forward`` and ``loss_units`` as for ``oomguard.torch.TrainStep``.
    ``rollback``: copy the state into host memory after every step, so that
    an OOM in the optimizer step is rolled back and the step redone. More
    keywords go to ``oomguard.Guard``."""
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"train_step needs an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.scaler is not None:
        raise ValueError("oomguard.integrations.accelerate does not support a GradScaler (mixed_precision='fp16') "
                         "yet: use bf16 or fp32, or oomguard.torch.TrainStep(scaler=...) with the unprepared optimizer")
    if accelerator.distributed_type not in (accelerate.DistributedType.NO, accelerate.DistributedType.MULTI_CPU,
                                            accelerate.DistributedType.MULTI_GPU):
        raise ValueError(f"oomguard.integrations.accelerate supports one process and DDP, not "
                         f"{accelerator.distributed_type}")
    for reserved in ("coordinator", "recovery"):
        if reserved in guard_options:
            raise ValueError(f"train_step({reserved}=...): the integration sets it")
    if isinstance(knowledge_base, str):
        knowledge_base = KnowledgeBase(knowledge_base)
    coordinator = TorchDistributedCoordinator() if accelerator.num_processes > 1 else None
    recovery = None
    if rollback:
        recovery = Checkpointer("", every_steps=1)  # in memory: the state after each step
        register_state(recovery, model=model, optimizer=getattr(optimizer, "optimizer", optimizer),
                       scheduler=scheduler)
    guard_options.setdefault("device", TorchDevice(accelerator.device))
    guard = Guard(coordinator=coordinator, knowledge_base=knowledge_base, recovery=recovery,
                  workload=workload or f"accelerate-{type(accelerator.unwrap_model(model)).__name__}", **guard_options)
    step = TrainStep(model, optimizer, loss_fn, forward=forward, guard=guard, scheduler=scheduler,
                     clip_grad_norm=clip_grad_norm, loss_units=loss_units)
    guarded = GuardedStep(step)
    if rollback:
        # The rollback snapshot is taken after every step; a load_state between
        # two steps makes it stale: the next call snapshots the loaded state.
        ref = weakref.ref(guarded)

        def on_load_state(models: Any, input_dir: str) -> None:
            target = ref()
            if target is not None:
                target._state_loading()

        guarded._load_hook = accelerator.register_load_state_pre_hook(on_load_state)
    return guarded
