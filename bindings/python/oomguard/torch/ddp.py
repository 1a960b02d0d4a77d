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
  rank has failed. With the bucket DDP launches last (``GradBucket.is_last``)
  it also launches the round's *status*: one all-reduce of three float64 words
  (ranks that redo, ranks that go to the vote, this rank's loss units). It is
  asynchronous, and the future DDP waits for that bucket completes only when
  both have: when backward returns, every rank knows the round's outcome
  without a collective of its own after backward;
* the reducer's per-parameter hooks, replaced by hooks that call the reducer
  themselves, so that oomguard knows which parameters the reducer has marked
  ready. The last parameter of a round is marked only once backward has
  finished (a final callback of the autograd engine), so that a backward that
  fails never leaves the reducer with every bucket launched but unfinished.

Per round every rank runs the same collectives in the same order: DDP's
buckets in index order (the same layout on every rank) and then the status.
DDP rebuilds its buckets once, after its first iteration, with a broadcast
from rank 0 in its next forward; a rank that goes to the vote runs no forward,
so oomguard runs the rebuild itself at the end of the first round, where every
rank is. A rank's status goes out with
its last bucket, so its flag is whatever the rank knew when it sent that
bucket, and the sum of the flags is the round's outcome on every rank:

* 0: every rank sent its whole share; the gradients are the global mean.
* redo: some rank failed inside the round and sent the rest of it as zeros.
  Every rank runs exactly one more round: the failing rank after its guard
  re-planned (or, if its guard gives up, as zeros with "vote", below), the
  others by redoing their own micro-batches (same sizes, inside their last
  micro-batch call).
* vote: some rank goes to the guard's vote with a failure. Every rank skips
  the rest of its local work and goes to the vote, where the failing rank's
  outcome ends the step on every rank as it does today.

Where a rank fails, and what it still owes:

* before its round began (forward, an earlier micro-batch, the last forward):
  nothing was launched. Its guard re-plans and its new last micro-batch runs
  the round the others wait in; or, if the guard goes to the vote, right
  before the guard's first collective the rank runs its whole round as zeros
  with "vote" (the coordinator's before-collective hook).
* inside backward, k of B buckets launched (its status not sent): the guard's
  reset marks the remaining parameters inside a zero-cost backward, the hook
  sends their buckets as zeros, the last one's status says "redo" (or "vote"
  if the guard goes to the vote instead), the reducer finishes as usual.
  An error in the hook itself (the scaling) sends that bucket and the rest as
  zeros with "redo" in the same round.
* after its status went out (while backward waits on the futures, an OOM in
  DDP's finalize): the others will take the round as
  complete, and it is: every bucket of this rank was sent with its share. The
  rank waits for the round's futures (bounded by the guard's deadline) and
  copies each bucket's summed buffer into the gradients itself, which is what
  DDP's finalize would have done; then the error goes to the guard, which
  counts it, and whatever its ladder does next reaches the others through
  the vote (the redone micro-batches are skipped: the round is complete; a
  rollback or a failure is the vote's). If the copy fails, the rank fails
  with an error, which the vote carries to every rank (the step stops there
  on every rank, nobody applies).
* a bucket's or the status's all-reduce fails (a peer is gone): the process
  group is unusable; the rank aborts the coordinator and exits 75.

So no rank ever waits for a collective a peer will not run: each round is the
same B + 1 collectives on every rank, every rank learns the same outcome from
the same status, and a rank runs another round exactly when that outcome is
"redo". No rank applies a gradient that misses a peer's share: a peer that
sent zeros flagged the round, and a round is applied only with every flag 0.

Why not the status appended to a bucket (one collective fewer per round): the
last bucket often holds the largest single parameter (DDP never splits one; a
GPT's embedding), and appending words means a copy of it, allocated inside
backward, where the OOMs this mode recovers from happen (or a copy kept for
the whole run). The status launched right after the last bucket costs no
memory and runs while that bucket is on the wire (NCCL queues it right
behind; gloo runs it on its second thread).

The shares need the global batch's units, which no collective of the step
carries before the first bucket. Each rank scales its buckets by its units
over the total of the previous round (1 after a round without units; the
same number on every rank: every rank reads it from the same status), and the status carries the round's
units: when the total differs (a batch of another size; the units of token
counts), every rank multiplies its summed gradients by the old total over
the new one, the same factor on every rank, exact within rounding. Only the
first step of a TrainStep runs an all-reduce of the units before its round.
Why not the next step's units in this step's vote or agreement: they come
with the next batch, which the user hands to the next call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import errors as _errors
from .distributed import completed_by

__all__ = ["DdpOverlap", "set_bucket_faults", "clear_bucket_faults", "split_fault_spec"]

REDO, VOTE = 1, 2  # a round's outcome besides 0 (the gradients are the global batch's)
LAST = -1  # after=last in a bucket fault rule

# ---- injected OOMs inside backward, after K buckets were launched (tests) ----

_bucket_rules: List[dict] = []


def split_fault_spec(spec: str) -> Tuple[str, str]:
    """Splits a fault spec into the native rules and the ``site=bucket`` rules,
    which the native sites cannot express, each
    ``oom@site=bucket,WHERE[,step=S][,rank=R][,times=N]`` in the backward of a
    rank's last micro-batch, WHERE one of: ``after=K``, once K buckets of its
    round were launched; ``after=last``, once the last bucket and the status
    were launched, while backward waits on them; ``hook=K``, in the comm hook
    of the round's bucket K (from 0, in launch order), before its scaling."""
    native, bucket = [], []
    for rule in filter(None, (r.strip() for r in spec.split(";"))):
        (bucket if "site=bucket" in rule.replace(" ", "") else native).append(rule)
    return ";".join(native), ";".join(bucket)


def set_bucket_faults(spec: str) -> None:
    """Sets the ``site=bucket`` rules (see ``split_fault_spec``); an empty spec clears them."""
    rules = []
    usage = "expected oom@site=bucket,after=K|after=last|hook=K[,step=S][,rank=R][,times=N]"
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
        unknown = set(fields) - {"site", "step", "rank", "after", "hook", "times"}
        if unknown or fields.get("site") != "bucket" or ("after" in fields) == ("hook" in fields):
            raise ValueError(f"bucket fault {rule!r}: {usage}")
        last = fields.get("after") == "last"
        if last:
            fields["after"] = "0"
        try:
            parsed = {k: int(v) for k, v in fields.items() if k != "site"}
        except ValueError:
            raise ValueError(f"bucket fault {rule!r}: step, rank, after (or last), hook and times are "
                             "integers") from None
        if parsed.get("after", 0) < 0 or parsed.get("hook", 0) < 0 or parsed.get("times", 1) < 1:
            raise ValueError(f"bucket fault {rule!r}: after >= 0 or after=last, hook >= 0, times >= 1")
        if last:
            parsed["after"] = LAST
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
        # The round's status: ranks that redo, ranks that go to the vote, loss units.
        self._status = torch.zeros(3, dtype=torch.float64, device=device)
        self._status_host = torch.zeros(3, dtype=torch.float64)
        self._units_buf = torch.zeros(1, dtype=torch.float64, device=device)
        self._local_units = 0.0
        # The global units the buckets are scaled for: the last round's total (1
        # after a total of 0), the same on every rank. None before the first step.
        self._guess: Optional[float] = None
        self._scale = 1.0  # this rank's units over _guess: its share, if this round's total is the same
        self._deadline_s = 600.0
        self._rebuilt = False  # DDP's buckets were rebuilt after its first iteration (or asked to)
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
        self._flag = 0           # what this rank's status says (0, REDO or VOTE)
        self._zeroing = False    # the hook sends zeros
        self._launched = 0
        self._buckets: List[Tuple[Any, torch.futures.Future]] = []  # this round's, as launched
        self._status_future: Optional[torch.futures.Future] = None  # set once the status was launched
        self._inject_late: Optional[dict] = None
        self._inject_hook: Optional[dict] = None
        self.hook_error: Optional[BaseException] = None
        self.late_error: Optional[BaseException] = None  # raised while backward waited on the round
        self.comm_error: Optional[BaseException] = None  # a bucket's all-reduce failed (a peer is gone)
        # the attempt (from the step's start, or the guard's collectives, to its next collective)
        self._attempt_open = False
        self._round_result: Optional[int] = None  # None: no round ended in this attempt; 0 ok; REDO/VOTE
        self.rounds = 0          # rounds this rank took part in (tests)
        self.failed_rounds = 0   # rounds that ended with a flag
        self.rescaled_rounds = 0  # rounds whose total units differed from the previous round's

    # ---- hooks ----

    @staticmethod
    def _bucket_hook(self, bucket):  # no annotations: DDP checks them against its own types
        buf = bucket.buffer()
        try:
            rule = self._inject_hook
            if rule is not None and self._launched == rule["hook"]:
                self._inject_hook = None
                rule["times"] -= 1
                raise _errors.InjectedOutOfMemoryError(
                    f"injected OOM in the comm hook of bucket {self._launched} of the round on rank {self._rank} "
                    f"(site=bucket, hook={rule['hook']})", "device", 1 << 20)
            if self._zeroing:
                buf.zero_()
            elif self._scale != 1.0:
                buf.mul_(self._scale)
        except BaseException as e:  # noqa: BLE001 - the bucket must be sent whatever happened
            # This rank's share is lost for this round: the rest goes as zeros
            # and its status says "redo" (the guard hears of the error after backward).
            self.hook_error = self.hook_error or e
            self._zeroing = True
            self._flag = max(self._flag, REDO)
            buf.zero_()
        self._launched += 1
        fut = dist.all_reduce(buf, group=self._group, async_op=True).get_future()
        self._buckets.append((bucket, fut))
        if not bucket.is_last():
            return fut.then(self._bucket_done)
        # The round's status, right behind its last bucket.
        host = self._status_host
        host[0] = 1.0 if self._flag == REDO else 0.0
        host[1] = 1.0 if self._flag == VOTE else 0.0
        host[2] = self._local_units
        self._status.copy_(host)
        status = dist.all_reduce(self._status, group=self._group, async_op=True).get_future()
        self._status_future = status
        return torch.futures.collect_all([fut, status]).then(self._last_done)

    def _bucket_done(self, f: torch.futures.Future) -> torch.Tensor:
        try:
            return f.value()[0]
        except Exception as e:  # noqa: BLE001 - the process group failed: no redo can help
            self.comm_error = self.comm_error or e
            raise

    def _last_done(self, f: torch.futures.Future) -> torch.Tensor:
        bucket, status = f.value()
        try:
            status.wait()
            out = bucket.value()[0]
        except Exception as e:  # noqa: BLE001 - as _bucket_done
            self.comm_error = self.comm_error or e
            raise
        rule, self._inject_late = self._inject_late, None
        if rule is not None:
            rule["times"] -= 1
            self.late_error = _errors.InjectedOutOfMemoryError(
                f"injected OOM in backward on rank {self._rank} after the last bucket and the status of the "
                f"round were launched (site=bucket, after=last)", "device", 1 << 20)
            raise self.late_error
        return out

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
            if rule.get("after", LAST) == LAST or rule["times"] <= 0 or rule.get("step", step) != step or \
                    rule.get("rank", self._rank) != self._rank:
                continue
            if self._launched >= rule["after"]:
                rule["times"] -= 1
                raise _errors.InjectedOutOfMemoryError(
                    f"injected OOM in backward at step {step} on rank {self._rank} after {self._launched} "
                    f"bucket(s) of the round were launched (site=bucket)", "device", 1 << 20)

    def _arm_faults(self) -> None:
        """This round's after=last and hook=K rules (they fire on other threads,
        where the guard's step is not asked)."""
        if not _bucket_rules:
            return
        step = self._step_of()
        for rule in _bucket_rules:
            if rule["times"] > 0 and rule.get("step", step) == step and rule.get("rank", self._rank) == self._rank:
                if rule.get("after") == LAST and self._inject_late is None:
                    self._inject_late = rule  # fires (and counts) once the status is out
                elif "hook" in rule and self._inject_hook is None:
                    self._inject_hook = rule

    # ---- the round ----

    def start_step(self, local_units: float, deadline_s: float) -> None:
        """This rank's units for the step's rounds. Only on a TrainStep's first
        step, which has no previous round's total: one all-reduce of the units,
        polled against the guard's deadline."""
        self._local_units = float(local_units)
        self._deadline_s = deadline_s
        if self._guess is None:
            self._units_buf.fill_(self._local_units)
            work = dist.all_reduce(self._units_buf, group=self._group, async_op=True)
            try:
                self._coordinator._wait([work], deadline_s, "the DDP overlap mode's units all-reduce")
            except TimeoutError as e:
                raise _errors.CoordinationTimeoutError(str(e)) from None
            self._guess = float(self._units_buf.item()) or 1.0
        self._scale = self._local_units / self._guess

    def _start_round(self) -> None:
        self._marked = set()
        self._launched = 0
        self._flag = 0
        self._zeroing = False
        self._buckets = []
        self._status_future = None
        self._inject_late = None
        self._inject_hook = None
        self.hook_error = None
        self.late_error = None
        self._in_round = True

    def begin_round(self) -> None:
        """Right before the last micro-batch's backward (DDP's forward under sync
        has prepared the reducer)."""
        self._start_round()
        self._arm_faults()

    @property
    def status_sent(self) -> bool:
        """This round's status (and so every bucket of it) was launched."""
        return self._status_future is not None

    def end_round(self, flag: int = 0, failed: bool = False) -> Tuple[bool, bool]:
        """Completes this rank's round and reads its status. ``failed``: after
        an error inside the round. What is still owed goes first: buckets of
        parameters not marked yet, as zeros when ``flag`` (the status then says
        ``flag``); or the whole round when none of it began. After an error past
        the status (``status_sent``) the flag cannot change: the rank finishes
        DDP's work on the summed buckets itself. Returns (ok, vote): ok when
        every rank's share is in the gradients (then the global mean); vote
        when some rank goes to the guard's vote."""
        late = failed and self._in_round and self.status_sent
        try:
            if not self._in_round:
                # No backward of this rank began this round: the whole round from here.
                self._start_round()
                self._reducer.prepare_for_backward([])
            if not self.status_sent:
                if flag:
                    self._flag = max(self._flag, flag)
                    self._zeroing = True
                self._pay()
            self._wait_round()
            if late:
                self._copy_buckets()
        except Exception as e:
            if self.comm_error is not None or _is_comm_failure(e):
                raise self.lost_peer(self.comm_error or e) from e
            raise
        finally:
            self._in_round = False
        if not self._rebuilt:
            # DDP rebuilds its buckets after its first iteration, with a broadcast
            # from rank 0 in the next forward. Here instead, at the same point on
            # every rank: a rank that goes to the vote, or runs a whole round
            # here, runs no forward, and two rounds would record every
            # parameter twice for the rebuild (an internal assert of DDP's).
            self._reducer._rebuild_buckets()
            self._rebuilt = True
        redo, vote, total = self._status.tolist()
        self.rounds += 1
        self._round_result = VOTE if vote else (REDO if redo else 0)
        if vote or redo:
            self.failed_rounds += 1
            # Nobody applies these gradients: free them now (a rollback or a
            # redo that follows needs the memory more than a reset does).
            for p in self._params:
                p.grad = None
        elif total != self._guess:
            # The buckets were scaled by the units over the previous round's
            # total: the same correction on every rank (a total of 0: no
            # units, a zero gradient, as the guard's sum gives).
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self._guess / total if total > 0 else 0.0)
            self.rescaled_rounds += 1
        self._guess = total or 1.0
        self._scale = self._local_units / self._guess
        return not (vote or redo), bool(vote)

    def _pay(self) -> None:
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
        if not self.status_sent:  # cannot happen: every parameter marked launches every bucket
            raise RuntimeError("ddp_overlap: every parameter was marked but DDP did not launch its last bucket")

    def _wait_round(self) -> None:
        """Every future of the round completed (at once after a backward that
        returned: DDP waited for them), polled against the guard's deadline."""
        futures = [f for _, f in self._buckets] + [self._status_future]
        if not _completed_by(futures, self._deadline_s):
            raise self.lost_peer(TimeoutError(f"the DDP round's all-reduces did not complete within "
                                              f"{self._deadline_s:.3f} s"))
        for f in futures:
            f.wait()  # completed: returns at once, or raises the all-reduce's error

    def _copy_buckets(self) -> None:
        """What DDP's finalize does after the round, done here after a failure
        that may have cut it short: each summed bucket into its gradients."""
        for bucket, _ in self._buckets:
            for p, view in zip(bucket.parameters(), bucket.gradients()):
                view = view.view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                elif p.grad.data_ptr() != view.data_ptr():
                    p.grad.copy_(view)

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
        """The guard is about to run a collective: a round this attempt still
        owes (none ended yet, or the last one said "redo") is paid now, as zeros
        with the status "vote"; one in flight is finished first."""
        if not self._attempt_open:
            return
        self._attempt_open = False
        if self._in_round:
            self.end_round(VOTE, failed=True)
        if self._round_result in (None, REDO):
            self.end_round(VOTE)


def _completed_by(futures: Sequence[torch.futures.Future], deadline_s: float) -> bool:
    return completed_by([_Done(f) for f in futures], deadline_s)


class _Done:
    """A future as ``completed_by`` polls it."""

    def __init__(self, future: torch.futures.Future) -> None:
        self._f = future

    def is_completed(self) -> bool:
        return self._f.done()
