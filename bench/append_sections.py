#!/usr/bin/env python3
"""Appends the vote, knowledge-base, browser-listing and checkpoint sections to
bench/RESULTS.md (after make_report.py wrote the guard and controller ones).

Every figure comes from a file the benchmarks wrote in this run."""
import argparse
import json
import os


def gbench(path):
    """Google Benchmark JSON -> {name: benchmark} (aggregates dropped)."""
    if not path or not os.path.exists(path):
        return {}
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        out[b["name"]] = b
    return out


def json_lines(path):
    if not path or not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def ms(b):
    unit = b.get("time_unit", "ns")
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    return b["real_time"] * scale


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--vote", help="JSON lines of vote_bench and mpi_vote")
    ap.add_argument("--kb", help="kb_bench JSON")
    ap.add_argument("--serve", help="kb_serve_bench JSON")
    ap.add_argument("--checkpoint", help="bench/checkpoint_bench.md")
    a = ap.parse_args()
    md = []
    w = md.append

    votes = json_lines(a.vote)
    if votes:
        w("## Vote latency (4 ranks on this host)")
        w("")
        w("One vote = one allreduce of six int64. ThreadGroup ranks are threads; MPI ranks are processes")
        w("under `mpirun --oversubscribe -np 4` (4 ranks share the cores listed above).")
        w("")
        w("| engine | median | p99 | per-step overhead of the vote in Guard::Step |")
        w("|---|---:|---:|---:|")
        by = {}
        for r in votes:
            by.setdefault(r["engine"], {})[r["bench"]] = r
        for engine, rows in by.items():
            lat = rows.get("vote_latency", {})
            step = rows.get("step_with_vote", {})
            w(f"| {engine} | {lat.get('median_us', float('nan')):.1f} µs | {lat.get('p99_us', float('nan')):.1f} µs | "
              f"{step.get('vote_overhead_us', float('nan')):.1f} µs |")
        w("")
        w("Target: tens of microseconds with 4 MPI ranks on one host.")
        w("")

    kb = gbench(a.kb)
    if kb:
        w("## Knowledge base")
        w("")
        w("| operation | time | |")
        w("|---|---:|---|")
        for name, b in kb.items():
            unit = b.get("time_unit", "ns")
            extra = ""
            if "items_per_second" in b:
                extra = f"{b['items_per_second']:,.0f} per second"
            w(f"| {name} | {b['real_time']:.0f} {unit} | {extra} |")
        w("")
        w("Target: Record() on the training thread costs a few microseconds (it copies into a bounded queue).")
        w("")

    serve = gbench(a.serve)
    if serve:
        w("## Browser API over 100,000 incidents")
        w("")
        w("| request | ms |")
        w("|---|---:|")
        worst = 0.0
        for name, b in serve.items():
            t = ms(b)
            if name.startswith("BM_List"):
                worst = max(worst, t)
            w(f"| {name} | {t:.2f} |")
        w("")
        w(f"Target: a listing page in under 200 ms — slowest listing {worst:.1f} ms: "
          f"{'met' if worst < 200 else 'NOT met'}.")
        w("")

    if a.checkpoint and os.path.exists(a.checkpoint):
        w("## Checkpoints")
        w("")
        text = open(a.checkpoint).read().splitlines()
        # Drop the file's own title; keep its table and notes.
        if text and text[0].startswith("# "):
            text = text[1:]
        md.extend(text)
        w("")

    with open(a.results, "a") as f:
        f.write("\n" + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
