"""Training state in checkpoints: ``register_state`` puts a model, an optimizer,
an LR scheduler, a GradScaler, any object with ``state_dict``, and the RNG
state into an ``oomguard.Checkpointer``, so that a rollback or a resume
restores all of it.

The model's tensors follow the live model: they are registered when the
checkpointer is first used (its first save, load or restore, or the guard's
first step), not when ``register_state`` is called, so a model that is
converted or moved afterwards (``model.double()``, ``model.to(device)``) is
checkpointed as it trains. A tensor replaced after that first use is refused
with an error that says which and what to do, never saved stale.
"""

from __future__ import annotations

import io
import random
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..checkpoint import Checkpointer
from . import fsdp as _fsdp
from ._model import unwrap

__all__ = ["register_state", "flat_parameters", "StateReplacedError"]


class StateReplacedError(ValueError):
    """A model tensor registered with a Checkpointer was replaced (another dtype,
    shape, device or storage) after the checkpointer first used it: checkpoints
    would hold the old tensor and restores would not reach the model."""


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    # Our own bytes, written by _to_bytes: the RNG state holds NumPy arrays,
    # which torch >= 2.6's default weights_only=True refuses.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _rng_state() -> bytes:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return _to_bytes(state)


def _set_rng_state(data: bytes) -> None:
    state = _from_bytes(data)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _add_stateful(ckpt: Checkpointer, path: str, obj: Any) -> None:
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"register_state({path}=...): {type(obj).__name__} has no state_dict()/load_state_dict()")
    ckpt.add_object(path, lambda: _to_bytes(obj.state_dict()), lambda data: obj.load_state_dict(_from_bytes(data)))
    ckpt.registered[path] = obj


def _by_address(t: torch.Tensor) -> bool:
    # Registered by address: contiguous host memory of a dtype the format
    # stores natively. The rest (CUDA, bfloat16, views with strides) goes
    # through torch.save, resolved by name at each save and load.
    return t.device.type == "cpu" and t.is_contiguous() and t.dtype != torch.bfloat16


class _ModuleState:
    """One model's tensors in a checkpointer, registered at its first use."""

    def __init__(self, ckpt: Checkpointer, module: torch.nn.Module, prefix: str) -> None:
        self.ckpt = ckpt
        self.module = module
        self.prefix = prefix
        # name -> (owning module, attribute, data_ptr, dtype, shape, device) of
        # what was registered by address, for the check before each use.
        self.bound: Dict[str, Tuple[torch.nn.Module, str, int, torch.dtype, Tuple[int, ...], torch.device]] = {}

    def _owner(self, name: str) -> Tuple[torch.nn.Module, str]:
        path, _, attr = name.rpartition(".")
        return (self.module.get_submodule(path) if path else self.module), attr

    def _live(self) -> Dict[str, torch.Tensor]:
        # A DTensor (FSDP2) is represented by this rank's local shard: each rank saves its own.
        return {k: _fsdp.local_tensor(v.detach()) for k, v in self.module.state_dict(keep_vars=True).items()}

    def register(self) -> None:
        other: List[str] = []
        for name, t in self._live().items():
            if not _by_address(t):
                other.append(name)
                continue
            self.ckpt.add_tensor(f"{self.prefix}/{name}", t)
            owner, attr = self._owner(name)
            self.bound[name] = (owner, attr, t.data_ptr(), t.dtype, tuple(t.shape), t.device)
        if other:
            # Resolved by name at every save and load: they follow the live model.
            def save_other() -> bytes:
                live = self._live()
                return _to_bytes({k: live[k].cpu() for k in other})

            def load_other(data: bytes) -> None:
                live = self._live()
                with torch.no_grad():
                    for k, v in _from_bytes(data).items():
                        live[k].copy_(v)

            self.ckpt.add_object(f"{self.prefix}.other", save_other, load_other)

    def check(self) -> None:
        for name, (owner, attr, ptr, dtype, shape, device) in self.bound.items():
            t = owner._parameters.get(attr)
            if t is None:
                t = owner._buffers.get(attr)
            if t is not None:
                t = _fsdp.local_tensor(t)
            if t is not None and t.data_ptr() == ptr and t.dtype == dtype and t.device == device and \
                    tuple(t.shape) == shape:
                continue
            now = "gone" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device} at another address"
            raise StateReplacedError(
                f"model tensor '{name}' ({dtype} {shape} on {device}) was replaced after the checkpointer first "
                f"used it (now {now}): checkpoints would hold the old tensor and restores would miss the model. "
                "Convert or move the model (.to(), .double(), load_state_dict(assign=True)) before the first "
                "save, load, resume or guarded step, or register its state with a new Checkpointer")


def register_state(
    ckpt: Checkpointer,
    *,
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[Any] = None,
    rng: bool = True,
    model_prefix: str = "model",
    **extra: Any,
) -> None:
    """Registers training state with a Checkpointer; all of it is restored on a
    rollback and on resume.

    Model parameters and persistent buffers (of the module under DDP and
    torch.compile wrappers) are registered when the checkpointer is first
    used, so the model may still be converted or moved after this call.
    Contiguous CPU tensors go by address at ``/model/<name>`` (no copy);
    others (CUDA, bfloat16) as one object at ``/model.other``. The optimizer
    state (whose tensors the optimizer creates lazily and replaces on
    load_state_dict) is stored as an object (``/optimizer``), as are the LR
    scheduler (``/scheduler``), the GradScaler (``/scaler``), every ``extra``
    object with ``state_dict``/``load_state_dict`` (``/<keyword>``) and the
    RNG state (``/rng``: torch, CUDA, Python and NumPy generators).
    """
    if model is not None:
        state = _ModuleState(ckpt, unwrap(model), model_prefix)
        ckpt.defer(state.register, state.check)
        ckpt.registered[model_prefix] = state.module
    if optimizer is not None:
        # Anything with state_dict/load_state_dict is accepted (the integrations
        # pass a wrapper that keeps the scheduler's hyperparameters on load).
        if any(_fsdp.is_dtensor(p) for g in getattr(optimizer, "param_groups", ()) for p in g["params"]):
            _fsdp.add_sharded_optimizer(ckpt, optimizer, _to_bytes, _from_bytes)
        else:
            _add_stateful(ckpt, "optimizer", optimizer)
    if scheduler is not None:
        _add_stateful(ckpt, "scheduler", scheduler)
    if scaler is not None:
        _add_stateful(ckpt, "scaler", scaler)
    for path, obj in extra.items():
        _add_stateful(ckpt, path, obj)
    if rng:
        ckpt.add_object("rng", _rng_state, _set_rng_state)


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """Every tensor of the state_dict, in its order, flattened into one float64 tensor."""
    # A DTensor (FSDP2) is gathered whole: every rank must call this then.
    tensors = [(t.full_tensor() if _fsdp.is_dtensor(t) else t).detach().reshape(-1).to(torch.float64).cpu()
               for t in unwrap(model).state_dict().values()]
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.float64)
