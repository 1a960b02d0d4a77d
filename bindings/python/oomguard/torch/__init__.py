"""oomguard for PyTorch.

    import oomguard.torch as ogt
    result = ogt.fit(model, optimizer, loss_fn, dataset, global_batch=64, steps=1000, ckpt_dir="ckpt")

One module a job:

==================  ============================================================
``fit``             one call for a whole loop: checkpoints, resume, rollbacks,
                    DDP, guarded evaluation, exit codes (``fit``, ``FitResult``)
``step``            the guarded step of a loop of your own (``TrainStep``), the
                    guarded evaluation (``evaluate``), batch splitting
``data``            batches by step number, replayed after rollbacks
                    (``StepBatchSampler``, ``StepLoader``)
``state``           what checkpoints hold (``register_state``, ``flat_parameters``)
``device``          torch's memory figures for the guard (``TorchDevice``)
``distributed``     torch.distributed as the guard's transport
                    (``TorchDistributedCoordinator``)
``fsdp``            FSDP2 (``fully_shard``) under TrainStep: the agreement that
                    keeps every rank's micro-batches in lockstep
==================  ============================================================

Supported: torch 2.4 and later (see the README).
"""

from __future__ import annotations

from .data import StepBatchSampler, StepLoader
from .device import TorchDevice, memory_figures
from .distributed import TorchDistributedCoordinator
from . import fsdp
from .fit import FitResult, fit
from .state import StateReplacedError, flat_parameters, register_state
from .step import TrainStep, batch_samples, evaluate, split_batch

__all__ = [
    "FitResult",
    "StateReplacedError",
    "StepBatchSampler",
    "StepLoader",
    "TorchDevice",
    "TorchDistributedCoordinator",
    "TrainStep",
    "batch_samples",
    "evaluate",
    "fit",
    "flat_parameters",
    "memory_figures",
    "register_state",
    "split_batch",
]
