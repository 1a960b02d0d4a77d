"""Memory figures: torch's view of the device, for incidents, votes and the
size controller.

``TorchDevice`` reads ``torch.cuda.memory_stats`` on a CUDA device and the
counts of ``oomguard.budget`` on the CPU. It is what ``Guard(device="auto")``
uses once torch is imported. Figures taken at an OOM (while the failed
micro-batch still holds its memory) are handed to the guard through
``oomguard.errors``' figures hook, which this module installs when imported.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _oomguard as _C
from .. import budget as _budget
from .. import errors as _errors

__all__ = ["TorchDevice", "memory_figures"]


class TorchDevice(_C.Device):
    """The guard's view of torch's memory: ``torch.cuda.memory_stats`` on a CUDA
    device (allocated, reserved, peak, inactive split, alloc retries, OOMs;
    total and free from ``torch.cuda.mem_get_info``), and the counts of
    ``oomguard.budget`` on the CPU (allocated, peak, refused allocations; the
    budget as total) while it is installed, or its caching allocator's figures
    when it is installed as one; zeros otherwise.

    ``device``: a CUDA device, ``"cpu"``, or None (the default): the current
    CUDA device once CUDA is initialised, else the CPU. ``release_caches``
    empties torch's CUDA cache when CUDA is in use, the budget's caching
    allocator's when that is installed.
    """

    def __init__(self, device: Any = None) -> None:
        super().__init__()
        self._device = None if device is None else torch.device(device)
        # The guard asks several times per step: what never changes is looked up once.
        self._cuda_possible = self._device is None and torch.cuda.is_available()

    def _cuda_index(self) -> Optional[int]:
        d = self._device
        if d is not None:
            if d.type != "cuda":
                return None
            return d.index if d.index is not None else torch.cuda.current_device()
        if self._cuda_possible and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return None

    def name(self) -> str:
        index = self._cuda_index()
        return "cpu" if index is None else f"cuda:{index}"

    def stats(self) -> _C.MemoryStats:
        index = self._cuda_index()
        if _errors._figures_at_oom.__dict__:
            # The guard asks right after an OOM: the figures at the failure.
            at_oom = _errors._take_figures_at_oom("cpu" if index is None else f"cuda:{index}")
            if at_oom is not None:
                return at_oom
        return _cpu_figures() if index is None else _cuda_figures(index)

    def release_caches(self) -> None:
        if self._cuda_index() is not None:
            torch.cuda.empty_cache()
        elif _budget.caching_device():
            _budget.release_caches()

    def reset_peak(self) -> None:
        index = self._cuda_index()
        if index is not None:
            torch.cuda.reset_peak_memory_stats(index)
        elif _budget.installed():
            _budget.reset_peak()


def _cuda_figures(index: int) -> _C.MemoryStats:
    # Keys of torch.cuda.memory_stats as torch 1.13 through 2.x name them; a
    # key a build lacks (expandable segments, another allocator backend)
    # reads as 0 rather than failing the figures.
    s = _C.MemoryStats()
    m = torch.cuda.memory_stats(index)
    s.allocated = int(m.get("allocated_bytes.all.current", 0))
    s.reserved = int(m.get("reserved_bytes.all.current", 0))
    s.peak_allocated = int(m.get("allocated_bytes.all.peak", 0))
    s.active = int(m.get("active_bytes.all.current", 0))
    s.inactive_split = int(m.get("inactive_split_bytes.all.current", 0))
    s.num_alloc_retries = int(m.get("num_alloc_retries", 0))
    s.num_ooms = int(m.get("num_ooms", 0))
    free, total = torch.cuda.mem_get_info(index)
    s.total, s.free = int(total), int(free)
    return s


def _cpu_figures() -> _C.MemoryStats:
    """The budgeted CPU allocator's counts while it is installed, else zeros."""
    s = _C.MemoryStats()
    if _budget.caching_device():
        for key, value in _budget.device_stats().items():
            setattr(s, key, int(value))
    elif _budget.installed():
        s.allocated = s.reserved = s.active = _budget.allocated()
        s.peak_allocated = _budget.peak()
        s.num_ooms = _budget.ooms()
        limit = _budget.budget()
        if limit > 0:
            s.total = limit
            s.free = max(0, limit - s.allocated)
    return s


def memory_figures() -> dict:
    """Every device's figures now, keyed as ``TorchDevice.name()`` says ("cpu",
    "cuda:0"): taken when an OOM is classified, while the failed micro-batch
    still holds its memory."""
    figures = {"cpu": _cpu_figures()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        figures[f"cuda:{index}"] = _cuda_figures(index)
    return figures


if memory_figures not in _errors._figures_hooks:
    _errors._figures_hooks.append(memory_figures)
