"""DDP with its bucketed all-reduce overlapped with the last backward, and the
step still atomic across ranks: the machinery behind ``TrainStep(...,
ddp_overlap=True)``.

Every micro-batch but a rank's last runs under ``no_sync``. The last one's
backward runs with DDP's sync on, so DDP launches each gradient bucket's
all-reduce as soon as the bucket is ready, while backward goes on: a *round*.
oomguard owns the round through two things it installs on the DDP model:

* a communication hook that multiplies each bucket by this rank's share of
  the global batch's loss units (or samples) before the all-reduce, so that the
  sum is the global mean, exact as in today's mode; or sends zeros when this
  rank has failed. The shares come from one small all-reduce of the units at
  the start of each step (with the guard's deadline);
* the reducer's per-parameter hooks, replaced by hooks that call the reducer
  themselves, so that oomguard knows which parameters the reducer has marked
  ready. The last parameter of a round is marked only once backward has
  finished (a final callback of the autograd engine), so that a backward that
  fails never leaves the reducer with every bucket launched but unfinished.

A round ends with one small all-reduce of two status words on every rank
(ranks that will redo the step locally, ranks that go to the guard's vote
with a failure): every rank then knows whether the round holds the global
batch's gradient or must be thrown away.

A rank that fails after its round began (an OOM in the last micro-batch's
backward, some buckets launched) still owes the others every remaining bucket
and the status. It pays them when the guard says what happens next:

* the guard redoes the step on this rank (its reset hook): the remaining
  parameters are marked inside a zero-cost backward, the hook sends their
  buckets as zeros, the reducer finishes the iteration as usual, and the
  status says "redo". The other ranks redo their own micro-batches (same
  sizes, inside their last micro-batch call) and every rank runs one new
  round; the failing rank's guard re-plans at a smaller size.
* the guard goes to its vote instead (the rank gives up, rolls back, or
  failed with an error; also a rank that failed before its round began):
  right before the guard's first collective the rank runs its whole round
  as zeros with the status "vote". Every other rank then skips the rest of
  its local work and goes to the vote, where the failing rank's outcome ends
  the step on every rank as it does today.

So no rank ever waits for a bucket a peer will not send, and no rank applies
a gradient that misses a peer's share. A failure in the forward of the last
micro-batch is local: no bucket was launched, the guard re-plans, and the new
last micro-batch runs the round the others are waiting in.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import errors as _errors

__all__ = ["DdpOverlap", "set_bucket_faults", "clear_bucket_faults", "split_fault_spec"]

REDO, VOTE = 1, 2

# ---- injected OOMs inside backward, after K buckets were launched (tests) ----

_bucket_rules: List[dict] = []


def split_fault_spec(spec: str) -> Tuple[str, str]:
    """Splits a fault spec into the native rules and the ``site=bucket`` rules
    (``oom@step=S,rank=R,site=bucket,after=K[,times=N]``): an OOM raised inside
    the backward of a rank's last micro-batch once K buckets of its round were
    launched, which the native sites cannot express."""
    native, bucket = [], []
    for rule in filter(None, (r.strip() for r in spec.split(";"))):
        (bucket if "site=bucket" in rule.replace(" ", "") else native).append(rule)
    return ";".join(native), ";".join(bucket)


def set_bucket_faults(spec: str) -> None:
    """Sets the ``site=bucket`` rules (see ``split_fault_spec``); an empty spec clears them."""
    rules = []
    for rule in filter(None, (r.strip() for r in spec.split(";"))):
        kind, _, args = rule.partition("@")
        if kind != "oom":
            raise ValueError(f"bucket fault {rule!r}: only 'oom' rules exist at site=bucket")
        fields = {}
        for kv in filter(None, args.split(",")):
            k, sep, v = kv.partition("=")
            if not sep:
                raise ValueError(f"bucket fault {rule!r}: {kv!r} is not key=value")
            fields[k.strip()] = v.strip()
        unknown = set(fields) - {"site", "step", "rank", "after", "times"}
        if unknown or fields.get("site") != "bucket" or "after" not in fields:
            raise ValueError(f"bucket fault {rule!r}: expected oom@site=bucket,after=K[,step=S][,rank=R][,times=N]")
        try:
            parsed = {k: int(v) for k, v in fields.items() if k != "site"}
        except ValueError:
            raise ValueError(f"bucket fault {rule!r}: step, rank, after and times are integers") from None
        if parsed["after"] < 0 or parsed.get("times", 1) < 1:
            raise ValueError(f"bucket fault {rule!r}: after >= 0, times >= 1")
        parsed.setdefault("times", 1)
        rules.append(parsed)
    _bucket_rules[:] = rules


def clear_bucket_faults() -> None:
    _bucket_rules.clear()


def _is_comm_failure(e: BaseException) -> bool:
    """A collective's own failure (a peer gone, a broken process group)."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e)
    return any(mark in text for mark in ("gloo", "Connection reset", "Connection closed", "NCCL", "timed out",
                                         "Timed out"))


def _reducer_params(ddp: Any) -> List[torch.nn.Parameter]:
    """The parameters in the reducer's variable order (DDP's own rule: by module,
    those that require grad and are not ignored, shared ones once)."""
    ignore = getattr(ddp, "parameters_to_ignore", set())
    seen, out = set(), []
    for mname, module in ddp.module.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{mname}.{pname}" not in ignore and p not in seen:
                seen.add(p)
                out.append(p)
    return out


class _MarkRest(torch.autograd.Function):
    """A zero-cost backward in which the remaining parameters are marked ready:
    the reducer queues its end-of-iteration work on the running backward."""

    @staticmethod
    def forward(ctx, x, mark):  # type: ignore[override]
        ctx.mark = mark
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ctx.mark()
        return g, None


class DdpOverlap:
    """The overlapped round of one DDP model (see the module docstring).

    ``TrainStep(..., ddp_overlap=True)`` creates and drives it; the methods
    here are its interface to TrainStep, not a user API. ``coordinator`` is
    the guard's TorchDistributedCoordinator: before the guard's first
    collective of a step this rank's round is paid if it is still owed.
    """

    def __init__(self, ddp: Any, coordinator: Any, step_of: Callable[[], int]) -> None:
        if getattr(ddp, "find_unused_parameters", False):
            raise ValueError("ddp_overlap needs DistributedDataParallel(find_unused_parameters=False): every "
                             "parameter is marked ready by oomguard's hooks (an unused one is sent as zeros)")
        if getattr(ddp, "static_graph", False):
            raise ValueError("ddp_overlap does not support DistributedDataParallel(static_graph=True)")
        if getattr(ddp, "mixed_precision", None) is not None or getattr(ddp, "_delay_all_reduce_params", None):
            raise ValueError("ddp_overlap does not support DDP's mixed_precision or delayed all-reduce parameters")
        if getattr(ddp, "_use_python_reducer", False):
            raise ValueError("ddp_overlap does not support DDP's python reducer (compiled autograd)")
        if not callable(getattr(coordinator, "set_before_collective", None)):
            raise ValueError("ddp_overlap needs the guard's coordinator to be an "
                             "oomguard.torch.TorchDistributedCoordinator")
        self._ddp = ddp
        self._reducer = ddp.reducer
        self._group = ddp.process_group
        self._step_of = step_of
        self._rank = dist.get_rank(self._group)
        self._params = _reducer_params(ddp)
        if not self._params:
            raise ValueError("ddp_overlap: the model has no parameter that requires grad")
        self._n = len(self._params)
        device = self._params[0].device
        self._status = torch.zeros(2, dtype=torch.float64, device=device)
        self._units_buf = torch.zeros(1, dtype=torch.float64, device=device)
        self._scale = 1.0  # this rank's share of the global batch's units
        # The reducer's own per-parameter hooks make way for ours, which call it.
        ddp._remove_autograd_hooks()
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                         for i, p in enumerate(self._params)]
        ddp.register_comm_hook(self, DdpOverlap._bucket_hook)
        coordinator.set_before_collective(self._before_collective)
        self._coordinator = coordinator
        # the round
        self._in_round = False   # the reducer is in an iteration this rank has begun
        self._marked: set = set()
        self._zeroing = False    # the hook sends zeros
        self._launched = 0
        self.hook_error: Optional[BaseException] = None
        self.comm_error: Optional[BaseException] = None  # a bucket's all-reduce failed (a peer is gone)
        # the attempt (from the step's start, or the guard's reset, to its next collective)
        self._attempt_open = False
        self._round_result: Optional[int] = None  # None: no round ended in this attempt; 0 ok; REDO/VOTE
        self.rounds = 0          # rounds this rank took part in (tests)
        self.failed_rounds = 0   # rounds that ended with a flag

    # ---- hooks ----

    @staticmethod
    def _bucket_hook(self, bucket):  # no annotations: DDP checks them against its own types
        buf = bucket.buffer()
        try:
            if self._zeroing:
                buf.zero_()
            elif self._scale != 1.0:
                buf.mul_(self._scale)
        except BaseException as e:  # noqa: BLE001 - the bucket must be sent whatever happened
            self.hook_error = self.hook_error or e
            self._zeroing = True
            buf.zero_()
        self._launched += 1
        fut = dist.all_reduce(buf, group=self._group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            try:
                return f.value()[0]
            except Exception as e:  # noqa: BLE001 - the process group failed: no redo can help
                self.comm_error = self.comm_error or e
                raise

        return fut.then(done)

    def _grad_ready(self, index: int, _param: torch.Tensor) -> None:
        if not self._in_round or index in self._marked:
            return
        if len(self._marked) == self._n - 1:
            # The round's last parameter: marked once this backward has
            # finished, so that a backward that fails leaves it (and its
            # bucket) for the redo or the vote to send.
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._mark_late, index))
        else:
            self._marked.add(index)
            self._reducer._autograd_hook(index)
        self._maybe_inject()

    def _mark_late(self, index: int) -> None:
        if self._in_round and index not in self._marked:
            self._marked.add(index)
            self._reducer._autograd_hook(index)

    def _maybe_inject(self) -> None:
        if not _bucket_rules:
            return
        step = self._step_of()
        for rule in _bucket_rules:
            if rule["times"] <= 0 or rule.get("step", step) != step or rule.get("rank", self._rank) != self._rank:
                continue
            if self._launched >= rule["after"]:
                rule["times"] -= 1
                raise _errors.InjectedOutOfMemoryError(
                    f"injected OOM in backward at step {step} on rank {self._rank} after {self._launched} "
                    f"bucket(s) of the round were launched (site=bucket)", "device", 1 << 20)

    # ---- the round ----

    def start_step(self, local_units: float, deadline_s: float) -> None:
        """Every rank's share of the global batch: one all-reduce of the loss
        units (or samples), polled against the guard's deadline."""
        self._units_buf.fill_(float(local_units))
        work = dist.all_reduce(self._units_buf, group=self._group, async_op=True)
        try:
            self._coordinator._wait([work], deadline_s, "the DDP overlap mode's units all-reduce")
        except TimeoutError as e:
            raise _errors.CoordinationTimeoutError(str(e)) from None
        total = float(self._units_buf.item())
        self._scale = float(local_units) / total if total > 0 else 0.0

    def begin_round(self) -> None:
        """Right before the last micro-batch's backward (DDP's forward under sync
        has prepared the reducer)."""
        self._marked = set()
        self._launched = 0
        self._zeroing = False
        self.hook_error = None
        self._in_round = True

    def end_round(self, flag: int = 0) -> Tuple[bool, bool]:
        """Completes this rank's round (whatever is still owed: buckets of
        parameters not marked yet, as zeros when ``flag``; or the whole round
        when it never began) and runs the status. Returns (ok, vote): ok when
        every rank's share is in the gradients (then already the global mean);
        vote when some rank goes to the guard's vote with a failure."""
        if flag:
            self._zeroing = True
        if not self._in_round:
            # No backward of this rank began this round: the whole round from here.
            self._marked = set()
            self._launched = 0
            self._reducer.prepare_for_backward([])
            self._in_round = True
        try:
            self._pay(flag)
        except Exception as e:
            if self.comm_error is not None or _is_comm_failure(e):
                raise self.lost_peer(self.comm_error or e) from e
            raise
        redo, vote = self._status.tolist()
        self.rounds += 1
        self._round_result = VOTE if vote else (REDO if redo else 0)
        if vote or redo:
            self.failed_rounds += 1
            # Nobody applies these gradients: free them now (a rollback or a
            # redo that follows needs the memory more than a reset does).
            for p in self._params:
                p.grad = None
            return False, bool(vote)
        return True, False

    def _pay(self, flag: int) -> None:
        # Not marked: after a failed backward, what it did not reach (the
        # deferred last parameter included); after a whole backward, nothing.
        rest = [i for i in range(self._n) if i not in self._marked]
        if rest:
            def mark() -> None:
                for i in rest:
                    self._marked.add(i)
                    self._reducer._autograd_hook(i)

            x = torch.zeros((), dtype=self._status.dtype, device=self._status.device, requires_grad=True)
            _MarkRest.apply(x, mark).backward()
        self._in_round = False
        self._status[0] = 1.0 if flag == REDO else 0.0
        self._status[1] = 1.0 if flag == VOTE else 0.0
        dist.all_reduce(self._status, group=self._group)  # blocking; bounded by the process group's timeout

    # ---- the attempt ----

    def open_attempt(self) -> None:
        self._attempt_open = True
        self._round_result = None

    def close_attempt(self) -> None:
        self._attempt_open = False

    @property
    def attempt_open(self) -> bool:
        return self._attempt_open

    @property
    def round_result(self) -> Optional[int]:
        return self._round_result

    def clear_result(self) -> None:
        self._round_result = None

    @property
    def owes_round(self) -> bool:
        """This rank began a round (its last micro-batch's backward) that has not ended."""
        return self._in_round

    def lost_peer(self, error: BaseException) -> BaseException:
        """The error to raise for a round whose collective failed: the process
        group is unusable, so the guard's coordinator is broken too (its next
        collective fails at once) and the rank exits with 75 to be restarted."""
        self._coordinator.abort()
        self._attempt_open = False
        return _errors.CoordinationTimeoutError(
            f"a gradient bucket's all-reduce failed inside the DDP round (a peer is gone): "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")

    def _before_collective(self) -> None:
        """The guard is about to run a collective: a round still owed this
        attempt is paid now, as zeros with the status "vote"."""
        if not self._attempt_open:
            return
        self._attempt_open = False
        if self._round_result is None:
            self.end_round(VOTE)
