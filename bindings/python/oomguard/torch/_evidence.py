"""What torch shows at an OOM beyond the memory figures, for the classifier.

Read while the exception is alive (``oomguard.errors`` calls the hook when it
classifies an OOM for the guard), recorded with the incident
(``Incident.grad_recording``, ``Incident.state_copy_bytes``):

- ``grad_recording``: False when autograd was off where the OOM was raised
  (the guard runs inside the caller's ``torch.no_grad()``); True when tensors
  of the failing frames carry a ``grad_fn`` (graphs were being kept); absent
  when neither tells.
- ``state_copy_bytes``: bytes of live tensors outside a model that copy its
  state under its names and shapes, such as a checkpoint's state dict still
  referenced after ``load_state_dict``. Looked for among the models a
  ``TrainStep`` was built for.

Both are evidence, never verdicts: the classifier weighs them with the rest.
"""

from __future__ import annotations

import gc
import types
import weakref
from typing import Any, Dict, Iterable, Iterator, Optional

import torch

from .. import errors as _errors

# The models TrainSteps were built for, without keeping them alive.
_models: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

# How far the frame walk looks into containers, and how many items per container.
_MAX_DEPTH = 2
_MAX_ITEMS = 64


def watch_model(model: torch.nn.Module) -> None:
    """Looks for copies of ``model``'s state at the OOMs that follow."""
    _models.add(model)


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < _MAX_DEPTH:
        if isinstance(value, (list, tuple)):
            items: Iterable[Any] = value[:_MAX_ITEMS]
        elif isinstance(value, dict):
            items = list(value.values())[:_MAX_ITEMS]
        else:
            return
        for item in items:
            yield from _tensors(item, depth + 1)


def _grad_recording(tb: Optional[types.TracebackType]) -> Optional[bool]:
    if not torch.is_grad_enabled():
        return False  # still inside the caller's no_grad()/inference_mode(): nothing was recorded
    while tb is not None:
        try:
            values = list(tb.tb_frame.f_locals.values())
        except Exception:  # a frame whose locals cannot be read tells nothing
            values = []
        for value in values:
            for t in _tensors(value):
                if t.grad_fn is not None:
                    return True
        tb = tb.tb_next
    return None


def _strip(name: str) -> str:
    # DistributedDataParallel and torch.compile prefix the names of the module they wrap.
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _state_copy_bytes() -> int:
    models = list(_models)
    if not models:
        return 0
    shapes: Dict[str, tuple] = {}
    own = set()
    for model in models:
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor):
                shapes[_strip(name)] = tuple(t.shape)
                own.add(t.untyped_storage().data_ptr())
    seen = set()
    total = 0
    for obj in gc.get_objects():
        # issubclass on the type: isinstance would ask proxies for __class__.
        if not issubclass(type(obj), dict) or not obj:
            continue
        first = next(iter(obj))
        if not isinstance(first, str) or _strip(first) not in shapes:
            continue
        for name, t in obj.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                continue
            if shapes.get(_strip(name)) != tuple(t.shape):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in own or ptr in seen or ptr == 0:
                continue
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def framework_evidence(exc: BaseException) -> Dict[str, Any]:
    """The evidence of an OOM being classified for the guard (``errors`` calls it)."""
    evidence: Dict[str, Any] = {}
    recording = _grad_recording(exc.__traceback__)
    if recording is not None:
        evidence["grad_recording"] = recording
    copies = _state_copy_bytes()
    if copies > 0:
        evidence["state_copy_bytes"] = copies
    return evidence


if framework_evidence not in _errors._evidence_hooks:
    _errors._evidence_hooks.append(framework_evidence)
