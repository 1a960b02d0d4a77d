"""A byte budget on torch's CPU allocator: real torch OOMs without a GPU.

    import torch, oomguard.budget
    with oomguard.budget.limit(64 << 20):   # allocations beyond 64 MiB raise torch's OOM
        train()

The budget counts live bytes of CPU tensors allocated while it is installed
(tensors that existed before are not counted). Over budget, torch raises its
own out-of-memory error (torch.OutOfMemoryError), exactly as a real
allocation failure would.

Built only when the package was compiled against libtorch
(OOMGUARD_BUILD_TORCH_BUDGET); ``available()`` says whether it was.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

try:
    import torch as _torch  # noqa: F401  (c10 must be loaded before the extension)
    from . import _budget
except ImportError:  # built without it, or torch is missing
    _budget = None

__all__ = ["available", "install", "installed", "uninstall", "limit", "allocated", "peak", "reset_peak", "ooms",
           "live_blocks", "budget"]


def available() -> bool:
    return _budget is not None


def _module():
    if _budget is None:
        raise RuntimeError("oomguard was built without the budgeted CPU allocator "
                           "(needs libtorch at build time: OOMGUARD_BUILD_TORCH_BUDGET)")
    return _budget


def install(budget_bytes: int) -> None:
    """Routes torch CPU allocations through a budget of ``budget_bytes`` (0: count only)."""
    _module().install(int(budget_bytes))


def installed() -> bool:
    """Whether the budget currently wraps torch's CPU allocator."""
    return _budget is not None and _budget.installed()


def uninstall() -> None:
    """Restores torch's previous CPU allocator (tensors allocated meanwhile stay valid)."""
    _module().uninstall()


@contextlib.contextmanager
def limit(budget_bytes: int) -> Iterator[None]:
    install(budget_bytes)
    try:
        yield
    finally:
        uninstall()


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
