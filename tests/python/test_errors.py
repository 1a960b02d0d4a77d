"""Error classes, and errors crossing the Python/C++ boundary in both directions."""

from __future__ import annotations

import pytest
import torch

import oomguard
from oomguard import errors


def test_error_classes_subclass_the_natural_builtin():
    assert issubclass(oomguard.OutOfMemoryError, MemoryError)
    assert issubclass(oomguard.RolledBackError, RuntimeError)
    assert issubclass(oomguard.CoordinationTimeoutError, TimeoutError)
    assert issubclass(oomguard.CorruptCheckpointError, OSError)
    assert issubclass(oomguard.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(oomguard.InvalidArgumentError, ValueError)
    for cls in (oomguard.OutOfMemoryError, oomguard.RolledBackError, oomguard.CoordinationTimeoutError,
                oomguard.CorruptCheckpointError, oomguard.InvalidArgumentError, oomguard.FailedPreconditionError):
        assert issubclass(cls, oomguard.OomguardError)
    assert oomguard.CoordinationTimeoutError.exit_code == 75 == oomguard.EXIT_COORDINATION_TIMEOUT


def test_oom_recognised_by_type_first_message_last():
    assert errors.oom_kind(MemoryError()) == "host"
    cuda_oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert errors.oom_kind(cuda_oom) == "device"
    verdict = errors._classify_for_guard(cuda_oom)
    # torch 2 raises torch.OutOfMemoryError (torch.cuda's name is an alias of it).
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    assert verdict[1] == "torch.OutOfMemoryError" and verdict[3] == 2 << 30 and verdict[4] is False
    # torch's OOM type with an unfamiliar message is still an OOM (the type decides).
    assert errors.oom_kind(torch.cuda.OutOfMemoryError("allocator said no")) == "device"
    # What torch 1.13's CPU allocator raises: a RuntimeError, recognised by message.
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:75] data. DefaultCPUAllocator: not enough memory: "
                       "you tried to allocate 1073741824 bytes.")
    assert errors.oom_kind(cpu) == "host"
    assert errors.oom_kind(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")) == "workspace"
    # Not OOMs: another type mentioning memory, or a RuntimeError that is not a failure.
    assert errors.oom_kind(ValueError("out of memory")) is None
    assert errors.oom_kind(RuntimeError("memory usage is fine")) is None
    assert errors.oom_kind(KeyError("x")) is None


def test_unrecoverable_oom_raises_memory_error_with_report():
    guard = oomguard.Guard()

    def always(mb):
        raise MemoryError("no memory at all")

    with pytest.raises(MemoryError) as info:
        guard.step(4, always, reset=lambda: None)
    e = info.value
    assert isinstance(e, oomguard.OutOfMemoryError)
    assert e.code == "RESOURCE_EXHAUSTED"
    assert e.report.ooms == 3  # sizes 4, 2, 1
    assert "incident" in str(e) and "remedies" in str(e)
    assert e.report.incidents[-1].action == "give_up"


def test_non_oom_exception_passes_through_unchanged_even_if_it_mentions_memory():
    guard = oomguard.Guard()
    calls = []

    class Custom(ValueError):
        pass

    raised = Custom("cache out of memory (not really)")

    def micro(mb):
        calls.append(mb.size)
        raise raised

    with pytest.raises(Custom) as info:
        guard.step(8, micro, reset=lambda: calls.append("reset"))
    assert info.value is raised
    assert info.value.__traceback__ is not None
    assert calls == [8], "a non-OOM error must not be retried or trigger a reset"
    assert guard.total_ooms == 0


def test_exception_in_apply_passes_through():
    guard = oomguard.Guard()

    def apply():
        raise KeyError("optimizer bug")

    with pytest.raises(KeyError, match="optimizer bug"):
        guard.step(2, lambda mb: None, apply=apply, reset=lambda: None)


def test_oom_in_backward_without_reset_is_failed_precondition():
    guard = oomguard.Guard()

    def micro(mb):
        guard.mark_phase("backward")
        if mb.size > 1:
            raise MemoryError()

    with pytest.raises(oomguard.FailedPreconditionError, match="no reset hook"):
        guard.step(4, micro)


def test_training_step_without_reset_is_refused_before_any_micro_batch():
    guard = oomguard.Guard()
    ran = []
    with pytest.raises(oomguard.FailedPreconditionError, match="StepRequest.reset must be set"):
        guard.step(4, lambda mb: ran.append(mb.size), apply=lambda: None)
    assert ran == []
    assert not hasattr(guard, "set_reset_hook"), "one way to set the hook: the step's reset"


def test_invalid_options_and_fault_rules_are_value_errors():
    with pytest.raises(ValueError, match="min_micro_batch"):
        oomguard.Guard(min_micro_batch=0)
    with pytest.raises(oomguard.InvalidArgumentError, match="bogus"):
        oomguard.set_fault_rules("bogus@step=1")
    with pytest.raises(ValueError, match="unknown phase"):
        oomguard.Guard().mark_phase("lunch")


class _TimingOutCoordinator(oomguard.Coordinator):
    """A Python coordinator whose collectives never get an answer."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def rank(self):
        return 0

    def size(self):
        return 2

    def engine(self):
        return "test"

    def allgather(self, mine, deadline_s):
        self.calls += 1
        assert deadline_s == pytest.approx(0.25)
        raise TimeoutError("peer 1 did not answer")


def test_coordination_timeout_raises_timeout_error():
    coordinator = _TimingOutCoordinator()
    guard = oomguard.Guard(coordinator=coordinator, vote_deadline_ms=250)
    with pytest.raises(TimeoutError) as info:
        guard.step(2, lambda mb: None, apply=lambda: pytest.fail("apply must not run without agreement"),
                   reset=lambda: None)
    e = info.value
    assert isinstance(e, oomguard.CoordinationTimeoutError)
    assert e.code == "UNAVAILABLE"
    assert "peer 1 did not answer" in str(e)
    assert coordinator.calls == 1
    assert e.report.incidents and e.report.incidents[0].kind == "coordination"


def test_python_coordinator_carries_the_whole_step():
    """A one-rank Python coordinator: the vote and the agreement arrive as
    all-gathers, the sync as a sum of the step's own buffers (scale 1 here),
    or inside the vote when they are small (8 host floats or fewer)."""
    import numpy as np

    class Single(_TimingOutCoordinator):
        def size(self):
            return 1

        def allgather(self, mine, deadline_s):
            self.calls += 1
            return list(mine)

        def allreduce_sum(self, buffers, deadline_s):
            self.sums.append([(type(b).__name__, scale) for b, scale in buffers])

    c = Single()
    c.sums = []
    guard = oomguard.Guard(coordinator=c)
    grad = np.zeros(9)
    done = []

    def micro(mb):
        grad[:] += mb.weight

    report = guard.step(3, micro, apply=lambda: done.append(grad.copy()), reset=lambda: grad.fill(0),
                        sync=lambda: [grad])
    assert report.status.ok and len(done) == 1 and c.calls == 2  # the vote and the agreement
    assert done[0] == pytest.approx([1.0] * 9)
    assert len(c.sums) == 1 and c.sums[0][0] == ("ndarray", 1.0), c.sums
    assert c.sums[0][-1][0] == "ndarray", "the guard's sequence words travel as a float64 array"
    # A loss alone rides in the vote: no sum of its own, the same result.
    loss = np.zeros(1)

    def micro_loss(mb):
        loss[:] += mb.weight * 2.0

    report = guard.step(3, micro_loss, apply=lambda: done.append(loss.copy()), reset=lambda: loss.fill(0),
                        sync=lambda: [loss])
    assert report.status.ok and c.calls == 4 and len(c.sums) == 1, c.sums
    assert done[1] == pytest.approx([2.0])
    assert guard.finish() == -1


def test_peer_failure_is_its_own_error_class():
    assert issubclass(oomguard.PeerFailedError, oomguard.OomguardError)
    e = oomguard.errors._from_status(1, "CANCELLED", "rank 2 stopped at step 4: ValueError: bad batch", None)
    assert isinstance(e, oomguard.PeerFailedError) and "rank 2" in str(e)
