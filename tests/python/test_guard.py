"""The guarded step from Python: recovery order, the GIL, the knowledge base."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

import oomguard


class _Big:
    """Stands in for a tensor held by a frame of the failing micro-batch."""


def test_oom_exception_and_frames_are_dropped_before_caches_are_released():
    guard = oomguard.Guard(collect_garbage=False, empty_cuda_cache=False)
    refs = []
    alive_at_release = []
    guard.add_cache_releaser("check", lambda: alive_at_release.append([r() is not None for r in refs]))

    def forward(mb):
        activations = _Big()  # a local of the frame the traceback holds
        refs.append(weakref.ref(activations))
        if mb.size > 2:
            raise MemoryError("activations do not fit")

    report = guard.step(4, lambda mb: forward(mb), reset=lambda: None)
    assert report.ooms == 1 and report.cache_releases == 1
    # No gc ran: only dropping the exception (and its traceback) can free the frame's locals.
    assert alive_at_release == [[False]]


def test_completed_micro_batches_are_kept_after_an_oom_in_forward():
    guard = oomguard.Guard(initial_micro_batch=2)
    done = []
    resets = []

    def micro(mb):
        guard.mark_phase("forward")
        if mb.offset == 4 and mb.size == 2 and not resets and len(done) == 2:
            raise MemoryError("forward of the third micro-batch")
        guard.mark_phase("backward")
        done.append((mb.offset, mb.size, mb.weight))

    report = guard.step(8, micro, reset=lambda: resets.append(True))
    assert report.status.ok and report.ooms == 1
    assert resets == [], "an OOM in forward keeps the gradients of completed micro-batches"
    assert [d[:2] for d in done] == [(0, 2), (2, 2), (4, 1), (5, 1), (6, 1), (7, 1)]
    assert sum(d[2] for d in done) == pytest.approx(1.0, abs=1e-15)


def test_oom_in_backward_resets_and_redoes_the_step():
    guard = oomguard.Guard(initial_micro_batch=4)
    log = []

    def micro(mb):
        guard.mark_phase("backward")
        if mb.size == 4 and mb.index == 1:
            raise MemoryError()
        log.append((mb.offset, mb.size))

    report = guard.step(8, micro, reset=lambda: log.append("reset"))
    assert report.ooms == 1
    assert log == [(0, 4), "reset", (0, 2), (2, 2), (4, 2), (6, 2)]


def test_other_python_threads_run_while_the_guard_waits():
    """The GIL is released during the C++ step: an injected 400 ms delay at the
    vote leaves a Python thread free to count."""
    oomguard.set_fault_rules("delay@site=vote,ms=400")
    guard = oomguard.Guard()
    ticks = []
    stop = threading.Event()

    def counter():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)

    t = threading.Thread(target=counter)
    t.start()
    time.sleep(0.02)
    try:
        start = time.monotonic()
        guard.step(2, lambda mb: None)
        end = time.monotonic()
    finally:
        stop.set()
        t.join()
    assert end - start >= 0.35
    during = [x for x in ticks if start < x < end]
    assert len(during) >= 20, f"only {len(during)} ticks while the guard waited: the GIL was held"


def test_two_ranks_as_python_threads_agree_through_the_thread_group():
    """Each rank blocks in the C++ vote until the other arrives; with the GIL
    held by the first, the second could never vote and both would time out."""
    coordinators = oomguard.make_thread_group(2)
    guards = [oomguard.Guard(coordinator=c, vote_deadline_ms=20000, initial_micro_batch=4) for c in coordinators]
    reports = [None, None]
    commits = [0, 0]
    errors = []

    def run(rank):
        try:
            def micro(mb):
                time.sleep(0.01)
                if rank == 1 and mb.size == 4:
                    raise MemoryError("rank 1 only")

            for _ in range(3):
                reports[rank] = guards[rank].step(8, micro, apply=lambda: commits.__setitem__(rank, commits[rank] + 1),
                                                  reset=lambda: None)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert time.monotonic() - start < 15
    assert commits == [3, 3]
    assert guards[0].total_ooms == 0 and guards[1].total_ooms == 1
    assert guards[1].micro_limit == 2 and guards[0].micro_limit == 4
    assert [r.step for r in reports] == [2, 2]


def test_incidents_reach_the_knowledge_base(tmp_path):
    kb = oomguard.KnowledgeBase(str(tmp_path / "incidents.db"))
    guard = oomguard.Guard(knowledge_base=kb, workload="test-workload", initial_micro_batch=8)

    def micro(mb):
        if mb.size > 4:
            raise MemoryError("too big")

    report = guard.step(8, micro, reset=lambda: None)
    assert report.ooms == 1
    kb.record_clean_micro_batch("test-workload", report.largest_micro)
    kb.flush()
    found = kb.query(workload="test-workload")
    assert [i.id for i in found] == [report.incidents[0].id]
    assert found[0].kind == "host" and found[0].exception_type == "MemoryError"
    assert found[0].outcome == "recovered" and found[0].pattern != ""
    assert kb.prior_micro_batch("test-workload") == 4
    del guard  # the guard goes before the knowledge base it writes to


class _LinearDevice(oomguard.Device):
    """A device whose micro-batch of size s needs `unit` bytes per sample on
    top of a fixed base; what does not fit raises an allocator-style OOM."""

    def __init__(self, unit, fits):
        super().__init__()
        self.unit, self.base = unit, 100 << 20
        self.capacity = self.base + unit * fits + unit // 2
        self.peak = self.base

    def name(self):
        return "linear:0"

    def stats(self):
        s = oomguard.MemoryStats()
        s.total, s.allocated, s.reserved = self.capacity, self.base, self.base
        s.free, s.peak_allocated = self.capacity - self.base, self.peak
        return s

    def release_caches(self):
        pass

    def reset_peak(self):
        self.peak = self.base

    def run(self, mb):
        need = self.unit * mb.size
        if self.base + need > self.capacity:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate {need / 2**20:.2f} MiB (GPU 0)")
        self.peak = max(self.peak, self.base + need)


def _cold_start(controller, fits=300, steps=30):
    device = _LinearDevice(4 << 20, fits)
    guard = oomguard.Guard(device=device, initial_micro_batch=4096, controller=controller)
    ooms = sum(guard.step(4096, device.run, reset=lambda: None).ooms for _ in range(steps))
    return ooms, guard.micro_limit


def test_the_predictive_controller_jumps_to_what_the_python_devices_figures_allow():
    # The device's figures at a Python OOM (request from the message, allocated
    # while the exception is alive) and at clean micro-batches give the model:
    # one OOM, then the largest size that fits, where halving and searching
    # take several.
    ooms, limit = _cold_start("predictive")
    assert ooms == 1 and 285 <= limit <= 300, (ooms, limit)
    search_ooms, _ = _cold_start("search")
    assert search_ooms >= 4
    assert oomguard.Guard().options.controller == "predictive"
    with pytest.raises(ValueError, match="'greedy' is not a policy"):
        oomguard.Guard(controller="greedy")
