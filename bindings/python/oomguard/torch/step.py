"""The guarded step for PyTorch: ``TrainStep`` turns a model, an optimizer and a
loss into a train_step that survives out-of-memory errors with the same
result, and ``evaluate`` runs an evaluation batch the same way.

    import oomguard.torch as ogt
    train_step = ogt.TrainStep(model, optimizer, torch.nn.functional.mse_loss,
                               initial_micro_batch=64)
    for step in range(steps):
        loss = train_step(inputs[step], targets[step])

Per optimizer step, TrainStep:
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
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .. import _oomguard as _C
from .._guard import Guard
from . import _evidence
from . import ddp as _ddp
from . import distributed as _distributed
from . import fsdp as _fsdp
from ._model import ddp_of, model_device, unwrap
from .device import TorchDevice
from .distributed import TorchDistributedCoordinator

__all__ = ["TrainStep", "evaluate", "split_batch", "batch_samples"]


def batch_samples(batch: Sequence[Any]) -> Optional[int]:
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


def _splitter(batch: Sequence[Any], samples: Optional[int],
              split: Optional[Callable[[Any, int, int], Any]]) -> Tuple[int, Callable[[int, int], list]]:
    """The batch's sample count (``samples`` when given, checked against the
    tensors) and ``part(start, stop)``: samples ``[start, stop)`` of every
    positional batch argument."""
    n = batch_samples(batch)
    if samples is not None:
        if n is not None and n != samples:
            raise ValueError(f"samples={samples} but the batch tensors hold {n}")
        n = samples
    if n is None:
        raise ValueError("the batch holds no tensor with a dim 0 to split along: give samples= (and split=)")
    cut = split or split_batch

    def part(start: int, stop: int) -> list:
        return [cut(b, start, stop) for b in batch]

    return n, part


def _units(loss_units: Callable[..., Any], batch: Sequence[Any], n: int, part: Callable[[int, int], list]) -> List[int]:
    """Per-sample loss units as host ints, from one call of loss_units on the
    batch (a count per sample) or one per sample (a number per slice), with
    a single transfer to the host."""
    whole = torch.as_tensor(loss_units(*batch))
    if whole.dim() == 1 and whole.numel() == n:
        counts = whole.tolist()
        total = None
    elif whole.dim() == 0:
        per = [torch.as_tensor(loss_units(*part(i, i + 1)), device=whole.device).reshape(1)
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
        ddp_overlap: with a DistributedDataParallel model (several ranks): the
            last micro-batch's backward runs with DDP's sync on, so its
            bucketed all-reduce overlaps backward, through a comm hook this
            registers on the model (``oomguard.torch.ddp``); the step stays
            atomic across ranks and the gradient the global batch's. Default
            False: every micro-batch under ``no_sync``, the guard sums after.

    Call it with the batch: ``loss = step(x, y)`` or ``step({"input_ids": ...})``.
    It returns the global batch's mean loss (over samples or units, over every
    rank) as a float; ``last_report`` holds the StepReport. Data for step
    ``guard.next_step`` must be reproducible from the step number: after a
    RolledBackError the loop continues from ``e.next_step`` (``StepLoader``
    does this for a DataLoader).

    With a ``Checkpointer`` as the guard's recovery, register the scheduler and
    the scaler too (``register_state``): a rollback restores all of it, or the
    scheduler would run ahead of the restored weights (ValueError otherwise).

    What the loop does after a step (metrics, evaluation, logging) is not in
    the checkpoint of that step, which is taken inside the step, after the
    optimizer: after a rollback to step S, or a resume from S, the loop's
    own record runs on from where it was. The layout that stays right:
    keep what must survive in an object with ``state_dict``/``load_state_dict``
    registered with the checkpointer (``register_state(ckpt, ..., metrics=m)``),
    update it in ``after_apply`` (which runs inside the step, before the
    checkpoint), and redo what depends on step S (an evaluation of S) when
    ``guard.next_step`` comes back to S + 1 after a RolledBackError or a
    resume. ``oomguard.torch.fit`` does all of this.

    ``evaluate(*batch)`` runs the forward on an evaluation batch under
    ``torch.no_grad()``, split the same way and guarded (``Guard.evaluate``).

    Exactness: with a mean loss the accumulated gradient equals the whole
    batch's, and the parameters the plain loop's, within rounding. Two things
    depend on the split and cannot be exact: dropout masks (a micro-batch draws
    its own, so runs that split differently differ like runs with another
    seed) and BatchNorm's batch statistics (computed per micro-batch; use
    GroupNorm/LayerNorm, or accept the drift).

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
        fsdp_sync: str = "every",
        fsdp_agreement: str = "data",
        ddp_overlap: bool = False,
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
        _evidence.watch_model(unwrap(model))
        self._uses_loss_fn = forward is None
        if forward is None:
            def forward(m: torch.nn.Module, inputs: Any, targets: Any) -> torch.Tensor:
                return loss_fn(m(inputs), targets)
        self.forward = forward
        self._loss_units = loss_units
        self._split = split
        self.scheduler = scheduler
        self.scaler = scaler
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.before_apply = before_apply
        self.after_apply = after_apply
        fsdp = _fsdp.is_fsdp(unwrap(model))
        if fsdp:
            # Every rank must shrink the same way after an abandoned micro-batch (docs/distributed.md).
            fsdp_options = _fsdp.GUARD_OPTIONS
            if guard is None:
                guard_options = {**fsdp_options, **guard_options}
            for name, want in fsdp_options.items():
                have = getattr(guard.options, name) if guard is not None else guard_options[name]
                if have != want:
                    raise ValueError(f"a model sharded with fully_shard needs a guard with {name}={want!r} (got "
                                     f"{have!r}): every rank must shrink its micro-batches the same way")
            if scaler is not None:
                raise ValueError("TrainStep with a GradScaler is not supported on a model sharded with fully_shard")
            if fsdp_sync not in ("every", "last"):
                raise ValueError(f"fsdp_sync must be 'every' or 'last', got {fsdp_sync!r}")
            if fsdp_agreement not in ("data", "check"):
                raise ValueError(f"fsdp_agreement must be 'data' or 'check', got {fsdp_agreement!r}")
        if guard is None:
            if _distributed.world_size() > 1 and guard_options.get("coordinator") is None:
                guard_options["coordinator"] = TorchDistributedCoordinator()
            if "device" not in guard_options:
                guard_options["device"] = TorchDevice(model_device(model))
            guard = Guard(**guard_options)
        self.guard = guard
        guard_world = getattr(guard, "world_size", 1)
        if _distributed.world_size() > 1 and guard_world == 1 and sync_gradients is not False:
            raise ValueError(f"torch.distributed has {_distributed.world_size()} ranks but the guard has one: give it "
                             "Guard(coordinator=oomguard.torch.TorchDistributedCoordinator()), or the ranks' "
                             "gradients are never summed")
        self._check_registered(getattr(guard, "recovery", None))
        self._ddp = ddp_of(model)
        if self._ddp is not None and getattr(self._ddp, "broadcast_buffers", False) and \
                any(True for _ in self._ddp.buffers()):
            raise ValueError("DistributedDataParallel with broadcast_buffers=True broadcasts buffers inside "
                             "forward, a collective before the guard's vote; build it with broadcast_buffers=False")
        self._sync = guard_world > 1 if sync_gradients is None else bool(sync_gradients)
        self._fsdp = (_fsdp.FsdpAgreement(unwrap(model), deadline_s=guard.options.vote_deadline_ms / 1000.0,
                                          sync_every=fsdp_sync == "every", mode=fsdp_agreement)
                      if fsdp else None)
        if self._fsdp is not None:
            self._fsdp.coordinator = getattr(guard, "_coordinator", None)
        self._overlap: Optional[_ddp.DdpOverlap] = None
        if ddp_overlap:
            if self._fsdp is not None:
                raise ValueError("ddp_overlap=True is for DistributedDataParallel, not for a model sharded with fully_shard")
            if self._ddp is None or guard_world < 2 or not self._sync:
                raise ValueError("ddp_overlap=True needs a DistributedDataParallel model and a guard with several "
                                 "ranks that sums gradients (sync_gradients not False)")
            self._overlap = _ddp.DdpOverlap(self._ddp, getattr(guard, "_coordinator", None),
                                            lambda: guard.next_step)
        self._done: List[Tuple[int, int, float]] = []  # micro-batches accumulated in this attempt (overlap)
        self._local_units = 0.0
        self._loss: Optional[torch.Tensor] = None
        self._loss_host: Optional[torch.Tensor] = None  # the overlap mode's loss, as the vote sums it
        self.last_report: Optional[_C.StepReport] = None
        self.last_loss: Optional[float] = None
        self.skipped = False  # the GradScaler skipped the last optimizer step (inf/NaN gradients)
        self.skipped_steps = 0  # steps the GradScaler skipped since creation

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
        n, part = _splitter(batch, samples, self._split)

        units = _units(self._loss_units, batch, n, part) if self._loss_units is not None else None
        prefix = None
        if units is not None:
            prefix = [0]
            for u in units:
                prefix.append(prefix[-1] + u)
        if costs is not None and isinstance(costs, torch.Tensor):
            costs = costs.tolist()
        self._zero_grad()
        self._loss = None
        self._loss_host = None
        self._done = []
        self._local_units = float(prefix[-1] if prefix is not None else n)
        guard = self.guard
        overlap = self._overlap
        fsdp = self._fsdp
        if fsdp is not None:
            if costs is not None:
                raise ValueError("costs= is not supported on a model sharded with fully_shard: every rank must "
                                 "run the same micro-batches")
            fsdp.begin_step(n, None if prefix is None else prefix[-1])

        def run(offset: int, size: int, weight: float, synced: bool = False, marks: bool = True) -> None:
            parts = part(offset, offset + size)
            # Gradients accumulate locally (the guard sums them after its
            # vote), except in the DDP overlap mode's round (ddp.py).
            with contextlib.nullcontext() if synced or self._ddp is None else self._ddp.no_sync():
                if marks:
                    guard.mark_phase("forward")
                loss = self.forward(self.model, *parts)
                if marks:
                    guard.mark_phase("backward")
                weighted = loss * weight
                if synced:
                    # The loss first: once backward has sent the round's
                    # status, nothing of this micro-batch may be left to fail.
                    add_loss(loss, weight)
                    overlap.begin_round()
                if fsdp is not None:
                    # FSDP averages over ranks: weigh by this rank's share of the global units.
                    fsdp.ensure_checked()
                    weighted = weighted * (fsdp.world * fsdp.local_units / fsdp.global_units)
                    fsdp.backward = True
                (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
            if not synced:
                add_loss(loss, weight)

        def add_loss(loss: torch.Tensor, weight: float) -> None:
            # On the loss's device: no host sync per micro-batch.
            contribution = loss.detach().to(torch.float64) * weight
            if self._loss is None:
                self._loss = contribution
            else:
                self._loss.add_(contribution)

        def micro(mb: _C.MicroBatch) -> None:
            if overlap is not None:
                return self._overlap_micro(mb, n, prefix, run)
            empty = prefix is not None and prefix[mb.offset + mb.size] == prefix[mb.offset]
            if fsdp is not None:
                if empty:
                    raise ValueError(f"micro-batch [{mb.offset}, {mb.offset + mb.size}) has no loss units: under "
                                     "fully_shard every rank must run every micro-batch's collectives")
                last = mb.offset + mb.size == n
                sq_norm = self._grad_params if self.clip_grad_norm is not None else None
                fsdp.run_micro(lambda: run(mb.offset, mb.size, mb.weight), last,
                               None if sq_norm is None else lambda: fsdp.local_sq_norm(sq_norm()),
                               guard.mark_phase)
            elif not empty:  # no loss units: nothing to add, and its mean would be 0/0
                run(mb.offset, mb.size, mb.weight)

        if overlap is not None:
            overlap.start_step(self._local_units, guard.options.vote_deadline_ms / 1000.0)
            overlap.open_attempt()
        try:
            self.last_report = guard.step(n, micro, self._apply, self._reset, costs, units=units,
                                          sync=self._sync_buffers if self._sync else None)
        finally:
            if overlap is not None:
                overlap.close_attempt()
        self.last_loss = math.nan if self._loss is None else float(self._loss)  # the step's one host sync
        return self.last_loss

    @property
    def loss_tensor(self) -> Optional[torch.Tensor]:
        """The step's mean loss as a float64 tensor on the loss's device: the
        global batch's (summed over ranks) from ``before_apply`` on, this
        rank's share while the micro-batches run; None before the first."""
        return self._loss

    def evaluate(self, *batch: Any, forward: Optional[Callable[..., Any]] = None, costs: Optional[Sequence[int]] = None,
                 samples: Optional[int] = None, report_to: Optional[list] = None) -> Any:
        """The model's output on an evaluation batch, computed in micro-batches
        that fit (``Guard.evaluate``: an OOM halves the evaluation's own limit
        and re-runs what was not done; nothing is rolled back) under
        ``torch.no_grad()``. ``forward(model, *batch_slices)`` defaults to the
        TrainStep's loss; see ``oomguard.torch.evaluate`` for how outputs are
        combined. The model's train/eval mode is the caller's."""
        if self._fsdp is not None:
            raise ValueError("TrainStep.evaluate on a model sharded with fully_shard is not supported: the guarded "
                             "evaluation is per rank, while FSDP's all-gathers need every rank in lockstep")
        return evaluate(self.model, *batch, forward=forward or self.forward, guard=self.guard,
                        loss_units=self._loss_units, split=self._split, costs=costs, samples=samples,
                        report_to=report_to)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        if self._fsdp is not None:
            self._fsdp.clear_gradients()

    def _grad_params(self) -> list:
        return [p for p in unwrap(self.model).parameters() if p.grad is not None]

    def _overlap_micro(self, mb: _C.MicroBatch, n: int, prefix: Optional[List[int]], run: Callable[..., None]) -> None:
        """A micro-batch in the DDP overlap mode: under no_sync, except the
        rank's last one, whose backward is the round (ddp.py). A round that
        another rank must redo is redone here, at this rank's sizes."""
        ov = self._overlap
        if not ov.attempt_open:
            ov.open_attempt()  # the guard redoes the step on every rank after its sum (an OOM at commit/sync)
        if ov.round_result is not None:
            return  # the round ended (the gradients are the global batch's) or the step goes to the vote
        empty = prefix is not None and prefix[mb.offset + mb.size] == prefix[mb.offset]
        if mb.offset + mb.size < n:
            if not empty:
                run(mb.offset, mb.size, mb.weight)
                self._done.append((mb.offset, mb.size, mb.weight))
            return
        while True:
            if not empty:
                try:
                    run(mb.offset, mb.size, mb.weight, synced=True)
                except Exception as e:
                    if ov.comm_error is not None:
                        raise ov.lost_peer(ov.comm_error) from e
                    if ov.owes_round and ov.status_sent:
                        # Past the status (while backward waited on the round):
                        # every bucket of this rank went out, the round completes
                        # here; the guard then hears of the error.
                        ov.end_round(failed=True)
                        if ov.late_error is not None:
                            raise ov.late_error from None
                    raise
            ok, vote = ov.end_round()
            if ov.hook_error is not None:
                raise ov.hook_error  # the round said "redo": the guard re-plans this rank
            if ok or vote:
                return
            # Another rank failed inside the round and redoes the step: so does
            # this rank, at its own sizes. An OOM from here on is in "backward"
            # for the guard, which then zeroes and re-plans the whole step.
            ov.clear_result()
            self.guard.mark_phase("backward")
            self._zero_grad()
            self._loss = None
            for offset, size, weight in self._done:
                run(offset, size, weight, marks=False)

    def _reset(self) -> None:
        ov = self._overlap
        if ov is not None:
            # After the guard's collectives (a rollback, or a redo of the step
            # on every rank) nothing is owed and the gradients just go: the
            # next micro-batch opens a new attempt. Before them:
            if ov.attempt_open:
                if ov.owes_round:
                    # This rank failed inside its round: the others get the
                    # rest of it as zeros with "redo" (or, past the status, the
                    # round completes here).
                    ov.end_round(_ddp.REDO, failed=True)
                if ov.round_result in (0, _ddp.VOTE):
                    # The round ended with the global gradients, or the step goes
                    # to the vote: the gradients stay, what the guard re-runs is skipped.
                    return
                ov.clear_result()  # "redo": every rank runs another round
        self._done = []
        self._zero_grad()
        self._loss = None

    def _sync_buffers(self) -> list:
        """What the guard sums over ranks: every gradient and the loss, in place
        (no flattened copy). Runs before the vote, so that whatever it allocates
        (the gradient of a parameter no micro-batch touched) is allocated while
        an OOM can still go through the ladder."""
        params = [p for p in unwrap(self.model).parameters() if p.requires_grad]
        if self._fsdp is not None or self._overlap is not None:
            # FSDP reduce-scattered the gradients inside the micro-batches, the
            # DDP overlap mode summed them in its round: only the loss is summed here.
            if self._loss is None:
                self._loss = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
            if self._overlap is not None:
                # The vote carries host memory only: on a GPU the loss would
                # need a sum of its own after the vote. Staged on the host (the
                # round's status already waited for the device), back in _apply.
                self._loss_host = self._loss.detach().to("cpu", copy=True)
                return [self._loss_host]
            return [self._loss]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._loss is None:
            self._loss = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
        return [p.grad for p in params] + [self._loss]

    def _apply(self) -> None:
        self.guard.mark_phase("optimizer")
        if self._loss_host is not None:
            self._loss.copy_(self._loss_host)  # the global loss, summed in the vote
            self._loss_host = None
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
            self.skipped_steps += int(self.skipped)
        if self.scheduler is not None and not self.skipped:
            self.scheduler.step()
        if self.after_apply is not None:
            self.after_apply()

    def _clip(self) -> None:
        if self.clip_grad_norm is not None and self._fsdp is not None:
            # The norm came with the step's last agreement check: no collective here, where an OOM
            # on one rank would leave the others inside it. As clip_grad_norm_ computes it.
            total = math.sqrt(self._fsdp.sq_norm)
            coef = min(self.clip_grad_norm / (total + 1e-6), 1.0)
            with torch.no_grad():
                for p in self._grad_params():
                    p.grad.mul_(coef)
        elif self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in unwrap(self.model).parameters() if p.grad is not None],
                                           self.clip_grad_norm)


def _combine(parts: List[Any], path: str = "output") -> Any:
    """One batch's output from its micro-batches' ``(size, weight, output)``, in
    order: 0-dim tensors and numbers are means (weighted sum, in float64),
    tensors with a row per sample are concatenated, dicts, lists and tuples
    are combined item by item, None stays None."""
    first = parts[0][2]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return sum(v.detach().to(torch.float64) * w for _, w, v in parts)
        for size, _, v in parts:
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != size:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"evaluate: {path} is {shape} for a micro-batch of {size} samples: return one row "
                                 "per sample (concatenated) or a 0-dim mean over the micro-batch (averaged)")
        return torch.cat([v.detach() for _, _, v in parts])
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return math.fsum(float(v) * w for _, w, v in parts)
    if isinstance(first, Mapping):
        return {k: _combine([(s, w, v[k]) for s, w, v in parts], f"{path}[{k!r}]") for k in first}
    if isinstance(first, (tuple, list)):
        items = [_combine([(s, w, v[i]) for s, w, v in parts], f"{path}[{i}]") for i in range(len(first))]
        if isinstance(first, tuple):
            return type(first)(*items) if hasattr(first, "_fields") else tuple(items)
        return items
    raise TypeError(f"evaluate: {path} is a {type(first).__name__}; return tensors, numbers, or dicts, lists and "
                    "tuples of them")


def evaluate(model: torch.nn.Module, *batch: Any, forward: Callable[..., Any], guard: Guard,
             loss_units: Optional[Callable[..., Any]] = None, split: Optional[Callable[[Any, int, int], Any]] = None,
             costs: Optional[Sequence[int]] = None, samples: Optional[int] = None,
             report_to: Optional[list] = None) -> Any:
    """``forward(model, *batch)`` on an evaluation batch, in micro-batches that fit.

    Runs under ``torch.no_grad()`` through ``guard.evaluate``: an OOM releases
    caches, halves the evaluation's own limit (it starts at the training limit
    and grows back) and re-runs only the micro-batches not done; the incident
    is recorded in the guard's knowledge base. Nothing is agreed with other
    ranks, so ranks may evaluate different batches. The output is combined
    as if the batch had run whole: a 0-dim tensor (a mean over the
    micro-batch: over its samples, or its ``loss_units``) becomes the batch's
    mean, in float64; a tensor with one row per sample is concatenated; dicts,
    lists and tuples of those item by item. The model's train/eval mode is
    the caller's (``model.eval()`` first for dropout and BatchNorm).
    ``report_to``: a list that receives the batch's incidents.
    """
    if not batch:
        raise ValueError("evaluate needs a batch")
    n, part = _splitter(batch, samples, split)

    units = _units(loss_units, batch, n, part) if loss_units is not None else None
    if costs is not None and isinstance(costs, torch.Tensor):
        costs = costs.tolist()
    done: List[Any] = []

    def micro(mb: _C.MicroBatch) -> None:
        out = forward(model, *part(mb.offset, mb.offset + mb.size))
        done.append((mb.offset, mb.size, mb.weight, out))

    # no_grad around the whole guarded call: an OOM is classified inside it,
    # so the incident records that nothing was being recorded for autograd.
    with torch.no_grad():
        report = guard.evaluate(n, micro, costs=costs, units=units)
    if report_to is not None:
        report_to.extend(report.incidents)
    done.sort(key=lambda d: d[0])
    return _combine([(size, weight, out) for _, size, weight, out in done])
