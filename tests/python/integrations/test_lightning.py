"""oomguard.integrations.lightning: Lightning's automatic optimisation with
every optimizer step guarded, against the same Lightning run unguarded, one
process (two ranks: test_two_ranks.py). A LightningModule around a float64
two-layer causal transformer without dropout, accumulate_grad_batches=2,
gradient_clip_val=0.5, AdamW with a per-step StepLR, self.log in training_step."""

from __future__ import annotations

import pytest
import torch

import oomguard
import oomguard.budget

pl = pytest.importorskip("lightning.pytorch")

import cases  # noqa: E402

needs_budget = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def reference():
    # with validation, so that the fault test below reuses its unguarded run
    frac = 0.6 if oomguard.budget.available() else 0.0
    return cases.plain_and_guarded("lightning", budget_frac=frac, val=True, val_check_interval=3)


@needs_budget
def test_real_ooms_leave_the_result_and_the_schedule_unchanged(reference):
    r = reference
    s = r["summary"]
    assert s["ooms"] >= 1 and s["micro_limit"] is not None and s["micro_limit"] < 16, s
    assert _rel(r["guarded"], r["plain"]) <= 1e-10
    assert s["lr"] == pytest.approx(s["plain_lr"], rel=1e-12) and s["lr"][0] < 3e-3  # StepLR stepped per step
    assert len(s["losses"]) == 6


def test_injected_faults_at_every_site_and_an_unguarded_validation(reference, tmp_path):
    kb_path = str(tmp_path / "kb.sqlite")
    faults = ("host_oom@site=micro_batch,step=0,micro=0;oom@site=forward,step=1;oom@site=backward,step=2,micro=1;"
              "oom@site=vote,step=3;oom@site=apply,step=3;oom@site=optimizer,step=4;oom@site=commit,step=5;"
              "oom@site=eval")
    r = cases.plain_and_guarded("lightning", faults=faults, kb=kb_path, val=True, val_check_interval=3,
                                reuse=reference)
    s = r["summary"]
    assert s["faults_fired"] == 8, s
    assert _rel(r["guarded"], r["plain"]) <= 1e-10
    assert {"eval", "optimizer", "forward", "backward"} <= set(s["phases"]), s["phases"]
    kb = oomguard.KnowledgeBase(kb_path)
    kb.flush()
    assert len(kb.query(workload="lightning-test")) == s["ooms"]


def test_manual_optimisation_is_refused_with_the_way_to_guard_it():
    from oomguard.integrations.lightning import OomguardCallback

    module = cases.lightning_module()
    module.automatic_optimization = False
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[OomguardCallback()])
    with pytest.raises(ValueError, match="TrainStep"):
        trainer.fit(module, torch.utils.data.DataLoader(cases.lm_batches(8), batch_size=4))
