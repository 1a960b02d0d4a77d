"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under the guard.

FSDP runs collectives inside every micro-batch: an all-gather before each
unit's forward (and again before its backward when it resharded after
forward) and a reduce-scatter after each unit's backward. An OOM on one rank
between two of them leaves the other ranks inside the next one until the
process group's timeout. ``TrainStep`` on a model sharded with ``fully_shard``
therefore runs every micro-batch under an *agreement*:

* every collective FSDP issues is preceded, on every rank, by a **check**: one
  all-reduce of 7 float64 words on FSDP's own process group (through
  ``set_custom_all_gather`` / ``set_custom_reduce_scatter``, after FSDP
  allocated the collective's buffers, right before it is issued; on the CPU,
  where gloo's all-gather and reduce-scatter allocate a temporary, the
  all-gather's is reserved before the check and the reduce-scatter is an
  in-place all-reduce, so nothing fails after a check). The step's last micro-batch ends with a check;
* a rank that fails anywhere between two checks (an OOM in a unit's compute,
  in FSDP's own buffer allocation, in the loss) does not issue another
  collective: it answers the next check with its failure flag, which is the
  check every other rank is about to run (no rank can pass a check alone);
* every rank then sees the flag in the same check and abandons the micro-batch:
  healthy ranks raise ``FsdpPeerOutOfMemoryError`` (an ``OutOfMemoryError`` to
  the guard, marked as a peer's), the failing rank re-raises its own OOM, FSDP's
  state is reset on every rank (resharded, idle), and each guard halves its
  micro-batch limit the same way (``controller="search"``, no same-size retry,
  ``uniform_micro_batch``), so the ranks keep running the same micro-batches
  and the same collectives. The phase is agreed too: if any rank was already in
  backward, every rank treats the failure as a backward one (gradients zeroed,
  the step redone); otherwise completed micro-batches are kept on every rank.
* a non-OOM error answers with an error flag: every rank leaves the micro-batch,
  the guard's vote then stops every rank (the failing one with its own error).

The words of a check also carry what the step needs from every rank without an
extra collective: this rank's loss units and sample count (the global units give
each rank's share, so the reduce-scatter's mean over ranks yields the global
batch's gradient; unequal sample counts are refused, since the ranks must run
the same micro-batches) and, in the last check of a step, the sum of squares of
this rank's gradient shards (gradient clipping without a collective in apply).

Checks per step: one per FSDP collective, plus one; see docs/distributed.md
for the measured cost.
"""

from __future__ import annotations

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

__all__ = ["FsdpPeerOutOfMemoryError", "FsdpPeerError", "FsdpAgreement", "GUARD_OPTIONS", "is_fsdp", "fsdp_modules"]

# What a guard of an FSDP model needs: after an abandoned micro-batch every rank
# shrinks the same way (halving, no figures-driven sizes, no same-size retry
# that depends on what this rank's release freed), and every step starts at
# the smallest limit of all ranks.
GUARD_OPTIONS = {"controller": "search", "retry_after_release": False, "uniform_micro_batch": True}

# The words of a check (summed over ranks).
_OOM, _ERROR, _BACKWARD, _UNITS, _SAMPLES, _SAMPLES_SQ, _SQ_NORM = range(7)
_WORDS = 7


class FsdpPeerOutOfMemoryError(torch.OutOfMemoryError):
    """Raised on the ranks that did not fail when another rank ran out of memory
    inside an FSDP micro-batch: every rank abandons the micro-batch together."""


class FsdpPeerError(RuntimeError):
    """Raised on the ranks that did not fail when another rank raised a non-OOM
    error inside an FSDP micro-batch; the guard's vote then stops every rank."""


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a submodule) was sharded with ``fully_shard``."""
    return FSDPModule is not None and any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp_modules(model: torch.nn.Module) -> List[Any]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class _CheckedAllGather(AllGather):  # type: ignore[misc,valid-type]
    """FSDP's all-gather after a check. On the CPU, gloo's all-gather allocates
    a temporary as large as the output after the check, where an OOM would
    leave the peers inside the collective: ``allocate`` therefore reserves as
    much next to the output (before the check, where an OOM is answered) and
    the reserve is released right before the collective, so that gloo's
    temporary takes its place (the peak is the same as without the reserve)."""

    def __init__(self, agreement: "FsdpAgreement") -> None:
        self._agreement = agreement
        self._reserve: Optional[torch.Tensor] = None

    def allocate(self, size, *, dtype, device):
        out = torch.empty(*size, dtype=dtype, device=device)
        if out.device.type == "cpu":
            self._reserve = None
            self._reserve = torch.empty_like(out)
        return out

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        try:
            self._agreement.check(group)
        finally:
            self._reserve = None
        self._agreement.collectives += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _CheckedReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP's reduce-scatter after a check. On the CPU (gloo) an in-place
    all-reduce of FSDP's scratch input, then this rank's chunk copied out:
    nothing allocated after the check (gloo's reduce-scatter allocates)."""

    def __init__(self, agreement: "FsdpAgreement") -> None:
        self._agreement = agreement

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self._agreement.check(group)
        self._agreement.collectives += 1
        rank = dist.get_rank(group)
        n = output_tensor.numel()
        if input_tensor.device.type == "cpu" and input_tensor.is_contiguous() and output_tensor.is_contiguous() \
                and input_tensor.numel() == n * dist.get_world_size(group):
            flat = input_tensor.view(-1)
            dist.all_reduce(flat, op=op, group=group)
            output_tensor.view(-1).copy_(flat[rank * n:(rank + 1) * n])
            return None
        return dist.reduce_scatter_tensor(output=output_tensor, input=input_tensor, group=group, op=op,
                                          async_op=async_op)


class FsdpAgreement:
    """The checks of one FSDP-sharded model (see the module's docstring).

    ``attach`` installs the checked collectives on every FSDP unit of the
    model; ``TrainStep`` drives the rest. Counters: ``checks`` (checks run),
    ``collectives`` (FSDP collectives issued), ``abandoned`` (micro-batches
    abandoned on every rank).
    """

    def __init__(self, model: torch.nn.Module, deadline_s: float = 60.0, sync_every: bool = True) -> None:
        if FSDPModule is None:
            raise RuntimeError("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
        self.model = model
        self.modules = fsdp_modules(model)
        if not self.modules:
            raise ValueError("the model has no module sharded with fully_shard")
        self.deadline_s = float(deadline_s)
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
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._host_words = torch.zeros(_WORDS, dtype=torch.float64)
        self._host = self._host_words.numpy()  # filled without allocating a tensor
        self._words = self._host_words if dev.type == "cpu" else torch.zeros(_WORDS, dtype=torch.float64,
                                                                             device=dev)
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
        self._peer: Optional[BaseException] = None  # the abandonment this rank saw, until reset
        for m in self.modules:
            m.set_custom_all_gather(_CheckedAllGather(self))
            m.set_custom_reduce_scatter(_CheckedReduceScatter(self))

    # ---- the check ----
    def _exchange(self, oom: bool, error: bool, group: Any = None) -> List[float]:
        # Allocation-free: the failing rank runs this while its OOM's frames still hold memory.
        w, h = self._words, self._host
        h[_OOM] = float(oom)
        h[_ERROR] = float(error)
        h[_BACKWARD] = float(self.backward)
        h[_UNITS] = float(self.local_units)
        h[_SAMPLES] = float(self.local_samples)
        h[_SAMPLES_SQ] = float(self.local_samples) ** 2
        h[_SQ_NORM] = self.sq_norm_local
        if w is not self._host_words:
            w.copy_(self._host_words)
        work = dist.all_reduce(w, group=group if group is not None else self.group, async_op=True)
        if not completed_by([work], self.deadline_s):
            raise TimeoutError(f"an FSDP agreement check did not complete within {self.deadline_s:.1f} s "
                               "(a peer is lost)")
        work.wait()
        self.checks += 1
        out = w.tolist()
        n = self.world
        if out[_SAMPLES] * out[_SAMPLES] != n * out[_SAMPLES_SQ] and not (out[_OOM] or out[_ERROR]):
            raise ValueError(f"the ranks hold different sample counts in this step (this rank "
                             f"{self.local_samples}, sum {out[_SAMPLES]:.0f} over {n}): under FSDP every rank "
                             "must run the same micro-batches, so give every rank the same number of samples")
        self.global_units = out[_UNITS]
        self.sq_norm = out[_SQ_NORM]
        return out

    def check(self, group: Any = None) -> None:
        """A check on a healthy path: raises when some rank failed."""
        if self._peer is not None:
            raise self._peer  # already abandoned: issue nothing more
        out = self._exchange(False, False, group)
        if out[_OOM] or out[_ERROR]:
            self.abandoned += 1
            self.backward = self.backward or out[_BACKWARD] > 0
            if out[_ERROR]:
                self._peer = FsdpPeerError("another rank raised an error inside this FSDP micro-batch; "
                                           "every rank left it")
            else:
                self._peer = FsdpPeerOutOfMemoryError(
                    f"{int(out[_OOM])} other rank(s) failed to allocate inside this FSDP micro-batch; every rank "
                    "abandons it (a peer's OOM, not this rank's)")
            raise self._peer

    def ensure_checked(self) -> None:
        """Before this micro-batch's weight is used: a check of this micro-batch
        has given the global units (an explicit check if no FSDP collective ran)."""
        if self.checks == self._checks_at_start:
            self.check()

    def answer(self, oom: bool) -> None:
        """The failing rank's side: answers the check the others are about to run."""
        out = self._exchange(oom, not oom)
        self.abandoned += 1
        self.backward = self.backward or out[_BACKWARD] > 0

    # ---- what TrainStep calls ----
    def begin_step(self, samples: int, units: Optional[int]) -> None:
        self.local_samples = int(samples)
        self.local_units = int(samples if units is None else units)
        self.sq_norm_local = 0.0

    def run_micro(self, body: Callable[[], None], last: bool, sq_norm: Optional[Callable[[], float]],
                  mark_phase: Callable[[str], None]) -> None:
        """One micro-batch under the agreement: ``body`` (forward and backward;
        it sets ``self.backward`` before backward and calls ``ensure_checked``
        before it needs the global units), a check at the end of the step's
        last micro-batch (with the gradient's squared
        norm when ``sq_norm`` is given)."""
        self.backward = False
        self._peer = None
        self.sq_norm_local = 0.0
        for m in self.modules:
            m.set_requires_gradient_sync(True, recurse=False) if self._sync_every or last else \
                m.set_requires_gradient_sync(False, recurse=False)
        self._checks_at_start = self.checks
        try:
            # No check of its own at the start: the first FSDP collective's check comes before anything
            # of this micro-batch that needs other ranks (see ensure_checked), and a failure since the
            # previous check is answered there (its phase word makes every rank redo the step when the
            # failing rank was in backward of the micro-batch before).
            body()
            if last:
                if sq_norm is not None:
                    self.sq_norm_local = sq_norm()
                self.check()
        except BaseException as e:  # noqa: BLE001 - every failure must be answered, then re-raised
            if self._peer is None:
                if isinstance(e, (KeyboardInterrupt, SystemExit, TimeoutError)):
                    raise
                self.answer(_errors.oom_kind(e) is not None)
            self.restore()
            if self.backward:
                mark_phase("backward")
            raise
        finally:
            self._peer = None

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
            pg._training_state = TrainingState.IDLE
            pg._post_forward_indices.clear()
            pg._post_reduce_event = None
            pg._all_reduce_state = None
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
