"""oomguard: keep a training loop alive through out-of-memory errors.

    import oomguard.torch as ogt
    result = ogt.fit(model, optimizer, loss_fn, dataset, global_batch=64, steps=1000,
                     ckpt_dir="ckpt")

``oomguard.torch.fit`` owns a whole PyTorch loop; ``oomguard.torch.TrainStep``
guards the step of a loop of your own; ``oomguard.Guard`` is the framework-free
core:

    guard = oomguard.Guard(initial_micro_batch=64)
    report = guard.step(len(batch), micro=..., apply=..., reset=...)

See docs/python.md.

The compiled core is ``oomguard._oomguard``; this package re-exports it with a
Pythonic surface. ``import oomguard`` does not import torch.
"""

from __future__ import annotations

from . import errors
from .errors import (
    EXIT_COORDINATION_TIMEOUT,
    CheckpointNotFoundError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    FailedPreconditionError,
    InjectedOutOfMemoryError,
    InvalidArgumentError,
    OomguardError,
    OutOfMemoryError,
    PeerFailedError,
    RolledBackError,
    oom_kind,
)
from . import _oomguard
from ._oomguard import (
    Coordinator,
    Device,
    Incident,
    KnowledgeBase,
    MemoryStats,
    MicroBatch,
    Phase,
    RankMemory,
    Status,
    StatusCode,
    StepReport,
    active_fault_rules,
    classify_message,
    clear_fault_rules,
    faults_fired,
    make_local_coordinator,
    make_thread_group,
    plan_by_samples,
    set_fault_rules,
)
from ._guard import Guard, _sum_buffer
from .checkpoint import Checkpointer, inspect_shard, list_checkpoints, verify_checkpoint

# The compiled module calls back into these (it imports nothing of the package).
_oomguard._install_hooks(
    classify=errors._classify_for_guard,
    status_error=errors._from_status,
    describe_buffer=_sum_buffer,
    injected_oom=errors.InjectedOutOfMemoryError,
)

__version__ = _oomguard.__version__

__all__ = [
    "Checkpointer",
    "CheckpointNotFoundError",
    "Coordinator",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "EXIT_COORDINATION_TIMEOUT",
    "FailedPreconditionError",
    "Guard",
    "Device",
    "Incident",
    "InjectedOutOfMemoryError",
    "InvalidArgumentError",
    "KnowledgeBase",
    "MemoryStats",
    "MicroBatch",
    "OomguardError",
    "OutOfMemoryError",
    "PeerFailedError",
    "Phase",
    "RankMemory",
    "RolledBackError",
    "Status",
    "StatusCode",
    "StepReport",
    "active_fault_rules",
    "classify_message",
    "clear_fault_rules",
    "errors",
    "faults_fired",
    "inspect_shard",
    "list_checkpoints",
    "make_local_coordinator",
    "make_thread_group",
    "oom_kind",
    "plan_by_samples",
    "set_fault_rules",
    "verify_checkpoint",
]
