"""Exceptions raised by oomguard, and what counts as an out-of-memory error.

Every class subclasses the builtin a caller would naturally catch, so code
that knows nothing of oomguard still does the right thing:

=========================  =====================  ===============================
status code                class                  also an instance of
=========================  =====================  ===============================
RESOURCE_EXHAUSTED         OutOfMemoryError       MemoryError
ABORTED                    RolledBackError        RuntimeError
UNAVAILABLE, DEADLINE_...  CoordinationTimeout..  TimeoutError (exit with 75)
DATA_LOSS                  CorruptCheckpointError OSError
NOT_FOUND                  CheckpointNotFound..   FileNotFoundError
INVALID_ARGUMENT           InvalidArgumentError   ValueError
FAILED_PRECONDITION        FailedPreconditionErr  RuntimeError
CANCELLED                  PeerFailedError        RuntimeError
anything else              OomguardError          RuntimeError
=========================  =====================  ===============================

This module imports nothing heavy (no torch): torch's exception types are
looked up in ``sys.modules`` when an error is classified, since no torch OOM
can be raised before torch is imported.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = [
    "OomguardError",
    "OutOfMemoryError",
    "RolledBackError",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "CheckpointNotFoundError",
    "InvalidArgumentError",
    "FailedPreconditionError",
    "PeerFailedError",
    "InjectedOutOfMemoryError",
    "EXIT_COORDINATION_TIMEOUT",
    "oom_kind",
]

# The documented exit code of a process whose peers stopped answering
# (EX_TEMPFAIL); launchers restart every rank, which resume from the newest
# complete checkpoint. Same value as oomguard::kExitCoordinationTimeout.
EXIT_COORDINATION_TIMEOUT = 75


class OomguardError(RuntimeError):
    """Base class of oomguard's errors.

    Attributes:
        code: the canonical status code name ("RESOURCE_EXHAUSTED", ...).
        report: the StepReport of the step that failed, or None when the error
            did not come from a guarded step.
    """

    code: str = "UNKNOWN"

    def __init__(self, message: str, *, code: Optional[str] = None, report: Any = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.report = report


class OutOfMemoryError(OomguardError, MemoryError):
    """Out of memory, and the guard could not recover (RESOURCE_EXHAUSTED).

    The message names the incident and the top remedies.
    """

    code = "RESOURCE_EXHAUSTED"


class RolledBackError(OomguardError):
    """The step was rolled back to a checkpoint (ABORTED): continue from ``next_step``."""

    code = "ABORTED"

    @property
    def rolled_back_to(self) -> Optional[int]:
        return None if self.report is None else self.report.rolled_back_to

    @property
    def next_step(self) -> Optional[int]:
        to = self.rolled_back_to
        return None if to is None else to + 1


class CoordinationTimeoutError(OomguardError, TimeoutError):
    """A peer rank did not answer in time (UNAVAILABLE).

    Exit with ``EXIT_COORDINATION_TIMEOUT`` so that the launcher restarts every
    rank; they resume from the newest complete checkpoint.
    """

    code = "UNAVAILABLE"
    exit_code = EXIT_COORDINATION_TIMEOUT


class CorruptCheckpointError(OomguardError, OSError):
    """A checkpoint (or another file) is corrupt and nothing usable was found (DATA_LOSS)."""

    code = "DATA_LOSS"


class CheckpointNotFoundError(OomguardError, FileNotFoundError):
    """No committed checkpoint (or file) exists where one was asked for (NOT_FOUND)."""

    code = "NOT_FOUND"


class InvalidArgumentError(OomguardError, ValueError):
    """Bad options, fault rules, files or arguments (INVALID_ARGUMENT)."""

    code = "INVALID_ARGUMENT"


class FailedPreconditionError(OomguardError):
    """The call is not valid in the current state (FAILED_PRECONDITION)."""

    code = "FAILED_PRECONDITION"


class PeerFailedError(OomguardError):
    """Another rank stopped this step with an error of its own (CANCELLED).

    The message names that rank and its error; that rank raised the original
    exception. Every rank stops at the same step, so a restart resumes all.
    """

    code = "CANCELLED"


_BY_CODE = {
    "RESOURCE_EXHAUSTED": OutOfMemoryError,
    "ABORTED": RolledBackError,
    "UNAVAILABLE": CoordinationTimeoutError,
    "DEADLINE_EXCEEDED": CoordinationTimeoutError,
    "DATA_LOSS": CorruptCheckpointError,
    "NOT_FOUND": CheckpointNotFoundError,
    "INVALID_ARGUMENT": InvalidArgumentError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "CANCELLED": PeerFailedError,
}


def _from_status(code: int, code_name: str, message: str, report: Any) -> OomguardError:
    """The exception for a non-OK status (the compiled module's ``status_error`` hook)."""
    del code  # the name is the stable key
    cls = _BY_CODE.get(code_name, OomguardError)
    return cls(f"{code_name}: {message}", code=code_name, report=report)


class InjectedOutOfMemoryError(MemoryError):
    """An out-of-memory error raised by fault injection (``OOMGUARD_FAULTS``,
    ``set_fault_rules``) inside Python code: at the sites ``Guard.mark_phase``
    fires (forward, backward, optimizer, ...). ``kind`` is "device" (rule
    ``oom``) or "host" (``host_oom``); the guard handles it as that kind."""

    def __init__(self, message: str, kind: str = "device", requested_bytes: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.requested_bytes = requested_bytes


# ---- what counts as an out-of-memory error ----

def _type_name(t: type) -> str:
    module = getattr(t, "__module__", "")
    return t.__qualname__ if module in ("builtins", "") else f"{module}.{t.__qualname__}"


def _torch_oom_types() -> Tuple[type, ...]:
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    found = []
    # torch >= 2.1 has torch.OutOfMemoryError; 1.13 to 2.0 only torch.cuda.OutOfMemoryError
    # (raised for every c10::OutOfMemoryError, CPU allocators included).
    for owner in (torch, getattr(torch, "cuda", None)):
        t = getattr(owner, "OutOfMemoryError", None)
        if isinstance(t, type) and issubclass(t, BaseException) and t not in found:
            found.append(t)
    return tuple(found)


def _message_kind(message: str) -> Tuple[str, int]:
    from . import _oomguard  # the compiled classifier (PyTorch, CUDA, cuBLAS, XLA wording)

    kind, requested = _oomguard.classify_message(message)
    return kind, int(requested)


def oom_kind(exc: BaseException) -> Optional[str]:
    """"device", "host" or "workspace" when ``exc`` is an out-of-memory error, else None.

    The type decides first (torch's OutOfMemoryError types, MemoryError); the
    message is the last resort, and only for RuntimeError, which is what older
    PyTorch and the CPU allocator raise ("DefaultCPUAllocator: can't allocate
    memory", "CUDA out of memory"). A ValueError that mentions memory is not an OOM.
    """
    verdict = _classify(exc)
    return None if verdict is None else verdict[0]


def _classify(exc: BaseException) -> Optional[Tuple[str, str, str, int]]:
    """(kind, type name, message, requested bytes) of an OOM, else None."""
    message = str(exc)
    if isinstance(exc, InjectedOutOfMemoryError):
        return exc.kind, _type_name(type(exc)), message, exc.requested_bytes
    torch_types = _torch_oom_types()
    if torch_types and isinstance(exc, torch_types):
        kind, requested = _message_kind(message)
        # The type settles that it is an OOM; the message says whose memory.
        if kind == "none":
            kind = "device"
        return kind, _type_name(type(exc)), message, requested
    if isinstance(exc, MemoryError):
        kind, requested = _message_kind(message)
        return ("workspace" if kind == "workspace" else "host"), _type_name(type(exc)), message, requested
    if isinstance(exc, RuntimeError) and not isinstance(exc, OomguardError):
        kind, requested = _message_kind(message)
        if kind != "none":
            return kind, _type_name(type(exc)), message, requested
    return None


# Memory figures taken while an OOM's frames (and the tensors they hold) are
# still alive, for the device the guard asks next: the guard reads its device
# right after it classified the OOM, but by then the Python exception and its
# frames are gone. Per thread: each guard is driven by one thread.
_figures_at_oom = threading.local()
# Callables returning {device name: MemoryStats} (oomguard.torch registers one).
_figures_hooks: List[Callable[[], Dict[str, Any]]] = []
# Callables returning evidence about an OOM from the exception itself and the
# live objects ({"grad_recording": bool, "state_copy_bytes": int}, any
# subset); oomguard.torch registers one. Called while the exception's frames
# are alive, before the guard releases anything.
_evidence_hooks: List[Callable[[BaseException], Dict[str, Any]]] = []


def _capture_figures_at_oom() -> None:
    figures: Dict[str, Any] = {}
    for hook in _figures_hooks:
        try:
            figures.update(hook())
        except Exception:  # figures are a courtesy; the OOM being handled stays the error
            pass
    if figures:
        _figures_at_oom.pending = figures


def _take_figures_at_oom(device_name: str) -> Any:
    """The figures of ``device_name`` captured at this thread's last OOM, once; else None."""
    pending = _figures_at_oom.__dict__.pop("pending", None)
    return None if pending is None else pending.get(device_name)


def _forget_figures_at_oom() -> None:
    _figures_at_oom.__dict__.clear()


def _evidence(exc: BaseException) -> Optional[Dict[str, Any]]:
    evidence: Dict[str, Any] = {}
    for hook in _evidence_hooks:
        try:
            evidence.update(hook(exc))
        except Exception:  # evidence is a courtesy; the OOM being handled stays the error
            pass
    return evidence or None


def _classify_for_guard(exc: BaseException) -> Optional[Tuple[str, str, str, int, bool, Optional[Dict[str, Any]]]]:
    """(kind, type name, message, requested bytes, injected, evidence) for an OOM, else None.

    Called by the compiled module (installed as its ``classify`` hook) with
    the exception a guarded callback raised. It must not keep a reference to
    ``exc``: the guard drops the exception, its traceback and the frames
    holding tensors before it releases caches.
    """
    verdict = _classify(exc)
    if verdict is None:
        return None
    if _figures_hooks:
        _capture_figures_at_oom()
    injected = isinstance(exc, InjectedOutOfMemoryError)
    return (*verdict, injected, None if injected else _evidence(exc))
