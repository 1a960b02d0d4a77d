"""oomguard.torch: a guarded train_step for PyTorch.

    import oomguard.torch as ogt
    train_step = ogt.TrainStep(model, optimizer, torch.nn.functional.mse_loss,
                               initial_micro_batch=64)
    for step in range(steps):
        loss = train_step(inputs[step], targets[step])

What TrainStep does per optimizer step:
  * splits the batch into micro-batches (dim 0) that fit, and multiplies each
    micro-batch's mean loss by its weight (size / batch), so the accumulated
    gradient equals the whole batch's;
  * accumulates under DDP's ``no_sync`` and lets the guard sum the gradients
    (and the loss) over ranks after its vote, every rank in the same
    collective whatever failed where, then steps the optimizer only when every
    rank's sum succeeded: a rank that hit an OOM never leaves the others
    blocked inside a gradient all-reduce, and no rank updates alone;
  * marks phases, so completed micro-batches are kept after an OOM in forward
    and gradients are zeroed and the step redone after an OOM in backward.

Checkpoints of model, optimizer and RNG state go through the C++ checkpointer
(``register_state``); a coordinator over torch.distributed
(``TorchDistributedCoordinator``) carries the guard's collectives.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import _oomguard as _C
from ._guard import Guard
from .checkpoint import Checkpointer

__all__ = ["TrainStep", "TorchDistributedCoordinator", "register_state", "flat_parameters"]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _distributed_world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class TrainStep:
    """A model, an optimizer and a loss, turned into a guarded train_step.

    Args:
        model: the module (a DistributedDataParallel wrapper is accepted; build
            it with ``broadcast_buffers=False`` if the model has buffers, since
            a buffer broadcast inside forward would be a collective before the vote).
        optimizer: steps the parameters in ``commit``.
        loss_fn: ``loss_fn(model(inputs), targets)`` -> mean loss of a micro-batch.
        forward: instead of ``loss_fn``: ``forward(model, *batch_slices)`` -> mean loss.
        guard: an ``oomguard.Guard``; by default one is made from ``guard_options``.
        sync_gradients: all-reduce (mean) gradients in commit. Default: when
            torch.distributed is initialised with more than one rank. Each rank
            must step the same number of samples.

    Call it with the batch tensors (split along dim 0): ``loss = step(x, y)``.
    It returns the batch's mean loss (a float); ``last_report`` holds the
    StepReport. Data for step ``guard.next_step`` must be reproducible from the
    step number: after a RolledBackError the loop continues from
    ``e.next_step``.

    Thread-safety: one thread calls a TrainStep.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        *,
        forward: Optional[Callable[..., torch.Tensor]] = None,
        guard: Optional[Guard] = None,
        sync_gradients: Optional[bool] = None,
        **guard_options: Any,
    ) -> None:
        if (loss_fn is None) == (forward is None):
            raise ValueError("give exactly one of loss_fn and forward")
        if guard is not None and guard_options:
            raise ValueError(f"guard options {sorted(guard_options)} given together with a guard")
        self.model = model
        self.optimizer = optimizer
        if forward is None:
            def forward(m: torch.nn.Module, inputs: Any, targets: Any) -> torch.Tensor:
                return loss_fn(m(inputs), targets)
        self._forward = forward
        self.guard = guard if guard is not None else Guard(**guard_options)
        self._ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self._ddp and getattr(model, "broadcast_buffers", False) and any(True for _ in model.buffers()):
            raise ValueError("DistributedDataParallel with broadcast_buffers=True broadcasts buffers inside "
                             "forward, a collective before the guard's vote; build it with broadcast_buffers=False")
        self._sync = (_distributed_world() > 1) if sync_gradients is None else sync_gradients
        self._loss: Optional[torch.Tensor] = None
        self.last_report: Optional[_C.StepReport] = None
        self.last_loss: Optional[float] = None

    def __call__(self, *batch: torch.Tensor, costs: Optional[Sequence[int]] = None) -> float:
        if not batch:
            raise ValueError("TrainStep needs at least one batch tensor")
        n = len(batch[0])
        for b in batch[1:]:
            if len(b) != n:
                raise ValueError(f"batch tensors differ in length along dim 0 ({n} vs {len(b)})")
        self._zero_grad()
        self._loss = None
        guard = self.guard

        def micro(mb: _C.MicroBatch) -> None:
            parts = [b[mb.offset:mb.offset + mb.size] for b in batch]
            # Gradients accumulate locally; the guard sums them after its vote.
            with self.model.no_sync() if self._ddp else contextlib.nullcontext():
                guard.mark_phase("forward")
                loss = self._forward(self.model, *parts)
                guard.mark_phase("backward")
                (loss * mb.weight).backward()
            # On the loss's device: no host sync per micro-batch.
            part = loss.detach().to(torch.float64) * mb.weight
            self._loss = part if self._loss is None else self._loss + part

        self.last_report = guard.step(n, micro, self._apply, self._reset, costs,
                                      sync=self._sync_buffers if self._sync else None)
        self.last_loss = 0.0 if self._loss is None else float(self._loss)
        return self.last_loss

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _reset(self) -> None:
        self._zero_grad()
        self._loss = None

    def _sync_buffers(self) -> list:
        """What the guard sums over ranks: every gradient and the loss. Runs
        before the vote, so that whatever it allocates (the gradient of a
        parameter no micro-batch touched) is allocated while an OOM can still
        go through the ladder."""
        params = [p for p in _unwrap(self.model).parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._loss is None:
            self._loss = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
        return [p.grad for p in params] + [self._loss]

    def _apply(self) -> None:
        self.guard.mark_phase("optimizer")
        self.optimizer.step()


# ---- checkpoints ----

def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu")


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


def register_state(
    ckpt: Checkpointer,
    *,
    model: Optional[torch.nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    rng: bool = True,
    model_prefix: str = "model",
) -> None:
    """Registers training state with a Checkpointer.

    Model parameters and buffers that are contiguous CPU tensors are registered
    by address at ``/model/<name>`` (no copy; they must keep their storage).
    Other model tensors and the optimizer state (whose tensors the optimizer
    creates lazily and replaces on load_state_dict) are stored as objects
    (``/model.other``, ``/optimizer``), as is the RNG state (``/rng``: torch,
    CUDA, Python and NumPy generators).
    """
    if model is not None:
        module = _unwrap(model)
        by_address = {}
        other = {}
        for name, t in module.state_dict(keep_vars=True).items():
            t = t.detach()  # same storage
            if t.device.type == "cpu" and t.is_contiguous() and t.dtype != torch.bfloat16:
                by_address[name] = t
            else:
                other[name] = t
        for name, t in by_address.items():
            ckpt.add_tensor(f"{model_prefix}/{name}", t)
        if other:
            def save_other() -> bytes:
                return _to_bytes({k: v.detach().cpu() for k, v in other.items()})

            def load_other(data: bytes) -> None:
                with torch.no_grad():
                    for k, v in _from_bytes(data).items():
                        other[k].copy_(v)

            ckpt.add_object(f"{model_prefix}.other", save_other, load_other)
    if optimizer is not None:
        ckpt.add_object("optimizer", lambda: _to_bytes(optimizer.state_dict()),
                        lambda data: optimizer.load_state_dict(_from_bytes(data)))
    if rng:
        ckpt.add_object("rng", _rng_state, _set_rng_state)


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """Every tensor of the state_dict, in its order, flattened into one float64 tensor."""
    tensors = [t.detach().reshape(-1).to(torch.float64).cpu() for t in _unwrap(model).state_dict().values()]
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.float64)


# ---- the coordinator over torch.distributed ----

class TorchDistributedCoordinator(_C.Coordinator):
    """The guard's transport over torch.distributed (gloo on CPU, nccl on GPU).

    The guard's protocol runs over two collectives: an all-gather of small
    int64 records (votes, agreements) and an in-place sum of the step's sync
    buffers, each rank's contribution scaled by its own factor. Every
    collective is asynchronous and its completion is polled against the
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
        # A first collective now, so that the backend's own buffers exist too.
        self._wait([dist.all_reduce(self._mine[:1], group=self._group, async_op=True)], 600.0, "warm-up")

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def engine(self) -> str:
        return "torch.distributed"

    def _wait(self, works: Sequence[Any], deadline_s: float, what: str) -> None:
        if self._broken is not None:
            raise TimeoutError(f"coordinator is broken: {self._broken}")
        until = time.monotonic() + deadline_s
        pause = 20e-6
        pending = list(works)
        while pending:
            pending = [w for w in pending if not w.is_completed()]
            if not pending:
                break
            if time.monotonic() >= until:
                self._broken = f"{what} did not complete within {deadline_s:.3f} s"
                raise TimeoutError(self._broken)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        for w in works:
            try:
                w.wait()  # completed: returns at once, or raises the collective's own error
            except RuntimeError as e:
                self._broken = f"{what} failed: {e}"
                raise TimeoutError(self._broken) from None

    def allgather(self, mine: Any, deadline_s: float) -> list:
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

    def abort(self) -> None:
        self._broken = self._broken or "aborted"
