"""oomguard.integrations.hf: transformers.Trainer with every optimizer step
guarded, against the same Trainer unguarded, one process (two ranks:
test_two_ranks.py). float64 GPT-2 (2 layers, 48 tokens) without dropout,
gradient accumulation 2, token-weighted loss (num_items_in_batch), linear LR
schedule with warmup, clipping at 0.5, SGD with momentum and weight decay."""

from __future__ import annotations

import tempfile

import pytest
import torch

import oomguard
import oomguard.budget

transformers = pytest.importorskip("transformers")

import cases  # noqa: E402

needs_budget = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _train_logs(logs: list) -> list:
    return [e for e in logs if "loss" in e and "train_runtime" not in e]


@pytest.fixture(scope="module")
def reference():
    # with evaluations, so that the fault test below reuses its unguarded run
    return cases.plain_and_guarded("hf", budget_frac=0.6 if oomguard.budget.available() else 0.0, eval_every=3)


@needs_budget
def test_real_ooms_leave_the_trainers_result_unchanged(reference, tmp_path):
    s = reference["summary"]
    assert s["ooms"] >= 1 and s["micro_limit"] is not None and s["micro_limit"] < 16, s
    assert _rel(reference["guarded"], reference["plain"]) <= 1e-10


@needs_budget
def test_the_trainers_schedule_clipping_and_logging_keep_working(reference):
    plain, guarded = _train_logs(reference["summary"]["plain_logs"]), _train_logs(reference["summary"]["logs"])
    assert [e["step"] for e in guarded] == [e["step"] for e in plain] == [1, 2, 3, 4, 5, 6]
    # the linear schedule with warmup, step by step
    assert [e["learning_rate"] for e in guarded] == [e["learning_rate"] for e in plain]
    assert len(set(e["learning_rate"] for e in plain)) >= 4
    # clipping ran (the norm exceeds max_grad_norm) and logs the same norm
    assert all(e["grad_norm"] > 0.5 for e in plain)
    for p, g in zip(plain, guarded):
        assert g["grad_norm"] == pytest.approx(p["grad_norm"], rel=1e-10)
        assert g["loss"] == pytest.approx(p["loss"], rel=1e-6)  # the Trainer logs its float32 accumulator


def test_injected_faults_at_every_site_and_an_unguarded_evaluation(reference, tmp_path):
    kb_path = str(tmp_path / "kb.sqlite")
    faults = ("host_oom@site=micro_batch,step=0,micro=0;oom@site=forward,step=1;oom@site=backward,step=2,micro=1;"
              "oom@site=vote,step=3;oom@site=apply,step=3;oom@site=optimizer,step=4;oom@site=commit,step=5;"
              "oom@site=eval")
    r = cases.plain_and_guarded("hf", faults=faults, kb=kb_path, eval_every=3, reuse=reference)
    s = r["summary"]
    assert s["faults_fired"] == 8, s
    assert _rel(r["guarded"], r["plain"]) <= 1e-10
    assert "eval" in s["phases"] and "optimizer" in s["phases"], s["phases"]
    # the evaluation the Trainer runs (not split: retried after the OOM) gives the plain run's loss
    plain_eval = [e["eval_loss"] for e in s["plain_logs"] if "eval_loss" in e]
    guarded_eval = [e["eval_loss"] for e in s["logs"] if "eval_loss" in e]
    assert len(plain_eval) == 2 and guarded_eval == pytest.approx(plain_eval, rel=1e-10)
    kb = oomguard.KnowledgeBase(kb_path)
    kb.flush()
    recorded = kb.query(workload="hf-test")
    assert len(recorded) == s["ooms"] and {i.phase for i in recorded} >= {"eval", "optimizer", "forward"}


def test_guard_options_the_integration_owns_are_refused():
    from oomguard.integrations.hf import OomguardTrainer

    with tempfile.TemporaryDirectory() as d:
        args = transformers.TrainingArguments(output_dir=d, use_cpu=True, report_to=[])
        with pytest.raises(ValueError, match="recovery"):
            OomguardTrainer(model=cases.hf_model(), args=args, guard_options={"recovery": None})


def test_the_trainers_checkpoint_stop_and_resume_keep_the_result(reference, tmp_path):
    """A callback stops the Trainer at step 3 (as early stopping does), after
    it wrote its checkpoint (through the guard: an OOM there would be
    recorded); a second Trainer resumes from it and ends where the unguarded
    six-step run ended."""

    class StopAt3(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                control.should_training_stop = True

    out = str(tmp_path / "out")
    first, _ = cases.hf_run(out, True, save_strategy="steps", save_steps=3, callbacks=[StopAt3()])
    assert first.state.global_step == 3
    _, model = cases.hf_run(out, True, resume=str(tmp_path / "out" / "checkpoint-3"))
    assert _rel(cases.flat(model), reference["plain"]) <= 1e-10
