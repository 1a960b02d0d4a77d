"""oomguard.Guard: one optimizer step that survives out-of-memory errors."""

from __future__ import annotations

import gc
import sys
from typing import Any, Callable, Optional, Sequence, Union

from . import _oomguard as _C
from . import errors as _errors

Phase = _C.Phase
MicroBatch = _C.MicroBatch
StepReport = _C.StepReport

_PHASES = {p.name: p for p in Phase.__members__.values()}


def _release_cuda_cache() -> None:
    # Only when CUDA is in use: torch.cuda.empty_cache would otherwise create a
    # CUDA context (hundreds of MiB) in a CPU-only process.
    torch = sys.modules.get("torch")
    if torch is None:
        return
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available() and cuda.is_initialized():
        cuda.empty_cache()


def _sum_buffer(value: Any):
    """(data pointer, element count, dtype name, CUDA device or -1) of a buffer
    a step's ``sync`` returns: a contiguous torch.Tensor or NumPy array."""
    from .checkpoint import _describe

    dtype, shape, ptr, location = _describe(value)
    count = 1
    for d in shape:
        count *= d
    device = -1
    if location == "cuda":
        device = value.device.index if value.device.index is not None else 0
    return ptr, count, dtype, device


def _auto_device() -> Optional[_C.Device]:
    # Only when torch is already imported: `import oomguard` never imports it.
    if "torch" not in sys.modules:
        return None
    from .torch.device import TorchDevice

    return TorchDevice()


_UNLIMITED = (1 << 63) - 1  # the C++ side's "no limit known yet" (INT64_MAX)


def _native(obj: Any) -> Any:
    """The compiled object behind a Python wrapper (Checkpointer), or obj itself."""
    return getattr(obj, "native", obj)


class Guard:
    """Runs optimizer steps so that out-of-memory errors inside them are survived
    without changing the result.

    The keyword arguments mirror the C++ ``oomguard::GuardOptions`` (same names,
    same defaults). ``coordinator`` (an ``oomguard.Coordinator``, e.g.
    ``oomguard.torch.TorchDistributedCoordinator``), ``knowledge_base`` (an
    ``oomguard.KnowledgeBase``) and ``recovery`` (an ``oomguard.Checkpointer``)
    are kept alive by the guard.

    ``controller`` chooses the micro-batch limit: ``"predictive"`` fits the
    device's memory figures (peak per micro-batch, reserved, free) and jumps to
    the largest size predicted to fit; ``"search"`` halves on OOM and then
    binary-searches upwards. Without figures both behave as ``"search"``.

    ``device`` (an ``oomguard.Device``) gives incidents and votes their memory
    figures and releases the allocator's cache before a retry. The default,
    ``"auto"``, is ``oomguard.torch.TorchDevice()`` when torch is imported
    (torch.cuda.memory_stats on CUDA, the ``oomguard.budget`` counts on CPU)
    and none otherwise; ``None`` turns it off.

    On every OOM, before the retry, the guard calls its cache releasers in
    order: ``gc.collect`` (``collect_garbage``), then those added with
    ``add_cache_releaser``, then the device's ``release_caches``
    (``torch.cuda.empty_cache`` when CUDA is in use). Without a device,
    ``empty_cuda_cache`` adds ``torch.cuda.empty_cache`` after ``gc.collect``.
    By then the OOM exception, its traceback and the frames holding tensors
    have been dropped.

    A ``recovery`` Checkpointer must have this guard's rank and world size
    (ValueError otherwise): two ranks writing one shard would corrupt it.

    Thread-safety: one thread drives a Guard. ``step`` releases the GIL while
    the C++ side runs (planning, waiting for other ranks), so other Python
    threads keep running; the callbacks run on the calling thread, with the GIL.
    """

    def __init__(
        self,
        *,
        initial_micro_batch: int = 0,
        min_micro_batch: int = 1,
        max_micro_batch: int = 0,
        grow_after: int = 10,
        grow_tolerance: float = 0.05,
        forget_bad_after: int = 500,
        controller: str = "predictive",
        max_ooms_per_step: int = 32,
        max_rollbacks_per_step: int = 3,
        retry_after_release: bool = True,
        history_steps: int = 32,
        uniform_micro_batch: bool = False,
        vote_deadline_ms: int = 60000,
        run_id: str = "",
        workload: str = "",
        coordinator: Optional[_C.Coordinator] = None,
        knowledge_base: Optional[_C.KnowledgeBase] = None,
        recovery: Any = None,
        device: Any = "auto",
        collect_garbage: bool = True,
        empty_cuda_cache: bool = True,
    ) -> None:
        o = _C.GuardOptions()
        o.initial_micro_batch = initial_micro_batch
        o.min_micro_batch = min_micro_batch
        o.max_micro_batch = max_micro_batch
        o.grow_after = grow_after
        o.grow_tolerance = grow_tolerance
        o.forget_bad_after = forget_bad_after
        o.controller = controller
        o.max_ooms_per_step = max_ooms_per_step
        o.max_rollbacks_per_step = max_rollbacks_per_step
        o.retry_after_release = retry_after_release
        o.history_steps = history_steps
        o.uniform_micro_batch = uniform_micro_batch
        o.vote_deadline_ms = vote_deadline_ms
        o.run_id = run_id
        o.workload = workload
        rank, world = (0, 1) if coordinator is None else (coordinator.rank(), coordinator.size())
        ckpt_rank = getattr(recovery, "rank", None)
        ckpt_world = getattr(recovery, "world_size", None)
        if isinstance(ckpt_rank, int) and isinstance(ckpt_world, int) and (ckpt_rank, ckpt_world) != (rank, world):
            raise ValueError(f"the recovery Checkpointer is rank {ckpt_rank} of {ckpt_world}, the guard's "
                             f"coordinator rank {rank} of {world}: create the Checkpointer after "
                             "torch.distributed is initialised, or give it rank= and world_size=")
        if isinstance(device, str):
            if device != "auto":
                raise ValueError(f"device must be an oomguard.Device, None or 'auto' (got {device!r})")
            device = _auto_device()
        if device is not None and not isinstance(device, _C.Device):
            raise TypeError(f"device must be an oomguard.Device, got {type(device).__name__}")
        self._recovery = recovery  # the wrapper too, so its callbacks stay alive
        self._coordinator = coordinator
        self.device = device
        self.native = _C.Guard(
            o,
            coordinator=coordinator,
            knowledge_base=knowledge_base,
            recovery=None if recovery is None else _native(recovery),
            device=device,
        )
        if collect_garbage:
            self.native.add_cache_releaser("python.gc", gc.collect)
        if empty_cuda_cache and device is None:
            self.native.add_cache_releaser("torch.cuda.empty_cache", _release_cuda_cache)

    def step(
        self,
        samples: int,
        micro: Callable[[MicroBatch], Any],
        apply: Optional[Callable[[], Any]] = None,
        reset: Optional[Callable[[], Any]] = None,
        costs: Optional[Sequence[int]] = None,
        *,
        units: Optional[Sequence[int]] = None,
        sync: Optional[Callable[[], Sequence[Any]]] = None,
    ) -> StepReport:
        """Runs one optimizer step of ``samples`` samples.

        ``micro(mb)`` does forward and backward of samples
        ``[mb.offset, mb.offset + mb.size)`` (``mb.slice``) with the mean loss
        multiplied by ``mb.weight``. ``sync()`` (several ranks) returns the
        buffers to sum over ranks — contiguous tensors or arrays, the
        gradients and the loss — after the micro-batches and before the vote:
        the guard sums them in place after a vote every rank passed, each
        rank's contribution scaled by its share of the global batch, so they
        hold the global batch's mean. ``apply()`` steps the optimizer, once,
        after every rank's sync succeeded. ``reset()`` zeroes what the
        micro-batches accumulated (needed to redo a step after an OOM in
        backward, or after another rank failed before its apply).
        ``costs``: optional per-sample costs (e.g. tokens); the micro-batch
        limit is then in cost units. ``units``: optional per-sample loss units
        (e.g. valid tokens): weights become shares of units instead of samples.

        Returns the StepReport. Raises OutOfMemoryError (unrecoverable, here or
        on another rank), RolledBackError (continue from ``e.next_step``),
        CoordinationTimeoutError, PeerFailedError (another rank stopped with an
        error), FailedPreconditionError (an OOM after backward and no reset),
        and any other exception the callbacks raise, unchanged (after the other
        ranks were told).
        """
        self._prepare_recovery()
        _errors._forget_figures_at_oom()  # figures of an OOM no guard asked about are stale now
        return self.native.step(samples, micro, apply, reset, None if costs is None else list(costs),
                                None if units is None else [int(u) for u in units], sync)

    def evaluate(
        self,
        samples: int,
        micro: Callable[[MicroBatch], Any],
        costs: Optional[Sequence[int]] = None,
        *,
        units: Optional[Sequence[int]] = None,
    ) -> StepReport:
        """Runs one batch of evaluation on this rank, split into micro-batches that fit.

        ``micro(mb)`` runs the forward of samples ``[mb.offset, mb.offset +
        mb.size)`` and keeps its result (a mean over the micro-batch is
        weighed by ``mb.weight``). An OOM releases caches, halves the
        evaluation's own limit (``eval_micro_limit``: it starts at the
        training limit and grows back after clean batches) and calls ``micro``
        again for the micro-batches not yet done; completed ones are not
        repeated. Each OOM is an incident in the knowledge base (phase
        "eval"). Not collective: nothing is agreed with other ranks and
        nothing is rolled back, since nothing of the model changes.

        Returns the StepReport; raises OutOfMemoryError when a micro-batch of
        one sample does not fit, and any other exception ``micro`` raises.
        ``oomguard.torch.evaluate`` builds on this for tensors.
        """
        _errors._forget_figures_at_oom()
        return self.native.evaluate(samples, micro, None if costs is None else list(costs),
                                    None if units is None else [int(u) for u in units])

    def _prepare_recovery(self) -> None:
        prepare = getattr(self._recovery, "prepare", None)
        if prepare is not None:
            prepare()

    def resume(self) -> Optional[int]:
        """Starts a run from its checkpoints (collective): every rank restores the
        newest checkpoint that every rank holds and can load and returns its step
        (``next_step`` becomes the one after); None when no checkpoint is common
        to every rank (start from scratch). Needs ``recovery``."""
        from .errors import CheckpointNotFoundError

        self._prepare_recovery()
        try:
            return self.native.resume()
        except CheckpointNotFoundError:
            return None

    def finish(self) -> int:
        """Ends the run (collective): waits for the checkpoint saves in flight and agrees
        with every rank on the newest checkpoint complete everywhere; returns its step (-1: none)."""
        self._prepare_recovery()
        return self.native.finish()

    def mark_phase(self, phase: Union[str, Phase]) -> None:
        """Marks what the code inside ``micro``/``apply`` is doing: "data",
        "forward", "backward", "optimizer", ... (incidents carry it; completed
        micro-batches are kept after an OOM in "data" or "forward")."""
        if isinstance(phase, str):
            try:
                phase = _PHASES[phase]
            except KeyError:
                raise ValueError(f"unknown phase {phase!r}; one of {sorted(_PHASES)}") from None
        self.native.mark_phase(phase)

    def add_cache_releaser(self, name: str, release: Callable[[], Any]) -> None:
        """Adds a function called on every OOM before the retry (after the built-in ones)."""
        self.native.add_cache_releaser(name, release)

    @property
    def next_step(self) -> int:
        """The number of the next step (advances on success; set it after resuming)."""
        return self.native.next_step

    @next_step.setter
    def next_step(self, step: int) -> None:
        self.native.next_step = step

    @property
    def rank(self) -> int:
        return 0 if self._coordinator is None else self._coordinator.rank()

    @property
    def world_size(self) -> int:
        """Ranks taking part in each step (1 without a coordinator)."""
        return 1 if self._coordinator is None else self._coordinator.size()

    @property
    def recovery(self) -> Any:
        """The ``recovery`` given at creation (a Checkpointer), or None."""
        return self._recovery

    @property
    def micro_limit(self) -> Optional[int]:
        """The micro-batch limit the next step will use (samples, or cost units
        with ``costs``); None while no limit is known: every step then runs
        whole (in one micro-batch) until an OOM sets one, or up to
        ``max_micro_batch``."""
        limit = self.native.micro_limit
        return None if limit >= _UNLIMITED else limit

    @micro_limit.setter
    def micro_limit(self, limit: Optional[int]) -> None:
        self.native.micro_limit = _UNLIMITED if limit is None else limit

    @property
    def eval_micro_limit(self) -> Optional[int]:
        """The limit the next ``evaluate`` will use (None: none known yet)."""
        limit = self.native.eval_micro_limit
        return None if limit >= _UNLIMITED else limit

    @property
    def total_ooms(self) -> int:
        return self.native.total_ooms

    @property
    def run_id(self) -> str:
        return self.native.run_id

    @property
    def options(self) -> _C.GuardOptions:
        return self.native.options
