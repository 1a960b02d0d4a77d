"""What the other modules of oomguard.torch need to know about a model: the
module under its wrappers (DistributedDataParallel, torch.compile), the DDP
wrapper if there is one, and where its parameters live."""

from __future__ import annotations

from typing import Optional

import torch

DDP = torch.nn.parallel.DistributedDataParallel


def _compiled_inner(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module a torch.compile wrapper (OptimizedModule) wraps, else None."""
    inner = model.__dict__.get("_orig_mod") if hasattr(model, "__dict__") else None
    if inner is None:
        inner = getattr(model, "_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, torch.nn.Module) else None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under DistributedDataParallel and torch.compile
    wrappers (in any order): the one whose state_dict has the plain names."""
    while True:
        if isinstance(model, DDP):
            model = model.module
            continue
        inner = _compiled_inner(model)
        if inner is None:
            return model
        model = inner


def ddp_of(model: torch.nn.Module) -> Optional[DDP]:
    """The DistributedDataParallel wrapper among the model's wrappers, or None."""
    while True:
        if isinstance(model, DDP):
            return model
        inner = _compiled_inner(model)
        if inner is None:
            return None
        model = inner


def model_device(model: torch.nn.Module) -> Optional[torch.device]:
    for p in unwrap(model).parameters():
        return p.device
    return None
