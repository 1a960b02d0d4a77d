"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under the guard.

FSDP runs collectives inside every micro-batch: an all-gather before each
unit's forward (and again before its backward when it resharded after
forward) and a reduce-scatter after each unit's backward. An OOM on one rank
between two of them leaves the other ranks inside the next one until the
process group's timeout. ``TrainStep`` on a model sharded with ``fully_shard``
therefore runs every micro-batch under an *agreement*, installed as FSDP's
custom collectives (``set_custom_all_gather`` / ``set_custom_reduce_scatter``):

* **data mode** (the default, CPU/gloo): the flags ride inside FSDP's own
  collectives. Each all-gather's buffer has 24 spare bytes per rank (this
  rank's flag bits, loss units and sample count, sent after its shard; the
  rows are moved back to FSDP's layout after the collective), each
  reduce-scatter (an in-place all-reduce of FSDP's scratch input) one spare
  element (the sum of the flags). No collective of its own inside a
  micro-batch; the step's last micro-batch ends with one *check* (below),
  which also carries the gradient's squared norm for clipping.
* a rank that fails (an OOM in a unit's compute, in FSDP's buffer allocation,
  in the loss) knows which collective the others will run next from the
  **schedule**: the (kind, unit, input size, dtype) of a micro-batch's
  collectives in FSDP's call order, recorded in check mode (it does not depend
  on the micro-batch's size). After releasing the micro-batch (its frames,
  FSDP's unsharded parameters) it **replays** that collective with zeros and
  its flag: every rank reads the flag in the same collective and abandons the
  micro-batch there. A failure after a micro-batch's last collective replays
  the next micro-batch's first one, or answers the step's closing check.
  A replay that cannot allocate its buffers stops every rank
  (``FsdpReplayError``; the guard's coordinator is aborted, so the rank
  issues nothing more on the group that is now out of step).
* **check mode** (``TrainStep(fsdp_agreement="check")``, on non-CPU devices,
  and in data mode until a schedule is recorded, after the model's units
  changed, or for the rest of a micro-batch whose collectives stopped matching
  the schedule): a check (an all-reduce of 8 float64 words) before every FSDP
  collective; a failing rank answers the next check with its flag. On the CPU,
  gloo's all-gather allocates a temporary inside the collective: it is
  reserved beside FSDP's buffer before the check and released right before the
  collective (same peak). While a schedule is recorded every micro-batch ends
  with a check, so that every rank switches to data mode at the same point.
* every rank that sees a flag abandons the micro-batch: healthy ranks raise
  ``FsdpPeerOutOfMemoryError`` (an ``OutOfMemoryError`` to the guard, marked as
  a peer's), the failing rank re-raises its own OOM, FSDP's state is reset on
  every rank (resharded, idle), and each guard halves its micro-batch limit
  the same way (``controller="search"``, no same-size retry,
  ``uniform_micro_batch``), so the ranks keep running the same micro-batches
  and the same collectives. The phase is agreed too: if any rank was already
  in backward, every rank treats the failure as a backward one (gradients
  zeroed, the step redone); otherwise completed micro-batches are kept.
* a non-OOM error raises an error flag: every rank leaves the micro-batch, the
  guard's vote then stops every rank (the failing one with its own error).

The words also carry what the step needs from every rank: this rank's loss
units and sample count (the global units give each rank's share, so the
reduce-scatter's mean over ranks yields the global batch's gradient; unequal
sample counts are refused, since the ranks must run the same micro-batches).
docs/distributed.md has the guarantees and the measured cost.
"""

from __future__ import annotations

import ctypes
import gc
import math
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional

import torch
import torch.distributed as dist

from .. import errors as _errors
from .distributed import completed_by

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch: no FSDP2 mode
    FSDPModule = None  # type: ignore[assignment,misc]
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]
    TrainingState = None  # type: ignore[assignment]
    DTensor = None  # type: ignore[assignment]

__all__ = ["FsdpPeerOutOfMemoryError", "FsdpPeerInjectedOutOfMemoryError", "FsdpPeerError", "FsdpReplayError", "FsdpAgreement", "GUARD_OPTIONS", "is_fsdp", "fsdp_modules"]

# What a guard of an FSDP model needs: after an abandoned micro-batch every rank
# shrinks the same way (halving, no figures-driven sizes, no same-size retry
# that depends on what this rank's release freed), and every step starts at
# the smallest limit of all ranks.
GUARD_OPTIONS = {"controller": "search", "retry_after_release": False, "uniform_micro_batch": True}

# The words of a check (summed over ranks).
_OOM, _ERROR, _BACKWARD, _UNITS, _SAMPLES, _SAMPLES_SQ, _SQ_NORM, _INJECTED = range(8)
_WORDS = 8


class FsdpPeerOutOfMemoryError(torch.OutOfMemoryError):
    """Raised on the ranks that did not fail when another rank ran out of memory
    inside an FSDP micro-batch: every rank abandons the micro-batch together."""


class FsdpPeerInjectedOutOfMemoryError(FsdpPeerOutOfMemoryError, _errors.InjectedOutOfMemoryError):
    """The same, when every failing rank's OOM was injected (a fault rule):
    the guard treats it as injected on every rank, so that every rank's size
    controller learns the same thing (an injected OOM marks no size as bad)."""

    def __init__(self, message: str) -> None:
        _errors.InjectedOutOfMemoryError.__init__(self, message)


class FsdpReplayError(RuntimeError):
    """Raised on a rank that left an FSDP micro-batch in data mode and could
    not run the collective the other ranks are inside (its buffers did not
    fit): the step cannot end in lockstep; every rank stops (the others at the
    agreement's deadline)."""


class FsdpPeerError(RuntimeError):
    """Raised on the ranks that did not fail when another rank raised a non-OOM
    error inside an FSDP micro-batch; the guard's vote then stops every rank."""


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a submodule) was sharded with ``fully_shard``."""
    return FSDPModule is not None and any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp_modules(model: torch.nn.Module) -> List[Any]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _extra_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that hold a rank's three int64 words in a data-mode all-gather."""
    return -(-_WORD_BYTES // dtype.itemsize)


# A rank's words in a data-mode all-gather: flag bits, loss units, sample count (int64).
_WORD_BYTES = 24
_BIT_OOM, _BIT_ERROR, _BIT_BACKWARD, _BIT_INJECTED = 1, 2, 4, 8


class _Comm:
    """What the agreement's all-gather and reduce-scatter share: the buffers
    FSDP had this object allocate for the collective it is about to issue
    (with a few spare elements in data mode: the flags travel in them)."""

    def __init__(self, agreement: "FsdpAgreement", unit: int) -> None:
        self._agreement = agreement
        self._unit = unit
        self._bigs: List[torch.Tensor] = []  # the buffers behind the last allocations handed to FSDP
        self._reserve: Optional[torch.Tensor] = None  # room for gloo's temporary (CPU), freed before the collective

    def _remember(self, big: torch.Tensor) -> None:
        self._bigs = (self._bigs + [big])[-2:]

    def _take(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The remembered buffer that holds ``t`` (contiguous, at its start or inside), forgetting them all."""
        bigs, self._bigs = self._bigs, []
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        for big in bigs:
            if t.is_contiguous() and big.data_ptr() <= lo and hi <= big.data_ptr() + big.numel() * big.element_size():
                return big
        return None


class _CheckedAllGather(_Comm, AllGather):  # type: ignore[misc,valid-type]
    """FSDP's all-gather under the agreement.

    Check mode: a check, then the collective. On the CPU, gloo's all-gather
    allocates a temporary as large as the output inside the collective, where
    an OOM would leave the peers waiting: ``allocate`` therefore reserves as
    much next to the output (before the check, where an OOM is answered) and
    the reserve is released right before the collective, so that gloo's
    temporary takes its place (the peak is the same as without the reserve).

    Data mode: the output FSDP gets is the head of a buffer with spare
    elements (24 bytes per rank); each rank sends its shard followed by its
    words (flags, loss units, samples), every rank reads every rank's words,
    then the rows are moved back to FSDP's layout."""

    def allocate(self, size, *, dtype, device):
        a = self._agreement
        self._reserve = None
        n = int(math.prod(int(s) for s in size))
        big = torch.empty(n + (a.world * _extra_elements(dtype) if a.data_capable else 0), dtype=dtype,
                          device=device)
        if big.device.type == "cpu":
            self._reserve = torch.empty_like(big)
        self._remember(big)
        return big[:n].view(*size)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        a = self._agreement
        big = self._take(output_tensor)
        key = ("all_gather", self._unit, int(input_tensor.numel()), str(input_tensor.dtype))
        try:
            if a.before_collective(key):
                if big is not None and output_tensor.data_ptr() == big.data_ptr() and \
                        big.numel() == output_tensor.numel() + a.world * _extra_elements(big.dtype):
                    self._reserve = None
                    a.gather_with_words(big, input_tensor, group, key)
                    return None
                a.leave_data_mode("an FSDP all-gather's output is not the buffer the agreement allocated")
            a.check(group)
        finally:
            self._reserve = None
        work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        a.after_collective(key)
        return work


class _CheckedReduceScatter(_Comm, ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP's reduce-scatter under the agreement. On the CPU (gloo) an in-place
    all-reduce of FSDP's scratch input, then this rank's chunk copied out:
    nothing allocated inside the collective (gloo's reduce-scatter allocates).
    Check mode: a check first. Data mode: the scratch input has one spare
    element, this rank's flag (1: an OOM, world + 1: an injected OOM,
    (world + 1)²: an error), summed with the gradients."""

    def allocate(self, size, *, dtype, device):
        n = int(math.prod(int(s) for s in size))
        big = torch.empty(n + (1 if self._agreement.data_capable else 0), dtype=dtype, device=device)
        self._remember(big)
        return big[:n].view(*size)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        a = self._agreement
        rank = dist.get_rank(group)
        n = output_tensor.numel()
        big = self._take(input_tensor)
        key = ("reduce_scatter", self._unit, int(input_tensor.numel()), str(input_tensor.dtype))
        inplace = input_tensor.device.type == "cpu" and input_tensor.is_contiguous() and \
            output_tensor.is_contiguous() and input_tensor.numel() == n * dist.get_world_size(group)
        if a.before_collective(key):
            if inplace and big is not None and big.data_ptr() == input_tensor.data_ptr() and \
                    big.numel() == input_tensor.numel() + 1 and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and \
                    _exact_flag_sum(big.dtype, a.world):
                a.reduce_with_flag(big, group, op)
                output_tensor.view(-1).copy_(input_tensor.view(-1)[rank * n:(rank + 1) * n])
                a.after_collective(key, counted=True)
                return None
            a.leave_data_mode("an FSDP reduce-scatter cannot carry the flag (not an in-place SUM of the "
                              "agreement's buffer, or a dtype too narrow for the flags' sum)")
        a.check(group)
        a._reduce_ops[key] = op
        if inplace:
            flat = input_tensor.view(-1)
            dist.all_reduce(flat, op=op, group=group)
            output_tensor.view(-1).copy_(flat[rank * n:(rank + 1) * n])
            a.after_collective(key)
            return None
        work = dist.reduce_scatter_tensor(output=output_tensor, input=input_tensor, group=group, op=op,
                                          async_op=async_op)
        a.after_collective(key)
        return work


def _exact_flag_sum(dtype: torch.dtype, world: int) -> bool:
    """Whether ``dtype`` holds the flags' largest sum (every rank an error) exactly (or its mean
    closely enough to round back to it)."""
    exact = {torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8, torch.float32: 2 ** 24}.get(dtype, 2 ** 53)
    return world * (world + 1) ** 2 <= exact


class FsdpAgreement:
    """The agreement of one FSDP-sharded model (see the module's docstring).

    ``attach`` installs the agreement's collectives on every FSDP unit of the
    model; ``TrainStep`` drives the rest. ``mode``: ``"data"`` (the flags ride
    in FSDP's own collectives once a schedule is recorded; CPU/gloo only,
    check mode elsewhere) or ``"check"`` (a check before every collective).
    Counters: ``checks`` (checks run), ``collectives`` (FSDP collectives
    issued, replays included), ``abandoned`` (micro-batches abandoned on every
    rank), ``replays`` (collectives this rank ran for a micro-batch it had
    left), ``fallbacks`` (micro-batches that left data mode on a mismatch).
    ``fault_hook(where, position)``, for tests: called before (``"before"``)
    and after (``"after"``) each FSDP collective of a micro-batch, and before
    each attempt to allocate a replay's buffers (``"replay"``, attempt 0, 1).
    """

    def __init__(self, model: torch.nn.Module, deadline_s: float = 60.0, sync_every: bool = True,
                 mode: str = "data") -> None:
        if FSDPModule is None:
            raise RuntimeError("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
        if mode not in ("data", "check"):
            raise ValueError(f"the FSDP agreement's mode must be 'data' or 'check', got {mode!r}")
        self.model = model
        self.modules = fsdp_modules(model)
        if not self.modules:
            raise ValueError("the model has no module sharded with fully_shard")
        self.deadline_s = float(deadline_s)
        self._deadline = timedelta(seconds=self.deadline_s)
        self._sync_every = bool(sync_every)
        self.group = None
        for m in self.modules:
            pg = m._get_fsdp_state()._fsdp_param_group
            if pg is not None:
                self.group = pg.mesh_info.shard_process_group
                break
        if self.group is None:
            raise ValueError("no FSDP unit of the model holds parameters")
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        # Data mode needs a CPU buffer layout it can move in place and gloo's in-place all-reduce.
        self.mode = mode
        self.data_capable = mode == "data" and dev.type == "cpu"
        self._host_words = torch.zeros(_WORDS, dtype=torch.float64)
        self._host = self._host_words.numpy()  # filled without allocating a tensor
        self._words = self._host_words if dev.type == "cpu" else torch.zeros(_WORDS, dtype=torch.float64,
                                                                             device=dev)
        self._mine = torch.zeros(3, dtype=torch.int64)  # this rank's words in a data-mode all-gather
        self._theirs = torch.zeros(self.world * 3, dtype=torch.int64)  # every rank's, read back
        self.backward = False   # this rank is inside a backward
        self.local_units = 0
        self.local_samples = 0
        self.global_units = 0.0
        self.sq_norm_local = 0.0
        self.sq_norm = 0.0
        self.checks = 0
        self._checks_at_start = 0
        self.collectives = 0
        self.abandoned = 0
        self.replays = 0
        self.fallbacks = 0
        self.fault_hook: Optional[Callable[[str, int], None]] = None
        self.coordinator: Any = None  # the guard's (TrainStep sets it): aborted when a replay cannot run
        self._peer: Optional[BaseException] = None  # the abandonment this rank saw, until reset
        # The schedule: per gradient-sync setting, the (kind, unit, input numel, dtype) of a micro-batch's
        # collectives in the order FSDP called them, recorded in check mode; valid while the units'
        # shards and settings are those of ``_signature``.
        self.schedules: dict = {}
        self._signature: Any = None
        self._data = False      # this micro-batch runs in data mode
        self._schedule: List[tuple] = []
        self._first: Optional[tuple] = None  # the first collective of every micro-batch's schedule
        self._reduce_ops: dict = {}  # the reduce op FSDP used for each reduce-scatter of the schedule
        self.fallback_reason = ""
        self._recording: Optional[List[tuple]] = None
        self._pos = 0           # collectives of this micro-batch completed on this rank
        self._units_known = False
        self._comm_error = False  # a collective itself failed (not an OOM before it): nothing to replay
        self._injected = False    # this rank's own failure was an injected OOM (a fault rule)
        for i, m in enumerate(self.modules):
            m.set_custom_all_gather(_CheckedAllGather(self, i))
            m.set_custom_reduce_scatter(_CheckedReduceScatter(self, i))

    # ---- the check ----
    def _exchange(self, oom: bool, error: bool, group: Any = None) -> List[float]:
        # Allocation-free: the failing rank runs this while its OOM's frames still hold memory.
        w, h = self._words, self._host
        h[_OOM] = float(oom)
        h[_INJECTED] = float(oom and self._injected)
        h[_ERROR] = float(error)
        h[_BACKWARD] = float(self.backward)
        h[_UNITS] = float(self.local_units)
        h[_SAMPLES] = float(self.local_samples)
        h[_SAMPLES_SQ] = float(self.local_samples) ** 2
        h[_SQ_NORM] = self.sq_norm_local
        if w is not self._host_words:
            w.copy_(self._host_words)
        work = dist.all_reduce(w, group=group if group is not None else self.group, async_op=True)
        self._wait(work, "an FSDP agreement check")
        self.checks += 1
        out = w.tolist()
        n = self.world
        if out[_SAMPLES] * out[_SAMPLES] != n * out[_SAMPLES_SQ] and not (out[_OOM] or out[_ERROR]):
            raise self._agreed(ValueError(self._unequal_samples(out[_SAMPLES])))
        self.global_units = out[_UNITS]
        self._units_known = True
        self.sq_norm = out[_SQ_NORM]
        return out

    def _wait(self, work: Any, what: str) -> None:
        lost = f"{what} did not complete within {self.deadline_s:.1f} s (a peer is lost)"
        if self._words.device.type == "cpu":
            # gloo: a blocking wait with the deadline (polling would add up to a millisecond per collective).
            try:
                work.wait(timeout=self._deadline)
            except RuntimeError as e:
                self._comm_error = True
                if "timed out" in str(e).lower():
                    raise TimeoutError(lost) from None
                raise
            return
        if not completed_by([work], self.deadline_s):
            self._comm_error = True
            raise TimeoutError(lost)
        try:
            work.wait()
        except BaseException:
            self._comm_error = True
            raise

    def _unequal_samples(self, total: float) -> str:
        return (f"the ranks hold different sample counts in this step (this rank {self.local_samples}, sum "
                f"{total:.0f} over {self.world}): under FSDP every rank must run the same micro-batches, so give "
                "every rank the same number of samples")

    def _agreed(self, error: BaseException) -> BaseException:
        """An error every rank raises at the same collective: nobody answers or replays."""
        self._peer = error
        return error

    def _abandon(self, ooms: int, errors: int, backward: bool, injected: int = 0) -> BaseException:
        self.abandoned += 1
        self.backward = self.backward or backward
        if errors:
            err: BaseException = FsdpPeerError("another rank raised an error inside this FSDP micro-batch; every "
                                               "rank left it")
        else:
            text = (f"{ooms} other rank(s) failed to allocate inside this FSDP micro-batch; every rank abandons it "
                    "(a peer's OOM, not this rank's)")
            err = FsdpPeerInjectedOutOfMemoryError(text) if 0 < ooms == injected else FsdpPeerOutOfMemoryError(text)
        self._peer = err
        return err

    def check(self, group: Any = None) -> None:
        """A check on a healthy path: raises when some rank failed."""
        if self._peer is not None:
            raise self._peer  # already abandoned: issue nothing more
        out = self._exchange(False, False, group)
        if out[_OOM] or out[_ERROR]:
            raise self._abandon(int(out[_OOM]), int(out[_ERROR]), out[_BACKWARD] > 0, int(out[_INJECTED]))

    def ensure_checked(self) -> None:
        """Before this micro-batch's weight is used: the global units are known
        (from a check or a data-mode all-gather of this step; an explicit check
        if none ran)."""
        if self._data:
            if not self._units_known:
                self.check()
        elif self.checks == self._checks_at_start:
            self.check()

    def answer(self, oom: bool) -> None:
        """The failing rank's side: answers the check the others are about to run."""
        out = self._exchange(oom, not oom)
        self.abandoned += 1
        self.backward = self.backward or out[_BACKWARD] > 0

    # ---- the collectives (called by _CheckedAllGather / _CheckedReduceScatter) ----
    def before_collective(self, key: tuple) -> bool:
        """Before FSDP's collective ``key``: whether it runs in data mode. A
        collective that differs from the schedule ends data mode for this
        micro-batch on every rank (they all see the same sequence): the check
        before it and every later one, the schedule recorded anew."""
        if self._peer is not None:
            raise self._peer
        if self.fault_hook is not None:
            self.fault_hook("before", self._pos)
        if not self._data:
            return False
        if self._pos >= len(self._schedule) or self._schedule[self._pos] != key:
            self.leave_data_mode(f"FSDP collective {self._pos} of the micro-batch is {key}, the schedule says "
                                 f"{self._schedule[self._pos] if self._pos < len(self._schedule) else 'none'}")
            return False
        return True

    def leave_data_mode(self, why: str) -> None:
        self._data = False
        self._recording = None
        self.schedules.clear()
        self.fallbacks += 1
        self.fallback_reason = why

    def completed(self) -> None:
        """A collective of this micro-batch completed on this rank: counted at
        once, so that a failure while its result is read replays the next one."""
        self._pos += 1
        self.collectives += 1

    def after_collective(self, key: tuple, counted: bool = False) -> None:
        if not counted:
            self.completed()
        if self._recording is not None:
            self._recording.append(key)
        if self.fault_hook is not None:
            self.fault_hook("after", self._pos - 1)

    def _put_words(self, tail: torch.Tensor, flags: int) -> None:
        m = self._mine.numpy()
        m[0], m[1], m[2] = flags, self.local_units, self.local_samples
        tail.view(torch.uint8)[:_WORD_BYTES].copy_(self._mine.view(torch.uint8))

    def _gather(self, big: torch.Tensor, shard: int, group: Any, flags: int, replay: bool = False) -> List[List[int]]:
        """The data-mode all-gather on ``big`` (world rows of ``shard`` + spare
        elements, this rank's shard at ``rank * shard`` as FSDP copied it in):
        every rank's words, the rows back at FSDP's offsets."""
        e = _extra_elements(big.dtype)
        row, r = shard + e, self.rank
        self._put_words(big[r * shard + shard:r * shard + row], flags)
        work = dist.all_gather_into_tensor(big, big[r * shard:r * shard + row], group=group, async_op=True)
        self._wait(work, "an FSDP all-gather")
        if not replay:
            self.completed()
        theirs = self._theirs.view(torch.uint8)
        for j in range(self.world):
            theirs[j * _WORD_BYTES:(j + 1) * _WORD_BYTES].copy_(
                big[j * row + shard:j * row + row].view(torch.uint8)[:_WORD_BYTES])
        size, base = big.element_size(), big.data_ptr()
        for j in range(1, self.world):  # rows move down, in order: each lands before where it was read
            ctypes.memmove(base + j * shard * size, base + j * row * size, shard * size)
        words = self._theirs.tolist()
        return [words[3 * j:3 * j + 3] for j in range(self.world)]

    def gather_with_words(self, big: torch.Tensor, input_tensor: torch.Tensor, group: Any, key: tuple) -> None:
        shard = input_tensor.numel()
        mine = big[self.rank * shard:(self.rank + 1) * shard]
        if mine.data_ptr() != input_tensor.data_ptr():
            mine.copy_(input_tensor.view(-1))
        words = self._gather(big, shard, group, _BIT_BACKWARD if self.backward else 0)
        ooms = sum(1 for w in words if w[0] & _BIT_OOM)
        errors = sum(1 for w in words if w[0] & _BIT_ERROR)
        if ooms or errors:
            raise self._abandon(ooms, errors, any(w[0] & _BIT_BACKWARD for w in words),
                                sum(1 for w in words if w[0] & _BIT_INJECTED))
        samples = [w[2] for w in words]
        if len(set(samples)) > 1:
            raise self._agreed(ValueError(self._unequal_samples(sum(samples))))
        self.global_units = float(sum(w[1] for w in words))
        self._units_known = True
        self.after_collective(key, counted=True)

    def reduce_with_flag(self, big: torch.Tensor, group: Any, op: Any) -> None:
        big[-1] = 0
        work = dist.all_reduce(big, op=op, group=group, async_op=True)
        self._wait(work, "an FSDP reduce-scatter")
        self.completed()
        # FSDP averages float32 and bfloat16 gradients (AVG) and sums the others after a division.
        flags = int(round(float(big[-1]) * (self.world if op == dist.ReduceOp.AVG else 1)))
        if flags:
            base = self.world + 1
            real, injected, errors = flags % base, flags // base % base, flags // (base * base)
            raise self._abandon(real + injected, errors, True, injected)

    # ---- the failing rank's side in data mode ----
    def _replay_target(self, last: bool) -> Optional[tuple]:
        """The collective the other ranks are about to run, when it is a data
        collective (None: they run a check, answered as in check mode)."""
        if not self._data:
            return None
        if self._pos < len(self._schedule):
            return self._schedule[self._pos]
        if last:
            return None  # the step's closing check
        return self._first  # the next micro-batch's first collective

    def replay(self, key: tuple, oom: bool) -> None:
        """Runs collective ``key`` as the others do, with zeros and this rank's
        flag: every rank leaves the micro-batch there. Its buffers are
        allocated now (the micro-batch's memory is released); an OOM here
        leaves the others inside the collective: ``FsdpReplayError``."""
        kind, _, numel, dtype_name = key
        dtype = getattr(torch, dtype_name.split(".")[-1])
        e = _extra_elements(dtype)
        size = self.world * (numel + e) if kind == "all_gather" else numel + 1
        buf = None
        for attempt in range(2):
            try:
                if self.fault_hook is not None:
                    self.fault_hook("replay", attempt)
                buf = torch.zeros(size, dtype=dtype)
                break
            except BaseException as err:  # noqa: BLE001 - classified below
                if _errors.oom_kind(err) is None:
                    raise
                if attempt == 1:
                    self._comm_error = True
                    message = (f"this rank left an FSDP micro-batch and could not allocate the replay of the {kind} "
                               f"the other ranks are inside ({size} x {dtype_name}: {err}); every rank stops (the "
                               "others at the agreement's deadline)")
                    # The group is out of step now (the others are inside a collective this rank did not
                    # issue): the guard's coordinator must not issue another one on it.
                    if self.coordinator is not None and hasattr(self.coordinator, "abort"):
                        self.coordinator.abort(f"FSDP replay failed: {message}")
                    raise FsdpReplayError(message) from err
                gc.collect()
        flags = (_BIT_OOM | (_BIT_INJECTED if self._injected else 0)) if oom else _BIT_ERROR
        if kind == "all_gather":
            words = self._gather(buf, numel, self.group, flags | (_BIT_BACKWARD if self.backward else 0),
                                 replay=True)
            self.collectives += 1
            backward = any(w[0] & _BIT_BACKWARD for w in words)
        else:
            base = self.world + 1
            buf[-1] = (base if self._injected else 1) if oom else base * base
            work = dist.all_reduce(buf, op=self._reduce_ops.get(key, dist.ReduceOp.SUM), group=self.group,
                                   async_op=True)
            self._wait(work, "an FSDP reduce-scatter (replayed)")
            self.collectives += 1
            backward = True  # every other rank is in backward
        del buf
        self.replays += 1
        self.abandoned += 1
        self.backward = self.backward or backward

    # ---- what TrainStep calls ----
    def begin_step(self, samples: int, units: Optional[int]) -> None:
        self.local_samples = int(samples)
        self.local_units = int(samples if units is None else units)
        self.sq_norm_local = 0.0
        self._units_known = False

    def _current_signature(self) -> tuple:
        sig = []
        for m in self.modules:
            pg = m._get_fsdp_state()._fsdp_param_group
            if pg is None:
                sig.append(None)
                continue
            sig.append((getattr(pg, "post_forward_mesh_info", None) is not None, pg.unshard_async_op,
                        tuple((tuple(p.padded_sharded_param_size), str(getattr(p, "param_dtype", None) or p.sharded_param.dtype),
                               p.sharded_param.requires_grad) for p in pg.fsdp_params)))
        return tuple(sig)

    def _start_micro(self, sync: bool) -> None:
        self._pos = 0
        self._comm_error = False
        self._data = False
        self._recording = None
        if not self.data_capable:
            return
        if self.schedules and self._current_signature() != self._signature:
            self.schedules.clear()  # the units' shards or settings changed: record again
        needed = (True,) if self._sync_every else (True, False)
        firsts = {self.schedules[k][0] if self.schedules.get(k) else None for k in needed if k in self.schedules}
        if all(k in self.schedules for k in needed) and len(firsts) == 1 and None not in firsts:
            self._data = True
            self._schedule = self.schedules[sync]
            self._first = self.schedules[needed[0]][0]
        else:
            self._recording = []

    def run_micro(self, body: Callable[[], None], last: bool, sq_norm: Optional[Callable[[], float]],
                  mark_phase: Callable[[str], None]) -> None:
        """One micro-batch under the agreement: ``body`` (forward and backward;
        it sets ``self.backward`` before backward and calls ``ensure_checked``
        before it needs the global units), then a check at the end of the
        step's last micro-batch (with the gradient's squared norm when
        ``sq_norm`` is given) and, while a schedule is recorded, at the end of
        every micro-batch (so that every rank switches to data mode together)."""
        self.backward = False
        self._peer = None
        self.sq_norm_local = 0.0
        sync = self._sync_every or last
        for m in self.modules:
            m.set_requires_gradient_sync(sync, recurse=False)
        self._checks_at_start = self.checks
        self._start_micro(sync)
        try:
            # No check of its own at the start: the first FSDP collective comes before anything of this
            # micro-batch that needs other ranks (see ensure_checked), and a failure since the previous
            # micro-batch's end is answered there (its phase word or bit makes every rank redo the step
            # when the failing rank was in backward of the micro-batch before).
            body()
            if last or self._recording is not None:
                if last and sq_norm is not None:
                    self.sq_norm_local = sq_norm()
                self.check()
            if self._recording is not None:
                # Every rank passed the closing check: every rank holds this schedule from here on. Its
                # signature is taken now (FSDP sets some of what it reads at its first forward).
                sig = self._current_signature()
                if sig != self._signature:
                    self.schedules.clear()
                    self._signature = sig
                self.schedules[sync] = self._recording
                self._recording = None
        except BaseException as e:  # noqa: BLE001 - every failure must be answered, then re-raised
            if self._peer is None:
                if isinstance(e, (KeyboardInterrupt, SystemExit, TimeoutError)) or self._comm_error:
                    raise
                oom = _errors.oom_kind(e) is not None
                self._injected = isinstance(e, _errors.InjectedOutOfMemoryError)
                target = self._replay_target(last)
                if target is None:
                    self.answer(oom)
                else:
                    # The micro-batch's activations and graph go first (the frames that hold them have
                    # returned), then FSDP's unsharded parameters: the replay allocates its buffers.
                    traceback.clear_frames(e.__traceback__)
                    self.restore()
                    self.replay(target, oom)
            self.restore()
            if self.backward:
                mark_phase("backward")
            raise
        finally:
            self._peer = None
            self._recording = None

    def restore(self) -> None:
        """FSDP's state after a micro-batch left half-way: every unit resharded
        and idle, nothing pending; what the micro-batch accumulated stays for
        the guard's reset to clear (or to keep, after a forward abandonment)."""
        for m in self.modules:
            st = m._get_fsdp_state()
            st._training_state = TrainingState.IDLE
            pg = st._fsdp_param_group
            if pg is None:
                continue
            result = pg._all_gather_result
            if result is not None:
                work = result.all_gather_work
                if isinstance(work, dist.distributed_c10d.Work):
                    work.wait()  # issued on every rank after a check: it completes
                pg._all_gather_result = None
            for comm in (pg._all_gather_comm, pg._reduce_scatter_comm):
                if isinstance(comm, _Comm):  # buffers of a collective that was never issued
                    comm._bigs, comm._reserve = [], None
            pg._training_state = TrainingState.IDLE
            pg._post_forward_indices.clear()
            pg._post_reduce_event = None
            pg._all_reduce_state = None
            if hasattr(pg.comm_ctx, "post_forward_order"):  # not before FSDP's lazy init (the first forward)
                pg.comm_ctx.all_gather_state = None
                pg.comm_ctx.reduce_scatter_state = None
                pg.comm_ctx.post_forward_order.clear()
            pg.reshard()
        root = self.modules[-1]._get_fsdp_state()
        ctx = root._state_ctx
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False
        ctx.is_last_backward = True

    def clear_gradients(self) -> None:
        """Gradients FSDP keeps outside the parameters' ``.grad`` (the unsharded
        accumulation of micro-batches without gradient sync)."""
        for m in self.modules:
            pg = m._get_fsdp_state()._fsdp_param_group
            if pg is None:
                continue
            for p in pg.fsdp_params:
                p.unsharded_accumulated_grad = None
                unsharded = getattr(p, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None

    def local_sq_norm(self, params: Iterable[torch.nn.Parameter]) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self._words.device)
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if DTensor is not None and isinstance(p.grad, DTensor) else p.grad
                total += g.detach().to(torch.float64).pow(2).sum()
        return float(total)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local_state(obj: Any) -> Any:
    if is_dtensor(obj):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: _local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local_state(v) for v in obj]
    return obj


def add_sharded_optimizer(ckpt: Any, optimizer: torch.optim.Optimizer, to_bytes: Callable[[Any], bytes],
                          from_bytes: Callable[[bytes], Any]) -> None:
    """The optimizer of FSDP2 parameters in a Checkpointer: each rank saves the
    local shards of its state's DTensors and, on a load, rebuilds them as
    DTensors placed like their parameters (no collective either way)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def save() -> bytes:
        return to_bytes(_local_state(optimizer.state_dict()))

    def load(data: bytes) -> None:
        state = from_bytes(data)
        for index, entry in state.get("state", {}).items():
            param = params[int(index)]
            if not is_dtensor(param):
                continue
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and \
                        tuple(value.shape) == tuple(param.to_local().shape):
                    entry[key] = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                                    run_check=False, shape=param.shape, stride=param.stride())
        optimizer.load_state_dict(state)

    ckpt.add_object("optimizer", save, load)
    ckpt.registered["optimizer"] = optimizer
