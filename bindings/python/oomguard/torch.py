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
  * accumulates under DDP's ``no_sync`` and synchronises gradients itself in
    ``commit``, which runs only after every rank voted that it is ready: a rank
    that hit an OOM (and is still splitting) never leaves the others blocked
    inside a gradient all-reduce;
  * marks phases, so completed micro-batches are kept after an OOM in forward
    and gradients are zeroed and the step redone after an OOM in backward.

Checkpoints of model, optimizer and RNG state go through the C++ checkpointer
(``register_state``); a coordinator over torch.distributed
(``TorchDistributedCoordinator``) lets ranks agree once per step.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
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
        self._loss = 0.0
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
        self._loss = 0.0
        guard = self.guard

        def micro(mb: _C.MicroBatch) -> None:
            parts = [b[mb.offset:mb.offset + mb.size] for b in batch]
            # Gradients accumulate locally; commit synchronises them after the vote.
            with self.model.no_sync() if self._ddp else contextlib.nullcontext():
                guard.mark_phase("forward")
                loss = self._forward(self.model, *parts)
                guard.mark_phase("backward")
                (loss * mb.weight).backward()
            self._loss += float(loss.detach()) * mb.weight

        self.last_report = guard.step(n, micro, self._commit, self._reset, costs)
        self.last_loss = self._loss
        return self._loss

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _reset(self) -> None:
        self._zero_grad()
        self._loss = 0.0

    def _commit(self) -> None:
        if self._sync:
            self._all_reduce_gradients()
        self.guard.mark_phase("optimizer")
        self.optimizer.step()

    def _all_reduce_gradients(self) -> None:
        params = [p for p in _unwrap(self.model).parameters() if p.requires_grad]
        # Every rank must contribute the same tensors in the same order.
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


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
    """The guard's per-step agreement over torch.distributed (gloo on CPU, nccl on GPU).

    The vote is one all-reduce of VOTE_WORDS int64 with MAX. Every collective
    waits at most its deadline (``Work.wait(timeout)``); after a timeout the
    coordinator is broken and later calls fail at once, as the C++ contract
    says: exit with ``oomguard.EXIT_COORDINATION_TIMEOUT`` and let the launcher
    restart every rank.

    Thread-safety: called by the guard on the training thread (with the GIL).
    """

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
        # Allocated once: the vote must not need memory on a rank that just ran out of it.
        self._words = torch.zeros(_C.VOTE_WORDS, dtype=torch.int64, device=self._device)
        self._broken: Optional[str] = None

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def engine(self) -> str:
        return "torch.distributed"

    def _wait(self, work: Any, deadline_s: float, what: str) -> None:
        try:
            work.wait(timeout=timedelta(seconds=deadline_s))
        except RuntimeError as e:
            self._broken = f"{what} did not complete within {deadline_s:.3f} s: {e}"
            raise TimeoutError(self._broken) from None

    def _check(self) -> None:
        if self._broken is not None:
            raise TimeoutError(f"coordinator is broken: {self._broken}")

    def vote(self, vote_input: _C.VoteInput, deadline_s: float) -> _C.VoteResult:
        self._check()
        words = _C.pack_vote(vote_input)
        for i, w in enumerate(words):
            self._words[i] = w
        work = dist.all_reduce(self._words, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._wait(work, deadline_s, "vote")
        return _C.unpack_vote(self._words.tolist())

    def gather_memory(self, mine: _C.RankMemory, deadline_s: float) -> list:
        self._check()
        t = torch.tensor([mine.rank, mine.allocated, mine.reserved, mine.peak_allocated],
                         dtype=torch.int64, device=self._device)
        out = [torch.zeros_like(t) for _ in range(self._size)]
        self._wait(dist.all_gather(out, t, group=self._group, async_op=True), deadline_s, "gather_memory")
        return [_C.RankMemory(*(int(v) for v in r.tolist())) for r in out]

    def barrier(self, deadline_s: float) -> None:
        self._check()
        self._wait(dist.barrier(group=self._group, async_op=True), deadline_s, "barrier")

    def broadcast(self, data: bytes, root: int, deadline_s: float) -> bytes:
        self._check()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        self._wait(dist.broadcast(size, root, group=self._group, async_op=True), deadline_s, "broadcast")
        n = int(size.item())
        if self._rank == root:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device) if n else \
                torch.zeros(0, dtype=torch.uint8, device=self._device)
        else:
            payload = torch.zeros(n, dtype=torch.uint8, device=self._device)
        if n:
            self._wait(dist.broadcast(payload, root, group=self._group, async_op=True), deadline_s, "broadcast")
        return bytes(payload.cpu().numpy().tobytes())

    def allreduce_sum(self, array: Any, deadline_s: float) -> None:
        self._check()
        host = torch.from_numpy(array)  # the caller's buffer
        t = host if self._device.type == "cpu" else host.to(self._device)
        self._wait(dist.all_reduce(t, group=self._group, async_op=True), deadline_s, "allreduce_sum")
        if t is not host:
            host.copy_(t.cpu())

    def abort(self) -> None:
        self._broken = self._broken or "aborted"
