"""oomguard.integrations.accelerate: a loop over Accelerate's prepare() with
the guarded step, against the same loop with accelerator.backward and
optimizer.step, one process (two ranks: test_two_ranks.py). float64 causal
transformer, AdamW, a LambdaLR scheduler, clipping at 0.5."""

from __future__ import annotations

import pytest
import torch

import oomguard
import oomguard.budget

accelerate = pytest.importorskip("accelerate")

import cases  # noqa: E402

needs_budget = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def reference():
    return cases.plain_and_guarded("accelerate", budget_frac=0.6 if oomguard.budget.available() else 0.0)


@needs_budget
def test_real_ooms_leave_the_loops_result_unchanged(reference):
    r = reference
    s = r["summary"]
    assert s["ooms"] >= 1 and s["micro_limit"] is not None and s["micro_limit"] < 16, s
    assert _rel(r["guarded"], r["plain"]) <= 1e-10
    assert s["losses"] == pytest.approx(s["plain_losses"], rel=1e-10)


def test_injected_faults_at_every_site(reference, tmp_path):
    kb_path = str(tmp_path / "kb.sqlite")
    faults = ("host_oom@site=micro_batch,step=0,micro=0;oom@site=forward,step=1;oom@site=backward,step=2,micro=1;"
              "oom@site=vote,step=3;oom@site=apply,step=3;oom@site=optimizer,step=4;oom@site=commit,step=5")
    r = cases.plain_and_guarded("accelerate", faults=faults, kb=kb_path, reuse=reference)
    s = r["summary"]
    assert s["faults_fired"] == 7, s
    assert _rel(r["guarded"], r["plain"]) <= 1e-10
    assert s["losses"] == pytest.approx(s["plain_losses"], rel=1e-10)
    kb = oomguard.KnowledgeBase(kb_path)
    kb.flush()
    assert len(kb.query(workload="accelerate-test")) == s["ooms"] >= 6


def test_a_scaler_is_refused_with_a_clear_error():
    from oomguard.integrations.accelerate import train_step

    acc = accelerate.Accelerator(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="GradScaler"):
        train_step(acc, model, opt, torch.nn.functional.mse_loss)
