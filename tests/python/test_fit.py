"""oomguard.torch.fit: one call for a whole loop (issue 23), against the plain
PyTorch loop it must equal, under real torch OOMs (oomguard.budget), injected
faults, rollbacks, a kill -9 and resume, and two ranks over gloo."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import oomguard
import oomguard.budget
import oomguard.torch as ogt
from conftest import REPO, run_python, subprocess_env

import fit_worker as fw

WORKER = REPO / "tests" / "python" / "fit_worker.py"
needs_budget = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _val_set():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, fw.D, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, x[:, :1].tanh())


def _plain_with_evals(steps: int, eval_every: int):
    """fit_worker.plain with an evaluation of the mean loss every eval_every steps."""
    model, opt, sched = fw.model_and_optimizer()
    ds = fw.data()
    xv, yv = _val_set().tensors
    sampler = ogt.StepBatchSampler(len(ds), fw.GLOBAL, seed=0)
    losses, evals = [], {}
    for k in range(steps):
        x, y = ds[sampler.global_batch(k)]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (k + 1) % eval_every == 0 or k + 1 == steps:
            with torch.no_grad():
                evals[k] = torch.nn.functional.mse_loss(model(xv), yv).item()
    return ogt.flat_parameters(model), losses, evals


def _fit(steps: int, data=None, parts=None, **kw):
    model, opt, sched = parts or fw.model_and_optimizer()
    result = ogt.fit(model, opt, torch.nn.functional.mse_loss, fw.data() if data is None else data,
                     global_batch=fw.GLOBAL, steps=steps, scheduler=sched, clip_grad_norm=1.0, **kw)
    return model, result


@needs_budget
def test_fit_equals_the_plain_loop_under_a_budget_and_evaluates_guarded(tmp_path):
    steps, every = 10, 4
    reference, plain_losses, plain_evals = _plain_with_evals(steps, every)
    data, val = fw.data(), _val_set()
    budget = int(fw.peak_bytes(fw.GLOBAL) * 0.6)  # the whole batch's activations do not fit
    kb = oomguard.KnowledgeBase(str(tmp_path / "kb.sqlite"))
    parts = fw.model_and_optimizer()
    with oomguard.budget.limit(budget):
        model, result = _fit(steps, data, parts, eval_data=val, eval_every=every, eval_batch=40, knowledge_base=kb,
                             workload="fit-test")
    assert result.ooms >= 1 and result.incidents
    assert result.micro_batch is not None and result.micro_batch < fw.GLOBAL
    assert result.steps == steps and result.first_step == 0 and len(result.losses) == steps
    assert _rel(ogt.flat_parameters(model), reference) <= 1e-10
    assert result.losses == pytest.approx(plain_losses, rel=1e-10)
    assert sorted(result.evals) == sorted(plain_evals) == [3, 7, 9]
    for k, v in plain_evals.items():
        assert float(result.evals[k]) == pytest.approx(v, rel=1e-10)
    kb.flush()
    assert len(kb.query(run_id=result.incidents[0].run_id)) == len(result.incidents)


def test_a_clean_run_reports_no_limit_and_no_ooms():
    model, result = _fit(3)
    assert result.ooms == 0 and result.incidents == [] and result.rollbacks == 0
    assert result.micro_batch is None, "no limit is known on a run without OOMs (not INT64_MAX)"
    assert result.checkpoint_step == -1 and result.resumed_from is None


def test_a_rollback_redoes_the_work_after_the_restored_step(tmp_path):
    steps, every = 8, 2
    reference, plain_losses, plain_evals = _plain_with_evals(steps, every)
    seen = []
    # An OOM inside the optimizer step of step 4: the parameters may be
    # half-updated, so every rank restores the newest checkpoint (step 3).
    oomguard.set_fault_rules("oom@step=4,site=optimizer")
    model, result = _fit(steps, ckpt_dir=tmp_path / "ckpt", ckpt_every=2, eval_data=_val_set(), eval_every=every,
                         eval_batch=40, on_step=lambda step, loss: seen.append((step, loss)))
    assert result.rollbacks == 1 and result.ooms == 1
    assert _rel(ogt.flat_parameters(model), reference) <= 1e-10
    assert result.losses == pytest.approx(plain_losses, rel=1e-10)
    assert sorted(result.evals) == [1, 3, 5, 7]
    for k, v in plain_evals.items():
        assert float(result.evals[k]) == pytest.approx(v, rel=1e-10)
    # The restored step's after-step work ran again (its checkpoint was taken
    # inside the step, before it), then the loop went on from step 4.
    steps_seen = [s for s, _ in seen]
    assert steps_seen == [0, 1, 2, 3, 3, 4, 5, 6, 7], steps_seen
    assert all(loss == pytest.approx(plain_losses[s], rel=1e-10) for s, loss in seen)
    assert result.checkpoint_step == 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_killed_mid_way_resumes_to_the_plain_result(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "params.f64"
    run_python([WORKER, tmp_path / "plain.f64", "--mode", "plain", "--steps", 9])
    reference = np.fromfile(tmp_path / "plain.f64", dtype="<f8")
    killed = subprocess.run([sys.executable, str(WORKER), str(out), "--steps", "9", "--ckpt", str(ckpt)],
                            env=subprocess_env(OOMGUARD_FAULTS="kill@step=6,site=micro_batch"),
                            capture_output=True, text=True, timeout=180)
    assert killed.returncode == -9, killed.stderr[-2000:]
    # Checkpoints every 2 steps (1, 3, 5). The saves are asynchronous: on a
    # loaded machine those of steps 3 and 5 may both still have been queued at
    # the kill. What was committed (a manifest) is what the resume must use.
    committed = sorted(int(d.name.split("-")[1]) for d in ckpt.glob("step-*") if (d / "MANIFEST.json").is_file())
    assert set(committed) <= {1, 3, 5}, committed
    run_python([WORKER, out, "--steps", 9, "--ckpt", ckpt])
    summary = json.loads((tmp_path / "params.f64.0.json").read_text())
    assert summary["resumed_from"] == (committed[-1] if committed else None), (summary, committed)
    assert summary["steps"] == 9 and summary["first_step"] == 0 and len(summary["losses"]) == 9
    params = np.fromfile(out, dtype="<f8")
    assert np.max(np.abs(params - reference)) / np.max(np.abs(reference)) <= 1e-10


def _wait_all(procs, timeout: float) -> None:
    """Waits for every process; when one fails (or time runs out) the others
    are killed, since they would wait for it in a collective until torch's
    own 30-minute timeout."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    logs = [p.communicate()[1] for p in procs]
    for rank, (p, err) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}"


@needs_budget
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_under_torchrun_variables_equal_the_plain_loop(tmp_path, world):
    run_python([WORKER, tmp_path / "plain.f64", "--mode", "plain", "--steps", 6])
    reference = np.fromfile(tmp_path / "plain.f64", dtype="<f8")
    port = str(_free_port())
    out = tmp_path / "params.f64"
    last = world - 1
    # The last rank under a byte budget its share of the global batch does not
    # fit in (with room for DDP's gradient buckets: a second copy of the gradients).
    params = sum(p.numel() for p in fw.model_and_optimizer()[0].parameters()) * 8
    budget = int(fw.peak_bytes(fw.GLOBAL // world) * 0.6) + params
    procs = []
    for rank in range(world):
        env = subprocess_env(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=port, OMP_NUM_THREADS="1")
        flags = ["--budget-bytes", str(budget)] if rank == last else []
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out), "--steps", "6", *flags], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    _wait_all(procs, 300)
    summaries = [json.loads((tmp_path / f"params.f64.{r}.json").read_text()) for r in range(world)]
    assert all(s["world"] == world for s in summaries)
    assert summaries[last]["ooms"] >= 1 and all(s["ooms"] == 0 for s in summaries[:last]), summaries
    for s in summaries[1:]:
        assert s["losses"] == pytest.approx(summaries[0]["losses"], rel=1e-12), "every rank returns the global loss"
    params = np.fromfile(out, dtype="<f8")
    assert np.max(np.abs(params - reference)) / np.max(np.abs(reference)) <= 1e-10


def test_batch_norm_is_named_as_split_dependent():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    ds = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    with pytest.warns(UserWarning, match="BatchNorm"):
        ogt.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, ds,
                global_batch=8, steps=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"global_batch": 0}, "global_batch"),
    ({"steps": -1}, "steps"),
    ({"eval_every": 2}, "eval_data"),
    ({"ckpt_every": -1}, "ckpt_every"),
    ({"guard": None}, "own guard"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, message):
    model, opt, _ = fw.model_and_optimizer()
    args = {"global_batch": 8, "steps": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        ogt.fit(model, opt, torch.nn.functional.mse_loss, fw.data(), **args)


def test_a_stream_is_refused_with_the_reason():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(fw.D), torch.zeros(1)

    model, opt, _ = fw.model_and_optimizer()
    with pytest.raises(TypeError, match="map-style dataset"):
        ogt.fit(model, opt, torch.nn.functional.mse_loss, Stream(), global_batch=8, steps=1)


def test_dict_batches_and_a_data_loader_of_workers(tmp_path):
    """A DataLoader of dict batches with two workers: fit keeps its dataset,
    collation and workers and draws the batches by step."""

    class Dicts(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = fw.data().tensors

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "y": self.y[i]}

    reference = fw.plain(5)
    model, opt, sched = fw.model_and_optimizer()
    loader = torch.utils.data.DataLoader(Dicts(), batch_size=7, num_workers=2)
    oomguard.set_fault_rules("oom@step=2,site=backward")
    result = ogt.fit(model, opt, data=loader, forward=lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"]),
                     global_batch=fw.GLOBAL, steps=5, scheduler=sched, clip_grad_norm=1.0)
    assert result.ooms == 1
    assert _rel(ogt.flat_parameters(model), reference) <= 1e-10


@needs_budget
def test_the_fit_example_equals_its_plain_run_under_a_budget_and_resumes(tmp_path):
    example = REPO / "examples" / "python" / "fit_mlp.py"
    run_python([example, "--steps", 12, "--plain", "--dump-params", tmp_path / "plain.f64"])
    ckpt = tmp_path / "ckpt"
    first = run_python([example, "--steps", 8, "--budget-mib", 3, "--ckpt-dir", ckpt, "--json"])
    s1 = json.loads(first.stdout.strip().splitlines()[-1])
    assert s1["ooms"] >= 1 and s1["final_micro_batch"] < 512, s1
    # The same command with more steps resumes from the newest checkpoint and
    # ends with the plain run's parameters.
    second = run_python([example, "--steps", 12, "--budget-mib", 3, "--ckpt-dir", ckpt, "--json",
                         "--check-against", tmp_path / "plain.f64"])
    s2 = json.loads(second.stdout.strip().splitlines()[-1])
    assert s2["resumed_from"] == 7 and s2["steps"] == 12, s2  # the end of a run is a checkpoint
    assert s2["max_rel_diff"] <= 1e-10, s2
