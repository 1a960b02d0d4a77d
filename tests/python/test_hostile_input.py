"""Careless and hostile input through the Python package, round two (issue 28).

Each case went wrong before: an option that terminated the process, a save
callback's exception swallowed, steps no checkpoint could name, messages that
could not become Python strings, a step inside a step, a NUL in a path, a
KeyboardInterrupt lost in a cache releaser, a device whose stats() returns
None, loss units whose sum wrapped.
"""

from __future__ import annotations

import json
import sys

import h5py
import pytest
import torch

import oomguard
import oomguard.torch as ogt


def _checkpointer(tmp_path, **options):
    return oomguard.Checkpointer(str(tmp_path), fsync=False, **options)


@pytest.mark.parametrize("option", ["threads", "stage_threads"])
def test_thread_counts_are_bounded_options(tmp_path, option):
    with pytest.raises(oomguard.InvalidArgumentError, match=option):
        _checkpointer(tmp_path, **{option: 100000})


def test_an_exception_in_a_save_callback_is_counted_and_reported_and_ctrl_c_propagates(tmp_path):
    ckpt = _checkpointer(tmp_path, every_steps=1)
    weights = torch.zeros(8)
    ckpt.add_tensor("model/w", weights)
    raising = {"exc": ValueError("the optimizer state is gone")}

    def save():
        raise raising["exc"]

    ckpt.add_object("train/state", save, lambda b: None)
    guard = oomguard.Guard(initial_micro_batch=4, recovery=ckpt, device=None)
    report = guard.step(8, lambda mb: None, apply=lambda: None, reset=lambda: None)
    assert report.status.ok, "a failed checkpoint must not stop training"
    assert guard.next_step == 1
    assert ckpt.stats.save_failures == 1
    with pytest.raises(oomguard.OomguardError) as failed:
        ckpt.wait()
    assert "ValueError: the optimizer state is gone" in str(failed.value)

    raising["exc"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        guard.step(8, lambda mb: None, apply=lambda: None, reset=lambda: None)
    assert guard.next_step == 2, "the step itself was committed before the interrupt passed on"
    assert ckpt.stats.save_failures == 2


@pytest.mark.parametrize("step", [-1, -3, 2**63 - 1])
def test_steps_no_checkpoint_could_name_are_refused(tmp_path, step):
    ckpt = _checkpointer(tmp_path)
    ckpt.add_tensor("model/w", torch.zeros(4))
    with pytest.raises(oomguard.InvalidArgumentError):
        ckpt.save_async(step)
    ckpt.wait()
    assert [p.name for p in tmp_path.iterdir()] == ["LOCK.rank-00000"], "something was written beside the lock"
    guard = oomguard.Guard(initial_micro_batch=4, device=None)
    with pytest.raises(oomguard.InvalidArgumentError):
        guard.next_step = step
    assert guard.next_step == 0


def _saved(tmp_path, steps=(1, 2)):
    ckpt = _checkpointer(tmp_path)
    weights = torch.zeros(16)
    ckpt.add_tensor("model/w", weights)
    for step in steps:
        weights.fill_(step)
        ckpt.save_async(step)
        ckpt.wait()
    return ckpt, weights


def _fix_manifest_size(step_dir):
    manifest = json.loads((step_dir / "MANIFEST.json").read_text())
    manifest["shards"][0]["bytes"] = (step_dir / "rank-00000.h5").stat().st_size
    (step_dir / "MANIFEST.json").write_text(json.dumps(manifest))


def test_bytes_that_are_not_utf8_reach_python_escaped(tmp_path):
    ckpt, weights = _saved(tmp_path)
    step2 = tmp_path / "step-00000002"
    with h5py.File(step2 / "rank-00000.h5", "r+") as f:
        f.create_dataset(b"model/\xffbad", data=[1, 2, 3])
    _fix_manifest_size(step2)
    for call in (lambda: ckpt.load(2), lambda: oomguard.verify_checkpoint(str(tmp_path), 2)):
        with pytest.raises(oomguard.CorruptCheckpointError) as refused:
            call()
        assert "\\xffbad" in str(refused.value), str(refused.value)
    weights.fill_(-1)
    assert ckpt.load_latest() == 1
    assert float(weights[0]) == 1.0
    paths = [t.path for t in oomguard.inspect_shard(str(step2 / "rank-00000.h5")).tensors]
    assert "/model/\\xffbad" in paths

    # A manifest whose error message is cut inside a UTF-8 character.
    step1 = tmp_path / "step-00000001"
    manifest = json.loads((step1 / "MANIFEST.json").read_text())
    manifest["format"] = "x" * 63 + "\u00e9"
    (step1 / "MANIFEST.json").write_text(json.dumps(manifest, ensure_ascii=False), encoding="utf-8")
    problems = [c.problem for c in oomguard.list_checkpoints(str(tmp_path)) if c.step == 1]
    assert problems and "\\xc3" in problems[0], problems


def test_a_step_inside_a_step_is_refused():
    guard = oomguard.Guard(initial_micro_batch=4, device=None)

    def micro(mb):
        guard.step(2, lambda inner: None)

    with pytest.raises(oomguard.FailedPreconditionError, match="inside a step"):
        guard.step(8, micro)
    assert guard.next_step == 0
    assert guard.step(8, lambda mb: None).status.ok
    assert guard.next_step == 1


def test_a_tensor_path_with_nul_is_refused(tmp_path):
    ckpt = _checkpointer(tmp_path)
    with pytest.raises(oomguard.InvalidArgumentError, match="NUL"):
        ckpt.add_tensor("model/w\x00shadow", torch.zeros(4))


def test_keyboard_interrupt_in_a_cache_releaser_propagates():
    guard = oomguard.Guard(initial_micro_batch=8, device=None)
    released = []

    def releaser():
        released.append(1)
        raise KeyboardInterrupt()

    guard.add_cache_releaser("interrupting", releaser)
    oomguard.set_fault_rules("oom@step=0,site=micro_batch")
    with pytest.raises(KeyboardInterrupt):
        guard.step(8, lambda mb: None, apply=lambda: None, reset=lambda: None)
    assert released == [1]
    assert guard.next_step == 0


def test_a_device_whose_stats_returns_none_is_reported_and_the_step_runs(monkeypatch):
    class NoFigures(oomguard.Device):
        def name(self):
            return "nofigures"

        def stats(self):
            return None

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    guard = oomguard.Guard(initial_micro_batch=4, device=NoFigures())
    assert guard.step(8, lambda mb: None).status.ok
    assert seen and isinstance(seen[0], TypeError)
    assert "must return oomguard.MemoryStats, not NoneType" in str(seen[0])


def test_loss_units_whose_sum_overflows_are_refused():
    guard = oomguard.Guard(initial_micro_batch=4, device=None)
    with pytest.raises(oomguard.InvalidArgumentError, match="units overflow"):
        guard.step(4, lambda mb: None, units=[2**62] * 4)
    with pytest.raises(oomguard.InvalidArgumentError, match="costs overflow"):
        guard.step(3, lambda mb: None, costs=[2**62] * 3)

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                         loss_units=lambda x, y: torch.full((x.shape[0],), 5 * 10**18, dtype=torch.int64),
                         device=None, initial_micro_batch=4)
    with pytest.raises(oomguard.InvalidArgumentError, match="units overflow"):
        step(torch.randn(4, 3), torch.randn(4, 1))
