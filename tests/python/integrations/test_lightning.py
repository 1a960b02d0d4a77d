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


def _under_budget(frac: float, peak: int, fn):
    """``fn()`` with the cyclic collector off (as cases.plain_and_guarded) and,
    when ``frac``, a byte budget of ``frac`` of ``peak``."""
    import gc

    gc.collect()
    gc.disable()
    if frac:
        oomguard.budget.install(int(peak * frac))
    try:
        return fn()
    finally:
        if frac:
            oomguard.budget.uninstall()
        gc.enable()


class _BudgetFromTrainStart(pl.Callback):
    """Installs a byte budget when training starts (after a checkpoint's restore), removes it at the end."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def on_train_start(self, trainer, pl_module):
        oomguard.budget.install(self.budget)

    def on_fit_end(self, trainer, pl_module):
        oomguard.budget.uninstall()

    def on_exception(self, trainer, pl_module, exception):
        oomguard.budget.uninstall()


def test_checkpoint_and_resume_under_the_callback(reference, tmp_path):
    """Lightning's ModelCheckpoint writes a checkpoint at step 4 (the end of
    the first epoch) of a guarded run that runs out of memory; a second
    guarded Trainer resumes from it with ``fit(ckpt_path=...)`` and ends with
    the parameters (and the LR schedule) of the uninterrupted unguarded run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    frac = 0.6 if oomguard.budget.available() else 0.0
    peak = reference["summary"]["peak"]
    ckpts = tmp_path / "ckpt"
    saver = ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=4, save_top_k=-1)
    first = _under_budget(frac, peak, lambda: cases.lightning_run(True, steps=4, root=str(tmp_path), callbacks=[saver],
                                                                  checkpointing=True))
    written = sorted(p.name for p in ckpts.iterdir())
    assert written == ["epoch=0-step=4.ckpt"], written
    if frac:
        assert len(first[2].incidents) >= 1  # the first part ran out of memory too
    # Lightning's checkpoint loader is not guarded (it holds the loaded
    # checkpoint beside the model and optimizer: no split helps there): the
    # budget starts with the training, after the restore.
    trainer, module, cb = _under_budget(0.0, 0, lambda: cases.lightning_run(
        True, steps=6, root=str(tmp_path), ckpt_path=str(ckpts / written[0]),
        callbacks=[_BudgetFromTrainStart(int(peak * frac))] if frac else []))
    assert trainer.global_step == 6 and len(cb.losses) == 2  # only steps 5 and 6 ran
    assert _rel(cases.flat(module), reference["plain"]) <= 1e-10
    lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    assert lr == pytest.approx(reference["summary"]["plain_lr"], rel=1e-12)


def test_early_stopping_stops_at_the_unguarded_runs_step(reference):
    """EarlyStopping on the validation loss (the validation loop the callback
    leaves unguarded but records) stops the guarded run, under a budget that
    makes it run out of memory, at the step where it stops the unguarded run,
    with the same parameters."""
    from lightning.pytorch.callbacks import EarlyStopping

    def run(guarded: bool):
        stop = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02, mode="min")
        return cases.lightning_run(guarded, steps=40, val=True, val_check_interval=4, callbacks=[stop])

    plain_trainer, plain_module, _ = _under_budget(0.0, 0, lambda: run(False))
    assert 0 < plain_trainer.global_step < 40, plain_trainer.global_step  # it stopped early
    frac = 0.6 if oomguard.budget.available() else 0.0
    trainer, module, cb = _under_budget(frac, reference["summary"]["peak"], lambda: run(True))
    assert trainer.should_stop and trainer.global_step == plain_trainer.global_step
    if frac:
        assert len(cb.incidents) >= 1
    assert _rel(cases.flat(module), cases.flat(plain_module)) <= 1e-10
