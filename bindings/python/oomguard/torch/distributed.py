"""torch.distributed as the guard's transport: ``TorchDistributedCoordinator``.

The guard's protocol runs over two collectives: an all-gather of small int64
records (votes, agreements) and an in-place sum of the step's sync buffers.
This module carries them over a torch.distributed process group (gloo on CPU,
nccl on GPU), each with a deadline, so that a peer that never arrives turns
into ``CoordinationTimeoutError`` (exit ``oomguard.EXIT_COORDINATION_TIMEOUT``)
instead of a hang.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _oomguard as _C

__all__ = ["TorchDistributedCoordinator", "world_size", "rank"]


def completed_by(works: Sequence[Any], deadline_s: float) -> bool:
    """Polls collectives (async work handles) until every one has completed
    (True) or ``deadline_s`` has passed (False). Polling, not ``wait()``: a
    lost peer would hold ``wait()`` until the process group's own timeout."""
    until = time.monotonic() + deadline_s
    pause = 20e-6
    pending = list(works)
    while pending:
        pending = [w for w in pending if not w.is_completed()]
        if not pending:
            break
        if time.monotonic() >= until:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True


def world_size() -> int:
    """Ranks of torch.distributed's default group (1 when it is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def rank() -> int:
    """This process's rank in torch.distributed's default group (0 when it is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


class TorchDistributedCoordinator(_C.Coordinator):
    """The guard's transport over torch.distributed (gloo on CPU, nccl on GPU).

    Every collective is asynchronous and its completion is polled against the
    deadline (``Work.is_completed``), so a peer that never arrives turns into
    a TimeoutError after the deadline even where ``Work.wait`` would block for
    the process group's own timeout. After a timeout the coordinator is
    broken and later calls fail at once, as the C++ contract says: exit with
    ``oomguard.EXIT_COORDINATION_TIMEOUT`` and let the launcher restart every rank.

    Everything a collective needs is allocated here, not in the vote that
    follows an out-of-memory error.

    Thread-safety: called by the guard on the training thread (with the GIL).
    """

    _RECORD_WORDS = 64    # words of one rank's record kept preallocated
    _STAGE_FLOATS = 64    # host buffers of a sum staged on the device (nccl)

    def __init__(self, group: Optional[Any] = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised (call init_process_group first)")
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        self._device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                        else torch.device("cpu"))
        self._mine = torch.zeros(self._RECORD_WORDS, dtype=torch.int64, device=self._device)
        self._records = torch.zeros(self._RECORD_WORDS * self._size, dtype=torch.int64, device=self._device)
        self._stage = (torch.zeros(self._STAGE_FLOATS, dtype=torch.float64, device=self._device)
                       if self._device.type == "cuda" else None)
        self._broken: Optional[str] = None
        self._before: Optional[Callable[[], None]] = None
        # A first collective now, so that the backend's own buffers exist too.
        self._wait([dist.all_reduce(self._mine[:1], group=self._group, async_op=True)], 600.0, "warm-up")

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def engine(self) -> str:
        return "torch.distributed"

    def set_before_collective(self, fn: Optional[Callable[[], None]]) -> None:
        """``fn()`` runs before each of the guard's collectives (``TrainStep``'s
        DDP overlap mode pays a gradient round this rank still owes there). An
        exception from it breaks the coordinator, like a failed collective."""
        self._before = fn

    def _run_before(self) -> None:
        if self._broken is not None:
            # Before issuing anything: a rank whose group is out of step must not send another collective.
            raise TimeoutError(f"coordinator is broken: {self._broken}")
        if self._before is not None:
            try:
                self._before()
            except Exception as e:  # noqa: BLE001 - a round that cannot complete is a coordination failure
                self._broken = f"the DDP round owed before this collective failed: {type(e).__name__}: {e}"
                raise TimeoutError(self._broken) from None

    def _wait(self, works: Sequence[Any], deadline_s: float, what: str) -> None:
        if self._broken is not None:
            raise TimeoutError(f"coordinator is broken: {self._broken}")
        if not completed_by(works, deadline_s):
            self._broken = f"{what} did not complete within {deadline_s:.3f} s"
            raise TimeoutError(self._broken)
        for w in works:
            try:
                w.wait()  # completed: returns at once, or raises the collective's own error
            except RuntimeError as e:
                self._broken = f"{what} failed: {e}"
                raise TimeoutError(self._broken) from None

    def allgather(self, mine: Any, deadline_s: float) -> list:
        self._run_before()
        n = len(mine)
        if n > self._mine.numel():  # a record larger than planned: grow once
            self._mine = torch.zeros(n, dtype=torch.int64, device=self._device)
            self._records = torch.zeros(n * self._size, dtype=torch.int64, device=self._device)
        src = self._mine[:n]
        src.copy_(torch.as_tensor(mine, dtype=torch.int64))
        out = [self._records[r * n:(r + 1) * n] for r in range(self._size)]
        self._wait([dist.all_gather(out, src, group=self._group, async_op=True)], deadline_s, "allgather")
        return self._records[:n * self._size].tolist()

    def allreduce_sum(self, buffers: Sequence[Any], deadline_s: float) -> None:
        self._run_before()
        works, staged, at = [], [], 0
        for buf, scale in buffers:
            t = buf if isinstance(buf, torch.Tensor) else torch.from_numpy(buf)
            if t.device != self._device:
                # Host status words on an nccl group: through the preallocated stage.
                if self._stage is None or at + t.numel() > self._stage.numel() or t.dtype != torch.float64:
                    raise ValueError(f"allreduce_sum: a {t.dtype} buffer on {t.device} with an nccl group "
                                     "(sync buffers must live on the group's device)")
                dev = self._stage[at:at + t.numel()]
                dev.copy_(t)
                staged.append((t, dev))
                at += t.numel()
                t = dev
            if scale != 1.0:
                t.mul_(scale)
            works.append(dist.all_reduce(t, group=self._group, async_op=True))
        self._wait(works, deadline_s, "allreduce_sum")
        for host, dev in staged:
            host.copy_(dev)

    def abort(self, reason: str = "aborted") -> None:
        """Every later collective fails at once, before it is issued."""
        self._broken = self._broken or reason
