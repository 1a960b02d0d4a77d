#!/usr/bin/env python3
"""A tiny GPT-2 trained by transformers.Trainer with every optimizer step
guarded by oomguard (oomguard.integrations.hf.OomguardTrainer).

The model is built from a config (2 layers, a vocabulary of 64: no hub), the
data are sequences of their own lengths, padded per batch (labels -100), and
the Trainer's token-weighted loss (num_items_in_batch) over
--accumulate batches per step. With float64 the final parameters equal those
of --plain (the same Trainer without oomguard) within 1e-10; compare two runs
with --dump-params and --json.

    PYTHONPATH=build/python scripts/python examples/python/hf_trainer.py --budget-mib 3 --json
    ... --ranks 2                                  # two processes over gloo
    ... --faults 'oom@step=3,site=optimizer'       # an injected OOM in the optimizer step
    ... --plain --dump-params /tmp/plain.f64       # the reference run
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _trainer_cli as cli  # noqa: E402

VOCAB, CONTEXT = 64, 32


def data(n: int, seed: int = 0) -> list:
    """Sequences of 8..CONTEXT tokens of a noisy recurrence."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, CONTEXT + 1, (1,), generator=g))
        seq = torch.empty(length, dtype=torch.long)
        seq[0] = int(torch.randint(1, VOCAB, (1,), generator=g))
        for t in range(1, length):
            seq[t] = (3 * seq[t - 1] + 1) % (VOCAB - 1) + 1
        noise = torch.rand(length, generator=g) < 0.1
        seq[noise] = torch.randint(1, VOCAB, (int(noise.sum()),), generator=g)
        out.append(seq)
    return out


def collate(seqs: list) -> dict:
    import torch

    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_in_model_dtype(outputs, labels, num_items_in_batch=None):
    """The causal LM loss as the Trainer weighs it (a sum over predicted tokens
    over num_items_in_batch) in the model's dtype: transformers' own casts the
    logits to float32, which would leave float64 runs 1e-7 apart."""
    import torch

    logits, target = outputs["logits"][..., :-1, :], labels[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss / (num_items_in_batch if num_items_in_batch is not None else target.ne(-100).sum())


def main(argv=None) -> int:
    args, code = cli.start(__doc__.splitlines()[0], argv)
    if code is not None:
        return code

    import torch
    import transformers

    from oomguard.integrations.hf import OomguardTrainer

    transformers.logging.set_verbosity_error()
    rank, world = cli.rank_and_world()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                     eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).to(getattr(torch, args.dtype))
    with tempfile.TemporaryDirectory(prefix="hf_trainer-") as out_dir:
        targs = transformers.TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulate,
            max_steps=args.steps, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0,
            weight_decay=0.01, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
            disable_tqdm=True, ddp_backend="gloo" if world > 1 else None)
        kwargs = dict(model=model, args=targs, train_dataset=data(args.batch * args.accumulate * world * args.steps),
                      data_collator=collate, compute_loss_func=loss_in_model_dtype)
        if args.plain:
            trainer = transformers.Trainer(**kwargs)
        else:
            trainer = OomguardTrainer(**kwargs, knowledge_base=args.kb or None, workload="hf_trainer-example")
        t0 = time.monotonic()
        cli.with_budget(args, trainer.train)
        wall_s = time.monotonic() - t0
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    summary = {
        "steps": trainer.state.global_step,
        "loss_first": logs[0]["loss"] if logs else None,
        "loss_last": logs[-1]["loss"] if logs else None,
        "learning_rates": [e["learning_rate"] for e in logs],
        "grad_norms": [e["grad_norm"] for e in logs],
        "ooms": 0 if args.plain else len(trainer.oomguard_incidents),
        "final_micro_batch": None if args.plain else trainer.oomguard_step.guard.micro_limit,
        "wall_s": round(wall_s, 3),
    }
    params = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    cli.report(args, rank, world, params, cli.gather(params, summary["ooms"], world), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
