"""A byte budget on torch's CPU allocator: real torch OOMs without a GPU.

    import torch, oomguard.budget
    with oomguard.budget.limit(64 << 20):   # allocations beyond 64 MiB raise torch's OOM
        train()

The budget counts live bytes of CPU tensors allocated while it is installed
(tensors that existed before are not counted). Over budget, torch raises its
own out-of-memory error (torch.OutOfMemoryError), exactly as a real
allocation failure would.

``limit(n, caching_device=True)`` makes the budget the capacity of a
simulated caching allocator, as a GPU's is: freed blocks stay reserved, new
requests are carved from cached segments, and the free bytes stranded in
partly used segments can make a request fail below the budget
(fragmentation). Its OOM is worded as torch words a device OOM, with the
capacity, free, allocated and reserved-but-unallocated figures, and
``device_stats()`` gives the same figures. ``hold(n)`` then takes memory
outside torch, as another process sharing the device would::

    with oomguard.budget.limit(64 << 20, caching_device=True), oomguard.budget.hold(16 << 20):
        train()   # 48 MiB left for torch; the figures show 16 MiB held outside it

Built only when the package was compiled against libtorch
(OOMGUARD_BUILD_TORCH_BUDGET); ``available()`` says whether it was.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

try:
    import torch as _torch  # noqa: F401  (c10 must be loaded before the extension)
    from . import _budget
except ImportError:  # built without it, or torch is missing
    _budget = None

__all__ = ["available", "install", "installed", "uninstall", "limit", "allocated", "peak", "reset_peak", "ooms",
           "live_blocks", "budget", "caching_device", "device_stats", "release_caches", "hold", "Held"]


def available() -> bool:
    return _budget is not None


def _module():
    if _budget is None:
        raise RuntimeError("oomguard was built without the budgeted CPU allocator "
                           "(needs libtorch at build time: OOMGUARD_BUILD_TORCH_BUDGET)")
    return _budget


def install(budget_bytes: int, caching_device: bool = False) -> None:
    """Routes torch CPU allocations through a budget of ``budget_bytes`` (0: count only).

    ``caching_device``: the budget is the capacity of a simulated caching
    allocator (see the module's description); needs a positive budget."""
    _module().install(int(budget_bytes), bool(caching_device))


def installed() -> bool:
    """Whether the budget currently wraps torch's CPU allocator."""
    return _budget is not None and _budget.installed()


def uninstall() -> None:
    """Restores torch's previous CPU allocator (tensors allocated meanwhile stay valid)."""
    _module().uninstall()


@contextlib.contextmanager
def limit(budget_bytes: int, caching_device: bool = False) -> Iterator[None]:
    install(budget_bytes, caching_device)
    try:
        yield
    finally:
        uninstall()


def caching_device() -> bool:
    """Whether the budget is installed as a simulated caching allocator."""
    return _budget is not None and _budget.caching_device()


def device_stats() -> dict:
    """The caching allocator's figures (total, free, allocated, reserved,
    inactive_split, num_alloc_retries, ...); zeros outside that mode. Memory
    held with ``hold`` is neither allocated nor reserved: it shows as
    capacity that is neither reserved nor free."""
    return _module().device_stats()


def release_caches() -> None:
    """Returns the caching allocator's free segments (as torch.cuda.empty_cache)."""
    _module().release_caches()


class Held:
    """Memory taken outside torch with ``hold``; ``release()`` (or leaving the
    ``with`` block) gives it back."""

    def __init__(self, nbytes: int) -> None:
        self._handle: Optional[int] = _module().hold(int(nbytes))

    def release(self) -> None:
        if self._handle is not None:
            _module().release(self._handle)
            self._handle = None

    def __enter__(self) -> "Held":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold(nbytes: int) -> Held:
    """Takes ``nbytes`` of real host memory outside torch, counted against the
    caching allocator's capacity as another process sharing the device would.
    Raises MemoryError when it does not fit, ValueError outside caching-device mode."""
    return Held(nbytes)


def budget() -> int:
    """The budget in bytes (0: unlimited, counting only)."""
    return _module().budget()


def allocated() -> int:
    return _module().allocated()


def peak() -> int:
    return _module().peak()


def reset_peak() -> None:
    _module().reset_peak()


def live_blocks() -> int:
    """Blocks alive that were allocated through the budget."""
    return _module().live_blocks()


def ooms() -> int:
    """Allocations refused since the module was loaded."""
    return _module().ooms()
