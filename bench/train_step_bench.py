#!/usr/bin/env python3
"""TrainStep's and fit()'s overhead against the plain PyTorch loop, with no OOM.

Both loops train the GPT-style decoder of examples/python/train_gpt.py in
float32 on padded token batches with the same work per step: one forward and
backward of the whole batch, gradient clipping, AdamW, a warmup/cosine
scheduler. The guarded loop goes through ``oomguard.torch.TrainStep`` with
``loss_units`` (valid tokens), ``scheduler`` and ``clip_grad_norm``: the guard's
plan, vote and bookkeeping, the phase marks, the per-step unit counts, the
device figures and the loss kept on the device until one host sync.

The two run in one process and alternate step by step (plain, guarded, plain,
...) on two copies of the model, so that drift in the machine's load hits
both alike. fit() owns its loop, so it is compared run against run: a plain
loop over a DataLoader of the same dataset and batches, then fit() for the
same steps, alternating, several times. Prints a JSON line; with --markdown
writes the section of bench/RESULTS.md.

    PYTHONPATH=build/python scripts/python bench/train_step_bench.py --markdown bench/train_step_bench.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import time

import torch

import oomguard
import oomguard.torch as ogt

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "python" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=40, help="measured (plain, guarded) step pairs")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured pairs first")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fit-steps", type=int, default=20, help="steps of each fit() and plain run")
    p.add_argument("--fit-runs", type=int, default=5, help="measured (plain, fit) run pairs")
    p.add_argument("--markdown", default="", help="write the RESULTS.md section here")
    args = p.parse_args()
    if args.pairs < 3 or args.warmup < 0:
        p.error("--pairs must be >= 3, --warmup >= 0")
    gpt = load_example()
    vocab, heads, steps = 512, 4, args.warmup + args.pairs

    def build():
        torch.manual_seed(0)
        model = gpt.TinyGPT(vocab, args.width, args.layers, heads, args.context)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, gpt.warmup_cosine(2, steps))
        return model, opt, sched

    plain_model, plain_opt, plain_sched = build()
    model, opt, sched = build()
    guard = oomguard.Guard()
    train_step = ogt.TrainStep(model, opt, gpt.token_loss, guard=guard, loss_units=gpt.valid_tokens,
                               scheduler=sched, clip_grad_norm=1.0)

    def plain_step(tokens, labels):
        plain_opt.zero_grad(set_to_none=True)
        loss = gpt.token_loss(plain_model(tokens), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        plain_opt.step()
        plain_sched.step()
        return loss.item()

    load_before = _load()
    plain_ms, guarded_ms = [], []
    for k in range(steps):
        tokens, labels = gpt.make_batch(0, k, args.batch, args.context, vocab)
        # Alternate which loop goes first, so neither always runs on a warmer cache.
        order = ("plain", "guarded") if k % 2 == 0 else ("guarded", "plain")
        for which in order:
            t0 = time.perf_counter()
            if which == "plain":
                a = plain_step(tokens, labels)
            else:
                b = train_step(tokens, labels)
            dt = (time.perf_counter() - t0) * 1e3
            if k >= args.warmup:
                (plain_ms if which == "plain" else guarded_ms).append(dt)
        if k < 2 and abs(a - b) > 1e-4 * abs(a):  # same model, same data: same loss
            raise SystemExit(f"the two loops disagree at step {k}: {a} vs {b}")
    ratios = [g / q for g, q in zip(guarded_ms, plain_ms)]
    fixed_us = fixed_cost_us(gpt)
    fit_result = fit_overhead(gpt, args, vocab, heads)
    result = {
        "bench": "train_step_overhead",
        "model": f"TinyGPT width {args.width}, {args.layers} layers, context {args.context}, vocab {vocab}, float32",
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": args.batch,
        "pairs": args.pairs,
        "plain_median_ms": statistics.median(plain_ms),
        "guarded_median_ms": statistics.median(guarded_ms),
        "ratio_of_medians": statistics.median(guarded_ms) / statistics.median(plain_ms),
        "median_pair_ratio": statistics.median(ratios),
        "mean_ratio": sum(guarded_ms) / sum(plain_ms),
        "plain_min_ms": min(plain_ms),
        "guarded_min_ms": min(guarded_ms),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "ooms": guard.total_ooms,
        "fixed_cost_us": fixed_us,
        "load_before": load_before,
        "load_after": _load(),
        **fit_result,
        "commit": _commit(),
    }
    print(json.dumps(result))
    if args.markdown:
        write_markdown(args.markdown, result)
    return 0


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def fixed_cost_us(gpt, pairs: int = 400) -> float:
    """What TrainStep adds to a step whatever the model: the same alternation on
    a model whose step costs next to nothing (median of guarded - plain, µs)."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 8) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    train_step = ogt.TrainStep(models[1], opts[1], torch.nn.functional.mse_loss, guard=oomguard.Guard())
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def plain():
        opts[0].zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(models[0](x), y)
        loss.backward()
        opts[0].step()
        return loss.item()

    diffs = []
    for k in range(pairs + 20):
        t0 = time.perf_counter()
        plain()
        t1 = time.perf_counter()
        train_step(x, y)
        t2 = time.perf_counter()
        if k >= 20:
            diffs.append(((t2 - t1) - (t1 - t0)) * 1e6)
    return statistics.median(diffs)


def fit_overhead(gpt, args, vocab: int, heads: int) -> dict:
    """fit() against the plain loop over the same DataLoader batches, run
    against run (each alternation: a plain run, then a fit run), no
    checkpoints, no evaluation: what fit adds to a loop."""
    steps, runs = args.fit_steps, args.fit_runs
    n = steps * args.batch
    tokens, labels = zip(*(gpt.make_batch(0, k, args.batch, args.context, vocab) for k in range(steps)))
    dataset = torch.utils.data.TensorDataset(torch.cat(tokens), torch.cat(labels))

    def build():
        torch.manual_seed(0)
        model = gpt.TinyGPT(vocab, args.width, args.layers, heads, args.context)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, gpt.warmup_cosine(2, steps))

    def plain_run() -> float:
        model, opt, sched = build()
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=ogt.StepBatchSampler(n, args.batch, seed=0,
                                                                                          steps=steps))
        t0 = time.perf_counter()
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = gpt.token_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss.item()
        return time.perf_counter() - t0

    def fit_run() -> float:
        model, opt, sched = build()
        t0 = time.perf_counter()
        ogt.fit(model, opt, gpt.token_loss, dataset, global_batch=args.batch, steps=steps, loss_units=gpt.valid_tokens,
                scheduler=sched, clip_grad_norm=1.0)
        return time.perf_counter() - t0

    plain_s, fit_s = [], []
    for k in range(runs + 1):
        order = (plain_run, fit_run) if k % 2 == 0 else (fit_run, plain_run)
        times = {f: f() for f in order}
        if k > 0:  # the first alternation warms both up
            plain_s.append(times[plain_run])
            fit_s.append(times[fit_run])
    return {"fit_steps": steps, "fit_runs": runs, "fit_plain_median_s": statistics.median(plain_s),
            "fit_median_s": statistics.median(fit_s),
            "fit_ratio": statistics.median(f / p for f, p in zip(fit_s, plain_s))}


def write_markdown(path: str, r: dict) -> None:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "none (CPU tensors)"
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    met = "**met**" if r["median_pair_ratio"] <= 1.03 else "**not met**"
    lines = [
        "## TrainStep and fit() overhead (Python, no OOM)",
        "",
        f"`bench/train_step_bench.py`: {r['model']} ({r['parameters']:,} parameters), "
        f"{r['batch']} padded sequences per step, AdamW + warmup/cosine + clipping. The plain loop and "
        f"`oomguard.torch.TrainStep` (with `loss_units`, `scheduler`, `clip_grad_norm`) alternate step by "
        f"step in one process, {r['pairs']} measured pairs after a warmup, no OOM ({r['ooms']} seen). "
        f"Machine: {cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, GPU {gpu}, load average "
        f"{r['load_before']} before and {r['load_after']} after; torch {r['torch']} with {r['threads']} "
        f"intra-op thread{'s' if r['threads'] != 1 else ''}; Python {platform.python_version()}; commit "
        f"{r['commit']}.",
        "",
        "| loop | median step (ms) | fastest step (ms) |",
        "|---|---|---|",
        f"| plain PyTorch | {r['plain_median_ms']:.1f} | {r['plain_min_ms']:.1f} |",
        f"| TrainStep | {r['guarded_median_ms']:.1f} | {r['guarded_min_ms']:.1f} |",
        "",
        f"Guarded/plain, median of the per-pair ratios (each pair ran back to back): "
        f"**{r['median_pair_ratio']:.4f}**. Target ≤ 1.03: {met}. Other views of the same run: ratio of the "
        f"medians {r['ratio_of_medians']:.4f}, of the totals {r['mean_ratio']:.4f}, of the fastest steps "
        f"{r['guarded_min_ms'] / r['plain_min_ms']:.4f} (the machine is shared, so single steps vary by "
        f"tens of ms). What TrainStep adds to any step, measured the same way on a model whose step costs "
        f"next to nothing: {r['fixed_cost_us']:.0f} µs.",
        "",
        f"`oomguard.torch.fit` against the plain loop over a DataLoader of the same dataset and batches "
        f"(`StepBatchSampler`), run against run: {r['fit_runs']} alternations of a {r['fit_steps']}-step plain "
        f"run and a {r['fit_steps']}-step fit run (no checkpoints, no evaluation), after one warm-up "
        f"alternation. Median plain run {r['fit_plain_median_s']:.2f} s, median fit run {r['fit_median_s']:.2f} s; "
        f"fit/plain, median of the per-alternation ratios: **{r['fit_ratio']:.4f}** (it includes fit's set-up: "
        f"the guard, the step, the loader).",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
