"""oomguard.torch: a guarded train_step for PyTorch.

    import oomguard.torch as ogt
    train_step = ogt.TrainStep(model, optimizer, torch.nn.functional.mse_loss,
                               initial_micro_batch=64)
    for step in range(steps):
        loss = train_step(inputs[step], targets[step])

What TrainStep does per optimizer step:
  * splits the batch (tensors, and dicts, lists and tuples of them, along dim
    0) into micro-batches that fit, and multiplies each micro-batch's mean
    loss by its weight, so that the accumulated gradient equals the whole
    batch's: the weight is the micro-batch's share of the samples, or of the
    loss units (valid tokens) when ``loss_units`` says how many each sample has;
  * accumulates under DDP's ``no_sync`` and lets the guard sum the gradients
    (and the loss) over ranks after its vote, every rank in the same
    collective whatever failed where, then runs the optimizer step (with
    gradient clipping, a GradScaler and an LR scheduler when given) only when
    every rank's sum succeeded: a rank that hit an OOM never leaves the others
    blocked inside a gradient all-reduce, and no rank updates alone;
  * marks phases, so completed micro-batches are kept after an OOM in forward
    and gradients are zeroed and the step redone after an OOM in backward;
  * keeps the loss on its device: one host synchronisation per step.

Checkpoints of model, optimizer, scheduler, scaler and RNG state go through
the C++ checkpointer (``register_state``); ``StepBatchSampler`` and
``StepLoader`` keep a ``torch.utils.data.DataLoader`` at the guard's step
across rollbacks; ``TorchDevice`` gives incidents torch's memory figures; a
coordinator over torch.distributed (``TorchDistributedCoordinator``) carries
the guard's collectives.
"""

from __future__ import annotations

import contextlib
import io
import math
import random
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _oomguard as _C
from . import budget as _budget
from . import errors as _errors
from ._guard import Guard
from .checkpoint import Checkpointer

__all__ = [
    "StepBatchSampler",
    "StepLoader",
    "TorchDevice",
    "TorchDistributedCoordinator",
    "TrainStep",
    "flat_parameters",
    "register_state",
    "split_batch",
]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _distributed_world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _model_device(model: torch.nn.Module) -> Optional[torch.device]:
    for p in _unwrap(model).parameters():
        return p.device
    return None


# ---- batches ----

def _batch_samples(batch: Sequence[Any]) -> Optional[int]:
    """The length along dim 0 shared by every tensor of the batch (None: no tensor).
    Raises ValueError naming the first tensor that disagrees."""
    found: List[Any] = []  # [length, path]

    def visit(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 0:
                return  # a scalar is not per-sample: passed to every micro-batch as it is
            if not found:
                found.extend([obj.shape[0], path])
            elif obj.shape[0] != found[0]:
                raise ValueError(f"batch tensors differ in length along dim 0: {found[1]} has {found[0]}, "
                                 f"{path} has {obj.shape[0]}")
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                visit(v, f"{path}[{k!r}]")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, f"{path}[{i}]")

    for i, part in enumerate(batch):
        visit(part, f"batch[{i}]")
    return found[0] if found else None


def split_batch(obj: Any, start: int, stop: int) -> Any:
    """Samples ``[start, stop)`` of a batch: tensors sliced along dim 0 (views, no
    copy), dicts, lists and tuples (named ones too) split item by item, anything
    else (0-dim tensors, numbers, strings, None) passed unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.dim() == 0 else obj[start:stop]
    if isinstance(obj, Mapping):
        items = {k: split_batch(v, start, stop) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:  # a mapping type that is not built from a dict (defaultdict, ...)
            return items
    if isinstance(obj, tuple):
        items = [split_batch(v, start, stop) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [split_batch(v, start, stop) for v in obj]
    return obj


class TrainStep:
    """A model, an optimizer and a loss, turned into a guarded train_step.

    Args:
        model: the module (a DistributedDataParallel wrapper is accepted; build
            it with ``broadcast_buffers=False`` if the model has buffers, since
            a buffer broadcast inside forward would be a collective before the vote).
        optimizer: stepped once per step, after every rank's gradients are summed.
        loss_fn: ``loss_fn(model(inputs), targets)`` -> mean loss of a micro-batch.
        forward: instead of ``loss_fn``: ``forward(model, *batch_slices)`` -> the
            micro-batch's mean loss (over its samples, or its loss units).
        guard: an ``oomguard.Guard``; by default one is made from ``guard_options``
            (with a ``TorchDistributedCoordinator`` when torch.distributed has
            several ranks, and a ``TorchDevice`` for the model's device).
        sync_gradients: sum gradients and the loss over ranks through the guard.
            Default: when the guard has more than one rank.
        loss_units: ``loss_units(*batch)`` -> the loss units (e.g. valid tokens,
            ``lambda x, y: (y != -1).sum()``), either one number for the slice it
            is given or one count per sample. The mean loss is then over units:
            each micro-batch is weighed by its share of the global batch's units,
            across micro-batches and ranks, so the gradient is exact however the
            batch is split (a mean over samples would drift with padding).
            Computed once per step (one transfer of the counts to the host).
        split: ``split(part, start, stop)`` -> samples ``[start, stop)`` of one
            positional batch argument, for batch types ``split_batch`` does not
            know; give ``samples=`` when the batch holds no tensor.
        scheduler: an LR scheduler stepped after each optimizer step that was
            not skipped.
        scaler: a ``torch.cuda.amp.GradScaler`` (or ``torch.amp.GradScaler``):
            losses are scaled before backward, gradients unscaled before
            clipping; a step it skips (inf/NaN gradients) is no OOM, steps
            neither the optimizer nor the scheduler, and sets ``skipped``.
        clip_grad_norm: clip the summed gradients to this total norm before the
            optimizer step (``torch.nn.utils.clip_grad_norm_``).
        before_apply, after_apply: called without arguments before the optimizer
            step (after the gradients were summed over ranks) and after it.

    Call it with the batch: ``loss = step(x, y)`` or ``step({"input_ids": ...})``.
    It returns the global batch's mean loss (over samples or units, over every
    rank) as a float; ``last_report`` holds the StepReport. Data for step
    ``guard.next_step`` must be reproducible from the step number: after a
    RolledBackError the loop continues from ``e.next_step`` (``StepLoader``
    does this for a DataLoader).

    With a ``Checkpointer`` as the guard's recovery, register the scheduler and
    the scaler too (``register_state``): a rollback restores all of it, or the
    scheduler would run ahead of the restored weights (ValueError otherwise).

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
        loss_units: Optional[Callable[..., Any]] = None,
        split: Optional[Callable[[Any, int, int], Any]] = None,
        scheduler: Optional[Any] = None,
        scaler: Optional[Any] = None,
        clip_grad_norm: Optional[float] = None,
        before_apply: Optional[Callable[[], Any]] = None,
        after_apply: Optional[Callable[[], Any]] = None,
        **guard_options: Any,
    ) -> None:
        if (loss_fn is None) == (forward is None):
            raise ValueError("give exactly one of loss_fn and forward")
        if guard is not None and guard_options:
            raise ValueError(f"guard options {sorted(guard_options)} given together with a guard")
        for name, fn in (("loss_fn", loss_fn), ("forward", forward), ("loss_units", loss_units), ("split", split),
                         ("before_apply", before_apply), ("after_apply", after_apply)):
            if fn is not None and not callable(fn):
                raise TypeError(f"TrainStep({name}=...) must be callable, got {type(fn).__name__}")
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
            raise ValueError(f"TrainStep(clip_grad_norm=...) must be a positive number, got {clip_grad_norm!r}")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"TrainStep(scheduler=...) has no step(): {type(scheduler).__name__}")
        if scaler is not None:
            missing = [m for m in ("scale", "unscale_", "step", "update", "get_scale")
                       if not callable(getattr(scaler, m, None))]
            if missing:
                raise TypeError(f"TrainStep(scaler=...) is not a GradScaler: {type(scaler).__name__} lacks {missing}")
        self.model = model
        self.optimizer = optimizer
        self._uses_loss_fn = forward is None
        if forward is None:
            def forward(m: torch.nn.Module, inputs: Any, targets: Any) -> torch.Tensor:
                return loss_fn(m(inputs), targets)
        self._forward = forward
        self._loss_units = loss_units
        self._split = split
        self.scheduler = scheduler
        self.scaler = scaler
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.before_apply = before_apply
        self.after_apply = after_apply
        if guard is None:
            if _distributed_world() > 1 and guard_options.get("coordinator") is None:
                guard_options["coordinator"] = TorchDistributedCoordinator()
            if "device" not in guard_options:
                guard_options["device"] = TorchDevice(_model_device(model))
            guard = Guard(**guard_options)
        self.guard = guard
        guard_world = getattr(guard, "world_size", 1)
        if _distributed_world() > 1 and guard_world == 1 and sync_gradients is not False:
            raise ValueError(f"torch.distributed has {_distributed_world()} ranks but the guard has one: give it "
                             "Guard(coordinator=oomguard.torch.TorchDistributedCoordinator()), or the ranks' "
                             "gradients are never summed")
        self._check_registered(getattr(guard, "recovery", None))
        self._ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self._ddp and getattr(model, "broadcast_buffers", False) and any(True for _ in model.buffers()):
            raise ValueError("DistributedDataParallel with broadcast_buffers=True broadcasts buffers inside "
                             "forward, a collective before the guard's vote; build it with broadcast_buffers=False")
        self._sync = guard_world > 1 if sync_gradients is None else bool(sync_gradients)
        self._loss: Optional[torch.Tensor] = None
        self.last_report: Optional[_C.StepReport] = None
        self.last_loss: Optional[float] = None
        self.skipped = False  # the GradScaler skipped the last optimizer step (inf/NaN gradients)

    def _check_registered(self, recovery: Any) -> None:
        registered = getattr(recovery, "registered", None)
        if not registered:
            return
        for label, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if obj is not None and not any(v is obj for v in registered.values()):
                raise ValueError(f"the {label} is not registered with the guard's Checkpointer: after a rollback it "
                                 f"would be ahead of the restored weights; call "
                                 f"register_state(ckpt, ..., {label}={label})")

    def __call__(self, *batch: Any, costs: Optional[Sequence[int]] = None, samples: Optional[int] = None) -> float:
        if not batch:
            raise ValueError("TrainStep needs a batch")
        if self._uses_loss_fn and len(batch) != 2:
            raise ValueError(f"TrainStep with loss_fn takes (inputs, targets), got {len(batch)} batch arguments; "
                             "give forward=lambda model, *batch: loss for other batches")
        n = _batch_samples(batch)
        if samples is not None:
            if n is not None and n != samples:
                raise ValueError(f"samples={samples} but the batch tensors hold {n}")
            n = samples
        if n is None:
            raise ValueError("the batch holds no tensor with a dim 0 to split along: give samples= (and split=)")
        split = self._split or split_batch

        def part(start: int, stop: int) -> list:
            return [split(b, start, stop) for b in batch]

        units = self._units(batch, n, part) if self._loss_units is not None else None
        prefix = None
        if units is not None:
            prefix = [0]
            for u in units:
                prefix.append(prefix[-1] + u)
        if costs is not None and isinstance(costs, torch.Tensor):
            costs = costs.tolist()
        self._zero_grad()
        self._loss = None
        guard = self.guard

        def micro(mb: _C.MicroBatch) -> None:
            if prefix is not None and prefix[mb.offset + mb.size] == prefix[mb.offset]:
                return  # no loss units: nothing to add, and its mean would be 0/0
            parts = part(mb.offset, mb.offset + mb.size)
            # Gradients accumulate locally; the guard sums them after its vote.
            with self.model.no_sync() if self._ddp else contextlib.nullcontext():
                guard.mark_phase("forward")
                loss = self._forward(self.model, *parts)
                guard.mark_phase("backward")
                weighted = loss * mb.weight
                (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
            # On the loss's device: no host sync per micro-batch.
            contribution = loss.detach().to(torch.float64) * mb.weight
            if self._loss is None:
                self._loss = contribution
            else:
                self._loss.add_(contribution)

        self.last_report = guard.step(n, micro, self._apply, self._reset, costs, units=units,
                                      sync=self._sync_buffers if self._sync else None)
        self.last_loss = math.nan if self._loss is None else float(self._loss)  # the step's one host sync
        return self.last_loss

    def _units(self, batch: Sequence[Any], n: int, part: Callable[[int, int], list]) -> List[int]:
        """Per-sample loss units as host ints, from one call of loss_units on the
        batch (a count per sample) or one per sample (a number per slice), with
        a single transfer to the host."""
        whole = torch.as_tensor(self._loss_units(*batch))
        if whole.dim() == 1 and whole.numel() == n:
            counts = whole.tolist()
            total = None
        elif whole.dim() == 0:
            per = [torch.as_tensor(self._loss_units(*part(i, i + 1)), device=whole.device).reshape(1)
                   for i in range(n)]
            both = torch.cat(per + [whole.reshape(1)]).tolist()
            counts, total = both[:-1], both[-1]
        else:
            raise ValueError(f"loss_units returned shape {tuple(whole.shape)}; expected one number for the slice "
                             f"or one count per sample ({n})")
        out = []
        for i, c in enumerate(counts):
            if c < 0 or c != int(c):
                raise ValueError(f"loss_units: sample {i} has {c} units; counts are whole numbers >= 0")
            out.append(int(c))
        if total is not None and sum(out) != total:
            raise ValueError(f"loss_units gives {total} units for the batch but {sum(out)} summed over its samples: "
                             "it must count units (a sum over samples), not average them")
        return out

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _reset(self) -> None:
        self._zero_grad()
        self._loss = None

    def _sync_buffers(self) -> list:
        """What the guard sums over ranks: every gradient and the loss, in place
        (no flattened copy). Runs before the vote, so that whatever it allocates
        (the gradient of a parameter no micro-batch touched) is allocated while
        an OOM can still go through the ladder."""
        params = [p for p in _unwrap(self.model).parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._loss is None:
            self._loss = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
        return [p.grad for p in params] + [self._loss]

    def _apply(self) -> None:
        self.guard.mark_phase("optimizer")
        if self.before_apply is not None:
            self.before_apply()
        scaler = self.scaler
        self.skipped = False
        if scaler is None:
            self._clip()
            self.optimizer.step()
        else:
            before = scaler.get_scale()
            scaler.unscale_(self.optimizer)
            try:
                self._clip()
                scaler.step(self.optimizer)
            except BaseException:
                # unscale_ left per-optimizer state that only update() clears;
                # without it the redone step's unscale_ would refuse to run.
                # (A rollback then restores the scaler's registered state.)
                with contextlib.suppress(Exception):
                    scaler.update()
                raise
            scaler.update()
            self.skipped = scaler.get_scale() < before
        if self.scheduler is not None and not self.skipped:
            self.scheduler.step()
        if self.after_apply is not None:
            self.after_apply()

    def _clip(self) -> None:
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in _unwrap(self.model).parameters() if p.grad is not None],
                                           self.clip_grad_norm)


# ---- data: a DataLoader that follows the guard's step ----

class StepBatchSampler:
    """A batch sampler whose batch ``k`` is a pure function of ``(seed, k)``, for
    ``DataLoader(dataset, batch_sampler=StepBatchSampler(...))``.

    Batch ``k`` holds dataset indices ``[j*B, (j+1)*B)`` of epoch ``e``'s
    permutation (``e, j = divmod(k, batches_per_epoch)``; seeded with
    ``seed + e``, or in order with ``shuffle=False``); with several ranks this
    rank yields its contiguous share of it (``rank``/``world_size``, default
    torch.distributed's). Iteration starts at ``start`` (``StepLoader`` sets it
    to the guard's next step) and runs for ``steps`` batches in all, or forever.
    """

    def __init__(self, dataset_size: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, steps: Optional[int] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None) -> None:
        if dataset_size < 1 or batch_size < 1:
            raise ValueError(f"StepBatchSampler needs dataset_size >= 1 and batch_size >= 1 "
                             f"(got {dataset_size}, {batch_size})")
        if drop_last and batch_size > dataset_size:
            raise ValueError(f"batch_size {batch_size} > dataset_size {dataset_size} with drop_last: no batch")
        if rank is None and world_size is None and _distributed_world() > 1:
            rank, world_size = dist.get_rank(), dist.get_world_size()
        self.rank = 0 if rank is None else rank
        self.world_size = 1 if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"StepBatchSampler: rank {self.rank} is not in [0, {self.world_size})")
        if batch_size < self.world_size:
            raise ValueError(f"batch_size {batch_size} is smaller than the {self.world_size} ranks")
        if steps is not None and steps < 0:
            raise ValueError(f"StepBatchSampler(steps={steps}) must be >= 0")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.steps = steps
        self.start = 0
        full, rest = divmod(dataset_size, batch_size)
        self.batches_per_epoch = full + (1 if rest and not drop_last else 0)
        self._epoch = -1
        self._order: List[int] = []

    def global_batch(self, step: int) -> List[int]:
        """Dataset indices of step ``step``'s whole batch (every rank's)."""
        epoch, j = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(self.dataset_size, generator=g).tolist()
            else:
                self._order = list(range(self.dataset_size))
            self._epoch = epoch
        return self._order[j * self.batch_size:(j + 1) * self.batch_size]

    def batch(self, step: int) -> List[int]:
        """This rank's share of step ``step``'s batch."""
        whole = self.global_batch(step)
        n = len(whole)
        return whole[self.rank * n // self.world_size:(self.rank + 1) * n // self.world_size]

    def __iter__(self) -> Iterator[List[int]]:
        start = self.start  # read now: the DataLoader may draw batches ahead, in its own time
        stop = self.steps

        def batches() -> Iterator[List[int]]:
            k = start
            while stop is None or k < stop:
                yield self.batch(k)
                k += 1

        return batches()

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("a StepBatchSampler without steps= has no length")
        return max(0, self.steps - self.start)


class StepLoader:
    """Iterates a DataLoader at the guard's step, across rollbacks and resumes.

        sampler = ogt.StepBatchSampler(len(dataset), batch_size=64, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        for batch in ogt.StepLoader(loader, guard, steps=1000):
            try:
                train_step(*batch)
            except oomguard.RolledBackError:
                pass   # the next batch is the one of guard.next_step

    Each batch it yields is the one of ``guard.next_step``. When the guard's
    step is not the one after the batch it yielded last (a rollback, a resume,
    a step the loop skipped), the DataLoader's iterator is dropped (its workers
    stop) and a new one starts at the guard's step. Stops when ``guard.next_step``
    reaches ``steps`` (or when the sampler ends).
    """

    def __init__(self, loader: Any, guard: Guard, steps: Optional[int] = None) -> None:
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, StepBatchSampler):
            raise TypeError("StepLoader needs a DataLoader built with batch_sampler=StepBatchSampler(...), so that "
                            "it can start at any step")
        self.loader = loader
        self.sampler = sampler
        self.guard = guard
        self.steps = steps
        self.restarts = 0  # iterators started after the first (rollbacks, skipped steps)

    def __iter__(self) -> Iterator[Any]:
        it: Optional[Iterator[Any]] = None
        at = -1
        first = True
        while self.steps is None or self.guard.next_step < self.steps:
            step = self.guard.next_step
            if it is None or step != at:
                it = None  # drop the old iterator (and its prefetched batches) first
                self.sampler.start = step
                it = iter(self.loader)
                at = step
                self.restarts += 0 if first else 1
                first = False
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch
            at += 1


# ---- memory figures ----

class TorchDevice(_C.Device):
    """The guard's view of torch's memory: ``torch.cuda.memory_stats`` on a CUDA
    device (allocated, reserved, peak, inactive split, alloc retries, OOMs;
    total and free from ``torch.cuda.mem_get_info``), and the counts of
    ``oomguard.budget`` on the CPU (allocated, peak, refused allocations; the
    budget as total) while it is installed; zeros otherwise.

    ``device``: a CUDA device, ``"cpu"``, or None (the default): the current
    CUDA device once CUDA is initialised, else the CPU. ``release_caches``
    empties torch's CUDA cache when CUDA is in use.
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

    def reset_peak(self) -> None:
        index = self._cuda_index()
        if index is not None:
            torch.cuda.reset_peak_memory_stats(index)
        elif _budget.installed():
            _budget.reset_peak()


def _cuda_figures(index: int) -> _C.MemoryStats:
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
    if _budget.installed():
        s.allocated = s.reserved = s.active = _budget.allocated()
        s.peak_allocated = _budget.peak()
        s.num_ooms = _budget.ooms()
        limit = _budget.budget()
        if limit > 0:
            s.total = limit
            s.free = max(0, limit - s.allocated)
    return s


def _figures_now() -> dict:
    """Every device's figures, keyed as TorchDevice.name() says: taken when an
    OOM is classified, while the failed micro-batch still holds its memory."""
    figures = {"cpu": _cpu_figures()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        figures[f"cuda:{index}"] = _cuda_figures(index)
    return figures


_errors._figures_hooks.append(_figures_now)


# ---- checkpoints ----

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
    registered = getattr(ckpt, "registered", None)
    if registered is not None:
        registered[path] = obj


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

    Model parameters and buffers that are contiguous CPU tensors are registered
    by address at ``/model/<name>`` (no copy; they must keep their storage).
    Other model tensors and the optimizer state (whose tensors the optimizer
    creates lazily and replaces on load_state_dict) are stored as objects
    (``/model.other``, ``/optimizer``), as are the LR scheduler (``/scheduler``),
    the GradScaler (``/scaler``), every ``extra`` object with
    ``state_dict``/``load_state_dict`` (``/<keyword>``) and the RNG state
    (``/rng``: torch, CUDA, Python and NumPy generators).
    """
    registered = getattr(ckpt, "registered", None)
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
        if registered is not None:
            registered[model_prefix] = module
    if optimizer is not None:
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
