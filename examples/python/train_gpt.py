#!/usr/bin/env python3
"""A small GPT-style decoder trained through oomguard: padded token batches,
AdamW with warmup and cosine decay, gradient clipping, optional DDP over gloo.

Every sequence of a batch has its own length; labels past it are -1 and the
loss is the mean over valid tokens (``ignore_index=-1``). ``TrainStep`` is
told how many valid tokens each sample holds (``loss_units``), so however an
out-of-memory error splits the step, across micro-batches and ranks, the
gradient is the whole global batch's. With float64 the final parameters and
the scheduler equal those of ``--plain`` (the whole batch in one forward, no
guard) within 1e-10; compare two runs with ``--dump-params`` and ``--json``.

    PYTHONPATH=build/python scripts/python examples/python/train_gpt.py \\
        --steps 10 --budget-mib 6 --dtype float64 --json
    ... --ranks 2 --ckpt-dir /tmp/gpt-ckpt        # two processes, DDP over gloo
    ... --faults 'oom@step=2,rank=1,site=apply'   # injected OOMs (OOMGUARD_FAULTS too)
    ... --ranks 2 --parallel fsdp                 # FSDP2: fully_shard per block and on the model
    ... --parallel ddp-overlap --faults 'oom@step=1,rank=1,site=bucket,after=2'  # OOM mid-backward
                                                  # (after=last: past the round's status; hook=K: in the comm hook)
    ... --plain                                   # the reference run

Data for step k is a pure function of (seed, k), so a rolled-back or resumed
run sees the same batches; rank r of R takes samples [r*B/R, (r+1)*B/R) of
each global batch of B. Under torchrun (RANK and WORLD_SIZE set) each process
is one rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import oomguard
import oomguard.budget
import oomguard.torch as ogt


# ---- the model ----

class CausalSelfAttention(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(h).split(c, dim=2)
        # (b, heads, t, c/heads)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        future = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class TinyGPT(torch.nn.Module):
    """Pre-norm decoder: token and position embeddings, blocks, a final norm, a head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tokens(tokens) + self.positions(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the valid tokens (labels != -1)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-1)


def valid_tokens(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss units of each sample: its valid tokens."""
    return (labels != -1).sum(dim=1)


def shard_per_block(model: TinyGPT) -> None:
    """FSDP2: one unit per block, the rest (embeddings, final norm, head) in the root's unit."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


# ---- data ----

def make_batch(seed: int, step: int, batch: int, context: int, vocab: int):
    """Step `step`'s global batch: sequences of a noisy affine recurrence, each
    of its own length (1 to context), padded with token 0 and label -1."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    noise = (torch.rand(batch, context + 1, generator=g) < 0.1) * torch.randint(1, vocab, (batch, context + 1),
                                                                               generator=g)
    seq = torch.empty(batch, context + 1, dtype=torch.int64)
    seq[:, :1] = start
    for t in range(1, context + 1):
        seq[:, t] = (3 * seq[:, t - 1] + 1 + noise[:, t]) % vocab
    lengths = torch.randint(1, context + 1, (batch,), generator=g)
    past = torch.arange(context).view(1, -1) >= lengths.view(-1, 1)
    tokens = seq[:, :-1].masked_fill(past, 0)
    labels = seq[:, 1:].masked_fill(past, -1)
    return tokens, labels


def warmup_cosine(warmup: int, steps: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))  # down to a tenth

    return factor


# ---- command line ----

# How --ranks > 1 distributes the model: the one place that lists the modes.
PARALLEL = {
    "ddp": "DDP; the guard sums the gradients after the last backward (the default)",
    "ddp-overlap": "DDP; its bucketed all-reduce overlaps the last backward (TrainStep(ddp_overlap=True))",
    "fsdp": "FSDP2 (fully_shard per block and on the model)",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, over every rank")
    p.add_argument("--context", type=int, default=32, help="tokens per sequence (padded)")
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=2, help="warmup steps of the LR schedule")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    p.add_argument("--micro-batch", type=int, default=0, help="initial micro-batch (0: the whole batch)")
    p.add_argument("--grow-after", type=int, default=10, help="clean steps before the micro-batch grows")
    p.add_argument("--budget-mib", type=float, default=0, help="CPU allocator budget per rank in MiB (0: none)")
    p.add_argument("--ranks", type=int, default=1, help="processes, DDP over gloo (1: no DDP)")
    p.add_argument("--parallel", choices=list(PARALLEL), default="ddp",
                   help="with --ranks > 1: " + "; ".join(f"{k}: {v}" for k, v in PARALLEL.items()))
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (gradient bucket size)")
    p.add_argument("--fsdp-agreement", choices=["data", "check"], default="data",
                   help="with --parallel fsdp: the failure flags inside FSDP's collectives (data) or a check "
                        "before each of them (check); docs/distributed.md")
    p.add_argument("--plain", action="store_true", help="the reference: whole batch, no guard (one process)")
    p.add_argument("--ckpt-dir", default="", help="checkpoint directory (empty: no checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="save every N steps (0: the Checkpointer's default, after recoveries only)")
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --ckpt-dir")
    p.add_argument("--faults", default="", help="fault rules, as OOMGUARD_FAULTS (e.g. oom@step=2,site=apply)")
    p.add_argument("--deadline-ms", type=int, default=60000, help="deadline of each collective between ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump-params", default="", metavar="PATH",
                   help="write all parameters in state_dict order as raw little-endian float64 (rank 0)")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line (rank 0)")
    p.set_defaults(rank=-1, init_file="")  # set by the launcher for its workers
    args = p.parse_args(argv)
    for name in ("steps", "global_batch", "context", "vocab", "width", "layers", "heads", "ranks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    for name in ("micro_batch", "grow_after", "warmup", "ckpt_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(args, name)})")
    if args.budget_mib < 0 or args.clip < 0 or args.lr <= 0 or args.deadline_ms < 1 or args.bucket_mb <= 0:
        p.error("--budget-mib and --clip must be >= 0, --lr > 0, --deadline-ms >= 1, --bucket-mb > 0")
    if args.width % args.heads:
        p.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if args.global_batch < args.ranks:
        p.error(f"--global-batch {args.global_batch} is smaller than --ranks {args.ranks}")
    if args.plain and (args.ranks > 1 or args.budget_mib or args.faults or args.ckpt_dir):
        p.error("--plain is the reference run: one process, no --budget-mib, --faults or --ckpt-dir")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if args.faults:
        native, bucket = ogt.ddp.split_fault_spec(args.faults)
        if bucket and args.parallel != "ddp-overlap":
            p.error("--faults: site=bucket rules need --parallel ddp-overlap")
        try:
            oomguard.set_fault_rules(native)
            ogt.ddp.set_bucket_faults(bucket)
        except ValueError as e:
            p.error(f"--faults: {e}")
        oomguard.clear_fault_rules()
        ogt.ddp.clear_bucket_faults()
    return args


# ---- launching ranks ----

def launch(args: argparse.Namespace) -> int:
    """Runs --ranks processes, one rank each, and waits for all of them; rank 0
    prints the summary. Returns the first failing rank's exit code (75 when a
    peer stopped answering). The workers are forked: this process has imported
    torch but run nothing yet, and a fork skips a second import per rank."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="train_gpt-") as tmp:
        procs = []
        for r in range(args.ranks):
            worker = argparse.Namespace(**vars(args))
            worker.rank, worker.init_file = r, os.path.join(tmp, "init")
            procs.append(ctx.Process(target=_worker, args=(worker,), name=f"rank{r}"))
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
            print(f"rank {r} ended with {how}", file=sys.stderr)
            return p.exitcode if p.exitcode > 0 else 1
    return 0


def _worker(args: argparse.Namespace) -> None:
    code = 1
    try:
        code = run_rank(args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def init_distributed(args: argparse.Namespace):
    """(rank, world size): from the launcher's flags, torchrun's environment, or one process."""
    if args.rank >= 0:
        dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=args.rank,
                                world_size=args.ranks, timeout=timedelta(milliseconds=args.deadline_ms * 2))
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("gloo", timeout=timedelta(milliseconds=args.deadline_ms * 2))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- training ----

def run_plain(args, model, optimizer, scheduler):
    """The reference loop: the whole global batch in one forward, no guard."""
    losses = []
    for step in range(args.steps):
        tokens, labels = make_batch(args.seed, step, args.global_batch, args.context, args.vocab)
        optimizer.zero_grad(set_to_none=True)
        loss = token_loss(model(tokens), labels)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return {"losses": losses, "ooms": 0, "rollbacks": 0, "final_micro_batch": args.global_batch,
            "last_checkpoint": -1}


def run_guarded(args, rank, world, model, optimizer, scheduler):
    ckpt = None
    if args.ckpt_dir:
        options = {"every_steps": args.ckpt_every} if args.ckpt_every else {}
        ckpt = oomguard.Checkpointer(args.ckpt_dir, **options)  # rank and world from torch.distributed
        ogt.register_state(ckpt, model=model, optimizer=optimizer, scheduler=scheduler)
    coordinator = ogt.TorchDistributedCoordinator() if world > 1 else None
    guard = oomguard.Guard(initial_micro_batch=args.micro_batch, grow_after=args.grow_after, recovery=ckpt,
                           coordinator=coordinator, vote_deadline_ms=args.deadline_ms,
                           workload=f"train_gpt-w{args.width}-l{args.layers}-c{args.context}-{args.dtype}",
                           **(ogt.fsdp.GUARD_OPTIONS if world > 1 and args.parallel == "fsdp" else {}))
    if world > 1 and args.parallel in ("ddp", "ddp-overlap"):
        # The first bucket DDP builds after its first step is capped by this
        # module-level default (1 MiB), not by bucket_cap_mb: cap it too.
        dist._DEFAULT_FIRST_BUCKET_BYTES = min(dist._DEFAULT_FIRST_BUCKET_BYTES, int(args.bucket_mb * (1 << 20)))
        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=args.bucket_mb)
    train_step = ogt.TrainStep(model, optimizer, token_loss, guard=guard, loss_units=valid_tokens,
                               scheduler=scheduler, clip_grad_norm=args.clip or None,
                               ddp_overlap=world > 1 and args.parallel == "ddp-overlap",
                               fsdp_agreement=args.fsdp_agreement)
    if args.resume:
        resumed = guard.resume()
        if resumed is not None and rank == 0:
            print(f"resumed from step {resumed}", file=sys.stderr)
    lo, hi = rank * args.global_batch // world, (rank + 1) * args.global_batch // world
    if args.faults:
        native, bucket = ogt.ddp.split_fault_spec(args.faults)
        oomguard.set_fault_rules(native)
        ogt.ddp.set_bucket_faults(bucket)
    if args.budget_mib > 0:
        oomguard.budget.install(int(args.budget_mib * (1 << 20)))
    losses, rollbacks = {}, 0
    try:
        while guard.next_step < args.steps:
            step = guard.next_step
            tokens, labels = make_batch(args.seed, step, args.global_batch, args.context, args.vocab)
            try:
                loss = train_step(tokens[lo:hi], labels[lo:hi])
            except oomguard.RolledBackError as e:
                rollbacks += 1
                print(f"rank {rank} step {step}: {e}; continuing from step {e.next_step}", file=sys.stderr)
                continue
            losses[step] = loss
            report = train_step.last_report
            if not args.json and rank == 0:
                print(f"step {step:4d}  loss {loss:.6f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                      f"micro-batches {report.micro_batches}  ooms {report.ooms}")
    except oomguard.CoordinationTimeoutError as e:
        print(f"rank {rank}: peers stopped answering: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(oomguard.EXIT_COORDINATION_TIMEOUT)  # _exit: a stuck collective must not block the exit
    finally:
        if args.budget_mib > 0:
            oomguard.budget.uninstall()
        oomguard.clear_fault_rules()
        ogt.ddp.clear_bucket_faults()
    last = guard.finish()
    return {"losses": [losses[k] for k in sorted(losses)], "ooms": guard.total_ooms, "rollbacks": rollbacks,
            "final_micro_batch": min(guard.micro_limit or hi - lo, hi - lo), "last_checkpoint": last}


def train(args: argparse.Namespace) -> dict:
    """Trains this process's rank; returns the summary (rank 0's "params": the
    flat float64 parameters)."""
    rank, world = init_distributed(args)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.width, args.layers, args.heads, args.context).to(dtype)
    if world > 1 and args.parallel == "fsdp":
        shard_per_block(model)  # before the optimizer: fully_shard replaces the parameters
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
    t0 = time.monotonic()
    if args.plain:
        summary = run_plain(args, model, optimizer, scheduler)
    else:
        summary = run_guarded(args, rank, world, model, optimizer, scheduler)
    wall_s = time.monotonic() - t0

    params = ogt.flat_parameters(model)
    digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
    ranks = [{"rank": rank, "ooms": summary["ooms"], "params_sha256": digest}]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, ranks[0])
        ranks = gathered
        dist.barrier()
        dist.destroy_process_group()
    losses = summary["losses"]
    return {
        "rank": rank,
        "steps": args.steps,
        "ranks": ranks,
        "world_size": world,
        "identical": len({r["params_sha256"] for r in ranks}) == 1,
        "ooms": sum(r["ooms"] for r in ranks),
        "rollbacks": summary["rollbacks"],
        "final_micro_batch": summary["final_micro_batch"],
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "scheduler": {"last_epoch": scheduler.last_epoch, "last_lr": scheduler.get_last_lr()},
        "last_checkpoint": summary["last_checkpoint"],
        "wall_s": round(wall_s, 3),
        "params": params,
    }


def train_and_report(args: argparse.Namespace) -> int:
    result = train(args)
    params = result.pop("params")
    if result.pop("rank") == 0:
        if args.dump_params:
            params.numpy().astype("<f8").tofile(args.dump_params)
        if args.json:
            print(json.dumps(result))
    return 0


def run_rank(args: argparse.Namespace) -> int:
    try:
        return train_and_report(args)
    except (oomguard.OutOfMemoryError, oomguard.PeerFailedError) as e:
        # Every rank stops at the same step; each says why in its own words.
        print(f"training stopped: {e}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ranks > 1 and args.rank < 0 and "WORLD_SIZE" not in os.environ:
        return launch(args)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
