#!/usr/bin/env python3
"""The project's TinyGPT (examples/python/train_gpt.py) as a LightningModule,
trained by Lightning's Trainer with every optimizer step guarded by oomguard
(oomguard.integrations.lightning: OomguardCallback, and GuardedDDPStrategy
for --ranks 2).

Sequences of their own lengths (labels -1 past the end) and a loss that is
the mean over a batch's valid tokens: the callback is told each sequence's
tokens (loss_units), so a batch split by an OOM still counts as Lightning
counts it. accumulate_grad_batches, gradient_clip_val, a per-step LR
scheduler and self.log run as without oomguard. With float64 the final
parameters equal those of --plain (the same Trainer without oomguard) within
1e-10; compare two runs with --dump-params and --json.

    PYTHONPATH=build/python scripts/python examples/python/lightning_train.py --budget-mib 2 --json
    ... --ranks 2                                  # two processes, GuardedDDPStrategy over gloo
    ... --faults 'oom@step=3,site=optimizer'       # an injected OOM in the optimizer step
    ... --plain --dump-params /tmp/plain.f64       # the reference run (DDPStrategy with --ranks 2)
"""

from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _trainer_cli as cli  # noqa: E402

VOCAB, CONTEXT = 64, 32


def main(argv=None) -> int:
    args, code = cli.start(__doc__.splitlines()[0], argv)
    if code is not None:
        return code

    import logging

    import lightning.pytorch as pl
    import torch

    from oomguard.integrations.lightning import GuardedDDPStrategy, OomguardCallback
    from train_gpt import TinyGPT, make_batch, token_loss, valid_tokens, warmup_cosine

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    rank, world = cli.rank_and_world()
    dtype = getattr(torch, args.dtype)

    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = TinyGPT(VOCAB, 32, 2, 2, CONTEXT).to(dtype)

        def training_step(self, batch, batch_idx):
            tokens, labels = batch
            loss = token_loss(self.gpt(tokens), labels)
            self.log("train_loss", loss, batch_size=tokens.shape[0])
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, args.steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # the whole run's sequences, made up front; a DistributedSampler gives each rank its share
    tokens, labels = make_batch(0, 0, args.batch * args.accumulate * world * args.steps, CONTEXT, VOCAB)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=args.batch,
                                         shuffle=False, drop_last=True)
    module = GPTModule()
    gathered = []

    class Gather(pl.Callback):
        """The ranks' digests while Lightning's process group is still up."""

        def on_train_end(self, trainer, pl_module):
            ooms = len(guard.incidents) if guard else 0
            gathered.extend(cli.gather(torch.cat([q.detach().reshape(-1) for q in pl_module.parameters()]),
                                       ooms, world))

    callbacks = [Gather()]
    guard = None
    if not args.plain:
        guard = OomguardCallback(knowledge_base=args.kb or None, workload="lightning_train-example",
                                 loss_units=lambda batch: valid_tokens(*batch))
        callbacks.insert(0, guard)
    if world > 1:
        strategy = (pl.strategies.DDPStrategy if args.plain else GuardedDDPStrategy)(process_group_backend="gloo")
    else:
        strategy = "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
                         accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    t0 = time.monotonic()
    cli.with_budget(args, lambda: trainer.fit(module, loader))
    wall_s = time.monotonic() - t0
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    summary = {
        "steps": trainer.global_step,
        "loss_first": guard.losses[0] if guard and guard.losses else None,
        "loss_last": guard.losses[-1] if guard and guard.losses else None,
        "scheduler": {"last_epoch": scheduler.last_epoch, "last_lr": scheduler.get_last_lr()},
        "ooms": len(guard.incidents) if guard else 0,
        "final_micro_batch": guard.train_step.guard.micro_limit if guard else None,
        "wall_s": round(wall_s, 3),
    }
    cli.report(args, rank, world, torch.cat([q.detach().reshape(-1) for q in module.parameters()]), gathered,
               summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
