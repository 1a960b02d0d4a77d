"""oomguard.torch under real torch OOMs (the budgeted CPU allocator)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import oomguard
import oomguard.budget
import oomguard.torch as ogt
from conftest import EXAMPLE, run_python, subprocess_env

pytestmark = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")


def _run_example(tmp_path, name, *flags):
    params = tmp_path / f"{name}.f64"
    proc = run_python([EXAMPLE, "--steps", 6, "--global-batch", 512, "--dtype", "float64", "--seed", 3,
                       "--json", "--dump-params", params, *flags])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary, np.fromfile(params, dtype="<f8"), proc.stderr


def test_float64_training_under_real_ooms_matches_training_without(tmp_path):
    clean, p_clean, _ = _run_example(tmp_path, "clean")
    # 8 MiB: the whole batch's activations do not fit, a quarter of it does.
    tight, p_tight, log = _run_example(tmp_path, "tight", "--budget-mib", 8)
    assert clean["ooms"] == 0 and clean["final_micro_batch"] == 512
    assert tight["ooms"] >= 1, log
    assert tight["final_micro_batch"] < 512
    assert "torch.cuda.OutOfMemoryError" in log or "OutOfMemoryError" in log or "OOM" in log
    assert p_clean.size == p_tight.size > 100_000
    rel = np.max(np.abs(p_clean - p_tight)) / np.max(np.abs(p_clean))
    assert rel <= 1e-10, rel
    assert tight["loss_last"] == pytest.approx(clean["loss_last"], rel=1e-10)
    for key in ("steps", "global_batch", "initial_micro_batch", "final_micro_batch", "ooms", "loss_first",
                "loss_last", "wall_s"):
        assert key in tight


def _mlp():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def _batches(steps):
    g = torch.Generator().manual_seed(11)
    return torch.randn(steps, 32, 8, generator=g, dtype=torch.float64), torch.randn(steps, 32, 1, generator=g,
                                                                                   dtype=torch.float64)


class _OomHalfwaySGD(torch.optim.SGD):
    """SGD whose step at a chosen step number updates one parameter, then hits a
    real allocation failure: the parameters are left half-updated."""

    def __init__(self, params, fail_at, **kw):
        super().__init__(params, **kw)
        self.fail_at = fail_at
        self.calls = 0
        self.failed = False

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_at and not self.failed:
            self.failed = True
            with torch.no_grad():
                self.param_groups[0]["params"][0].add_(1.0)
                with oomguard.budget.limit(1 << 10):
                    torch.empty(1 << 20, dtype=torch.float64)  # raises torch's own OOM
        return super().step(closure)


def _train(steps, ckpt_dir=None, fail_at=0):
    model = _mlp()
    opt = _OomHalfwaySGD(model.parameters(), fail_at=fail_at, lr=0.1, momentum=0.9)
    ckpt = None
    if ckpt_dir is not None:
        ckpt = oomguard.Checkpointer(str(ckpt_dir), every_steps=1, fsync=False)
        ogt.register_state(ckpt, model=model, optimizer=opt)
    guard = oomguard.Guard(recovery=ckpt)
    train_step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard)
    xs, ys = _batches(steps)
    rollbacks = []
    while guard.next_step < steps:
        step = guard.next_step
        try:
            train_step(xs[step], ys[step])
        except oomguard.RolledBackError as e:
            rollbacks.append((step, e.rolled_back_to, e.next_step))
            # The half-updated parameters were put back from the snapshot of the last step.
            assert torch.equal(ogt.flat_parameters(model), snapshot)
        snapshot = ogt.flat_parameters(model)
    if ckpt is not None:
        ckpt.wait()
    return ogt.flat_parameters(model), rollbacks, guard


def test_oom_inside_optimizer_step_is_rolled_back(tmp_path):
    reference, none, _ = _train(6)
    assert none == []
    params, rollbacks, guard = _train(6, ckpt_dir=tmp_path / "ckpt", fail_at=4)
    assert rollbacks == [(3, 2, 3)], rollbacks
    assert guard.total_ooms == 1
    assert torch.allclose(params, reference, rtol=1e-10, atol=0)


def test_oom_inside_optimizer_step_without_checkpoint_gives_up():
    model = _mlp()
    opt = _OomHalfwaySGD(model.parameters(), fail_at=1, lr=0.1)
    train_step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss)
    xs, ys = _batches(1)
    with pytest.raises(oomguard.OutOfMemoryError, match="no checkpoint"):
        train_step(xs[0], ys[0])


def test_train_step_loss_is_the_batch_mean_whatever_the_split():
    xs, ys = _batches(1)
    losses = []
    for limit in (32, 5, 1):
        model = _mlp()
        step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                             initial_micro_batch=limit)
        losses.append(step(xs[0], ys[0]))
        assert step.last_report.micro_batches == -(-32 // limit)
    assert losses[1] == pytest.approx(losses[0], rel=1e-12)
    assert losses[2] == pytest.approx(losses[0], rel=1e-12)


def test_budget_raises_torchs_own_oom_error():
    with oomguard.budget.limit(1 << 20):
        with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate"):
            torch.zeros(1 << 20)
        small = torch.zeros(1024)
        assert oomguard.budget.allocated() >= small.numel() * 4
    assert not oomguard.budget.installed()
    torch.zeros(1 << 20)  # no budget any more


def _example(*flags, **env):
    return subprocess.run([sys.executable, str(EXAMPLE), *map(str, flags)], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(**env))


@pytest.mark.parametrize("flags, needle", [
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--budget-mib", "nan"], "--budget-mib must be a finite number"),
    (["--budget-mib", "1e-9"], "less than one byte"),
    (["--ckpt-every", "0"], "--ckpt-every must be >= 1"),
])
def test_example_refuses_careless_flags(flags, needle):
    """Issue 15, item 12: NaN passes every comparison, 1e-9 MiB rounds to 'no budget'."""
    proc = _example("--steps", 1, *flags)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr, proc.stderr


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


def test_example_diverging_loss_is_json_null():
    proc = _example("--steps", 4, "--global-batch", 64, "--lr", "1e30", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1], parse_constant=_no_constants)
    assert summary["loss_last"] is None, summary


def test_example_reports_lost_incidents_in_json_and_exit_code(tmp_path):
    """Issue 15, item 7: every knowledge-base write fails; the run says so and exits 4."""
    kb = tmp_path / "kb.db"
    flags = ["--steps", 4, "--global-batch", 512, "--dtype", "float64", "--budget-mib", 8, "--kb", kb, "--json"]
    proc = _example(*flags, OOMGUARD_FAULTS="oom@site=kb_write,times=0")
    assert proc.returncode == 4, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ooms"] >= 1 and summary["incident_ops_lost"] > 0, summary
    assert "were not recorded" in proc.stderr
    kept = _example(*flags[:-3], "--kb", tmp_path / "kept.db", "--json")
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout.strip().splitlines()[-1])["incident_ops_lost"] == 0
