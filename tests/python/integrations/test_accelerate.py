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


def _loop_parts(d):
    """The objects of cases.accelerate_run's loop, prepared by a new Accelerator
    with ``d`` as its project directory, and the loop's batches in order."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    acc = Accelerator(cpu=True, project_dir=str(d),
                      kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    torch.manual_seed(29)
    model = cases.TinyLM().double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    loader = torch.utils.data.DataLoader(cases.lm_batches(), batch_size=16, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, sched, [ids for (ids,) in loader]


def _loss_of(m, ids):
    logits = m(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, cases.VOCAB), ids[:, 1:].reshape(-1))


def _budgeted(reference, fn):
    import gc

    gc.collect()
    gc.disable()
    if oomguard.budget.available():
        oomguard.budget.install(int(reference["summary"]["peak"] * 0.6))
    try:
        return fn()
    finally:
        if oomguard.budget.available():
            oomguard.budget.uninstall()
        gc.enable()


def test_save_state_then_load_state_in_a_new_loop(reference, tmp_path):
    """Accelerate's own checkpoints under the guarded step, with real OOMs:
    (a) 3 steps, ``save_state``; a new loop ``load_state``s it and runs steps
    3-5 (an injected OOM in its first optimizer step: a rollback); (b) in one
    loop, 3 steps, ``save_state``, 2 more steps, ``load_state`` back to step 3
    (the guard's rollback snapshot, taken after step 4, must not be what the
    next rollback restores), then steps 3-5 with an OOM in the first
    optimizer step. Both end with the unguarded six-step loop's parameters."""
    from oomguard.integrations.accelerate import train_step

    def part(acc, model, opt, sched, batches, ks):
        step = train_step(acc, model, opt, forward=_loss_of, scheduler=sched, clip_grad_norm=0.5)
        for k in ks:
            step(batches[k % len(batches)])
        return step

    saved = tmp_path / "a" / "state"
    acc, model, opt, sched, batches = _loop_parts(tmp_path / "a")
    first = _budgeted(reference, lambda: part(acc, model, opt, sched, batches, range(3)))
    first.finish()
    acc.save_state(str(saved))
    acc, model, opt, sched, batches = _loop_parts(tmp_path / "a")
    acc.load_state(str(saved))
    oomguard.set_fault_rules("oom@site=optimizer,step=0")
    second = _budgeted(reference, lambda: part(acc, model, opt, sched, batches, range(3, 6)))
    second.finish()
    assert oomguard.faults_fired() == 1
    oomguard.clear_fault_rules()
    assert "optimizer" in [i.phase for i in second.incidents]
    assert _rel(cases.flat(acc.unwrap_model(model)), reference["plain"]) <= 1e-10


def test_load_state_back_to_an_earlier_step_inside_one_loop(reference, tmp_path):
    """(b) of the test above: the guarded step made before ``load_state``."""
    from oomguard.integrations.accelerate import train_step

    saved = tmp_path / "b" / "state"
    acc, model, opt, sched, batches = _loop_parts(tmp_path / "b")
    step = train_step(acc, model, opt, forward=_loss_of, scheduler=sched, clip_grad_norm=0.5)

    def run(ks):
        for k in ks:
            step(batches[k % len(batches)])

    _budgeted(reference, lambda: run(range(3)))
    acc.save_state(str(saved))
    _budgeted(reference, lambda: run(range(3, 5)))
    acc.load_state(str(saved))
    oomguard.set_fault_rules(f"oom@site=optimizer,step={step.guard.next_step}")
    _budgeted(reference, lambda: run(range(3, 6)))
    step.finish()
    assert oomguard.faults_fired() == 1
    assert "optimizer" in [i.phase for i in step.incidents]
    assert _rel(cases.flat(acc.unwrap_model(model)), reference["plain"]) <= 1e-10
