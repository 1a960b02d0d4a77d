"""The models, data and runs the integration tests share: a tiny GPT-2 (HF
Trainer), a LightningModule around a small causal transformer, and an
Accelerate loop, each built from a config in the test (no hub), in float64,
without dropout, so that a guarded run can be compared with the same
trainer's unguarded run within 1e-10.

    python cases.py hf,lightning,accelerate OUT [--budget-frac F] [--faults SPEC] [--kb PATH]

runs one process of each trainer's unguarded and guarded runs (ranks:
WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment, as
torchrun sets them) and writes their final parameters and summaries to
OUT.rankN.json: the two-rank tests start two of these, which run the three
trainers one after the other (one interpreter start, one import of each).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import warnings

import torch

import oomguard
import oomguard.budget

VOCAB, SEQ, N = 48, 20, 64

# ---------------------------------------------------------------- data


def token_data(n: int = N, seed: int = 5) -> list:
    """Sequences of 6..SEQ tokens (a learnable pattern: next = prev + 1 mod VOCAB, with noise)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, SEQ + 1, (1,), generator=g))
        start = int(torch.randint(1, VOCAB, (1,), generator=g))
        ids = (torch.arange(length) + start) % (VOCAB - 1) + 1
        noise = torch.rand(length, generator=g) < 0.2
        ids[noise] = torch.randint(1, VOCAB, (int(noise.sum()),), generator=g)
        out.append(ids)
    return out


def pad_collate(seqs: list) -> dict:
    """Pads to the batch's longest sequence; pads are not predicted (label -100)."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Listed(torch.utils.data.Dataset):
    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in model.parameters()])


# ---------------------------------------------------------------- HF Trainer


def hf_model():
    import transformers

    torch.manual_seed(17)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


def causal_lm_loss_f64(outputs, labels, num_items_in_batch=None):
    """The causal LM loss, token-weighted as the Trainer's (a sum over the
    predicted tokens divided by ``num_items_in_batch``), in float64.
    transformers' own ForCausalLMLoss casts the logits to float32
    (``logits.float()``), so two splits of one step would differ at float32's
    rounding and no comparison could be tighter than about 1e-7."""
    logits = outputs["logits"][..., :-1, :]
    target = labels[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    if num_items_in_batch is None:
        return loss / target.ne(-100).sum()
    return loss / num_items_in_batch


def hf_run(out_dir: str, guarded: bool, *, steps: int = 6, batch: int = 8, accumulate: int = 2,
           kb: str = "", logs: list = None, eval_every: int = 0, callbacks=(), resume: str = None, **extra):
    """A Trainer run; returns (trainer, model)."""
    import transformers

    from oomguard.integrations.hf import OomguardTrainer

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        extra.setdefault("ddp_backend", "gloo")
    extra.setdefault("save_strategy", "no")
    if eval_every:
        extra.update(eval_strategy="steps", eval_steps=eval_every, per_device_eval_batch_size=8)
    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
        max_steps=steps, learning_rate=0.05, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.5,
        optim="sgd", optim_args="momentum=0.9", weight_decay=0.01, logging_steps=1,
        report_to=[], use_cpu=True, seed=3, dataloader_num_workers=0, disable_tqdm=True, **extra)
    model = hf_model()
    kwargs = dict(model=model, args=args, train_dataset=Listed(token_data()), data_collator=pad_collate,
                  compute_loss_func=causal_lm_loss_f64,
                  eval_dataset=Listed(token_data(16, seed=9)) if eval_every else None, callbacks=list(callbacks))
    if guarded:
        trainer = OomguardTrainer(**kwargs, knowledge_base=kb or None, workload="hf-test")
    else:
        trainer = transformers.Trainer(**kwargs)
    trainer.train(resume_from_checkpoint=resume)
    if logs is not None:
        logs.extend(trainer.state.log_history)
    return trainer, model


# ---------------------------------------------------------------- Lightning


class TinyLM(torch.nn.Module):
    """A two-layer causal transformer (the shape of the project's GPT example), float64."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.emb(ids) + self.pos[:t]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
        return self.head(self.blocks(h, mask=causal, is_causal=True))


def lm_batches(n: int = N) -> torch.utils.data.TensorDataset:
    """Fixed-length sequences (Lightning averages batch means: one shape per batch)."""
    seqs = token_data(n)
    ids = torch.zeros(n, SEQ, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        ids[i, len(s):] = s[-1]
    return torch.utils.data.TensorDataset(ids)


def lightning_module(logged: list = None):
    import lightning.pytorch as pl

    class LitLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(23)
            self.lm = TinyLM().double()

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            logits = self.lm(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            self.log("train_loss", loss, batch_size=ids.shape[0])
            return loss

        def validation_step(self, batch, batch_idx):
            (ids,) = batch
            logits = self.lm(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            self.log("val_loss", loss, batch_size=ids.shape[0])

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LitLM()


def lightning_run(guarded: bool, *, steps: int = 6, batch: int = 8, accumulate: int = 2, ranks: int = 1,
                  kb: str = "", callbacks=(), val: bool = False, root: str = None, checkpointing: bool = False,
                  ckpt_path: str = None, **extra):
    import lightning.pytorch as pl

    from oomguard.integrations.lightning import GuardedDDPStrategy, OomguardCallback

    module = lightning_module()
    cbs = list(callbacks)
    guard_cb = None
    if guarded:
        guard_cb = OomguardCallback(knowledge_base=kb or None, workload="lightning-test")
        cbs.append(guard_cb)
    if ranks > 1:
        strategy = (GuardedDDPStrategy if guarded else pl.strategies.DDPStrategy)(process_group_backend="gloo")
    else:
        strategy = "auto"
    data = lm_batches()
    # A DistributedSampler without shuffling: the same samples per rank in both runs.
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)
    val_loader = torch.utils.data.DataLoader(lm_batches(16), batch_size=8) if val else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", devices=ranks, strategy=strategy, max_steps=steps,
                             accumulate_grad_batches=accumulate, gradient_clip_val=0.5, logger=False,
                             enable_checkpointing=checkpointing, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=2 if val else 0, default_root_dir=root,
                             callbacks=cbs, **extra)
        trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
    return trainer, module, guard_cb


# ---------------------------------------------------------------- Accelerate


def accelerate_run(guarded: bool, *, steps: int = 6, batch: int = 16, kb: str = ""):
    """A plain Accelerate loop, or the same loop with oomguard's train_step."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    from oomguard.integrations.accelerate import train_step

    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    torch.manual_seed(29)
    model = TinyLM().double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    loader = torch.utils.data.DataLoader(lm_batches(), batch_size=batch, shuffle=False)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    def loss_of(m, ids):
        logits = m(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    step = train_step(accelerator, model, opt, forward=loss_of, scheduler=sched, clip_grad_norm=0.5,
                      knowledge_base=kb or None, workload="accelerate-test") if guarded else None
    losses, done = [], 0
    while done < steps:
        for (ids,) in loader:
            if guarded:
                losses.append(step(ids))
            else:
                opt.zero_grad()
                loss = loss_of(model, ids)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                sched.step()
                losses.append(loss.item())
            done += 1
            if done == steps:
                break
    if step is not None:
        step.finish()
    return accelerator.unwrap_model(model), losses, step


# ---------------------------------------------------------------- processes


def run(trainer: str, mode: str, **kw):
    """One run of a trainer; returns (the trained model, summary dict)."""
    guarded = mode == "guarded"
    summary = {}
    if trainer == "hf":
        with tempfile.TemporaryDirectory() as d:
            t, model = hf_run(d, guarded, **kw)
        summary = {"logs": t.state.log_history}
        if guarded:
            summary.update(ooms=len(t.oomguard_incidents), micro_limit=t.oomguard_step.guard.micro_limit,
                           phases=[i.phase for i in t.oomguard_incidents])
    elif trainer == "lightning":
        with tempfile.TemporaryDirectory() as d:
            t, module, cb = lightning_run(guarded, root=d, **kw)
        model = module
        if guarded:
            summary = {"ooms": len(cb.incidents), "micro_limit": cb.train_step.guard.micro_limit,
                       "losses": cb.losses, "phases": [i.phase for i in cb.incidents]}
        summary["lr"] = t.lr_scheduler_configs[0].scheduler.get_last_lr()
    elif trainer == "accelerate":
        model, losses, step = accelerate_run(guarded, **kw)
        summary = {"losses": losses}
        if guarded:
            summary.update(ooms=len(step.incidents), micro_limit=step.guard.micro_limit,
                           phases=[i.phase for i in step.incidents])
    else:
        raise ValueError(f"unknown trainer {trainer!r}")
    return model, summary


def plain_and_guarded(trainer: str, budget_frac: float = 0.0, faults: str = "", kb: str = "", reuse: dict = None,
                      **kw) -> dict:
    """The unguarded run (counting its peak allocation), then the guarded run
    under ``budget_frac`` of that peak (0: no budget) with the fault rules
    ``faults``; returns both runs' parameters and the guarded run's summary.

    The cyclic garbage collector is off during both runs (the guard still
    collects on every OOM): the trainers leave tensors in reference cycles,
    and when a collection happens to free them would move the peak by a third
    from one run to the next. ``reuse``: the result of an earlier call with
    the same ``kw``, whose unguarded run (parameters, peak) is taken as it is."""
    gc.collect()
    gc.disable()
    try:
        if reuse is not None:
            plain, peak = reuse["plain"], reuse["summary"]["peak"]
            plain_summary = {k[len("plain_"):]: v for k, v in reuse["summary"].items() if k.startswith("plain_")}
        else:
            oomguard.budget.install(0)
            oomguard.budget.reset_peak()
            try:
                plain_model, plain_summary = run(trainer, "plain", **kw)
                peak = oomguard.budget.peak()
            finally:
                oomguard.budget.uninstall()
            plain = flat(plain_model)
            del plain_model
            gc.collect()  # what that run left in reference cycles would count against the budget
        oomguard.set_fault_rules(faults)
        if budget_frac:
            oomguard.budget.install(int(peak * budget_frac))
        try:
            guarded_model, summary = run(trainer, "guarded", kb=kb, **kw)
            summary["faults_fired"] = oomguard.faults_fired()
        finally:
            if budget_frac:
                oomguard.budget.uninstall()
            oomguard.clear_fault_rules()
    finally:
        gc.enable()
    summary.update(peak=peak, plain_losses=plain_summary.get("losses"), plain_logs=plain_summary.get("logs"),
                   plain_lr=plain_summary.get("lr"))
    return {"plain": plain, "guarded": flat(guarded_model), "summary": summary}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("trainers", help="comma-separated: hf, lightning, accelerate")
    p.add_argument("out", help="writes OUT.rankN.json")
    p.add_argument("--budget-frac", type=float, default=0.0, help="this process's budget, a fraction of its peak")
    p.add_argument("--faults", default="", help="fault rules of the guarded runs")
    p.add_argument("--kb", default="", help="the guarded runs' knowledge base")
    a = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out = {}
    for trainer in a.trainers.split(","):
        kw = {"ranks": int(os.environ.get("WORLD_SIZE", "1"))} if trainer == "lightning" else {}
        r = plain_and_guarded(trainer, a.budget_frac, a.faults, kb=f"{a.kb}.{trainer}" if a.kb else "", **kw)
        out[trainer] = {"plain": r["plain"].tolist(), "guarded": r["guarded"].tolist(), "summary": r["summary"]}
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
