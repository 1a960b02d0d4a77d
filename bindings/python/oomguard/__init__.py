"""oomguard: keep a training loop alive through out-of-memory errors.

    import oomguard
    guard = oomguard.Guard(initial_micro_batch=64)
    report = guard.step(len(batch), micro=..., commit=..., reset=...)

For PyTorch, ``oomguard.torch.TrainStep`` wraps a model, an optimizer and a
loss into a guarded train_step. See docs/python.md.

The compiled core is ``oomguard._oomguard``; this package re-exports it with a
Pythonic surface. ``import oomguard`` does not import torch.
"""

from __future__ import annotations

# errors first: the compiled module looks its classes up when it raises.
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
from ._guard import Guard
from .checkpoint import Checkpointer, inspect_shard, list_checkpoints, verify_checkpoint

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
