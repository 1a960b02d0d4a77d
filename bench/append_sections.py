#!/usr/bin/env python3
"""Appends the step-protocol, knowledge-base, browser-listing, checkpoint and TrainStep sections to
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
    ap.add_argument("--train-step", help="bench/train_step_bench.md (a whole section, appended as it is)")
    a = ap.parse_args()
    md = []
    w = md.append

    votes = json_lines(a.vote)
    if votes:
        w("## The step protocol (4 ranks on this host)")
        w("")
        w("What one optimizer step costs in agreement between ranks. ThreadGroup ranks are threads; MPI")
        w("ranks are processes under `mpirun --oversubscribe -np 4` (4 ranks share the cores listed above).")
        w("")
        lat = [r for r in votes if r.get("bench") == "vote_latency"]
        steps = [r for r in votes if r.get("bench") == "step_with_vote"]
        for r in lat:
            w(f"- {r['engine']}: one vote (an all-gather of the 19-word vote record) takes "
              f"{r['median_us']:.1f} µs median, {r['p99_us']:.1f} µs p99.")
        for r in steps:
            w(f"- {r['engine']}: a guarded step with the guard-owned sync costs {r['step_us_nranks']:.1f} µs with "
              f"{r['ranks']} ranks against {r['step_us_1rank']:.1f} µs with one (no collectives): "
              f"{r['vote_overhead_us']:.1f} µs of protocol per step.")
        proto = [r for r in votes if r.get("bench") == "step_protocol"]
        if proto:
            w("")
            w("Per step, measured side by side in one run over MPI (medians of "
              f"{proto[0]['rounds']} steps): the first protocol's collectives (a MAX all-reduce of 6 int64, "
              "then the gradient sum the user ran) against the atomic step's (the vote all-gather, the "
              "gradient sum with 4 status words appended, the all-gather agreeing on the apply), and a whole "
              "`Guard::Step` with the guard-owned sync over MPI and with the local coordinator.")
            w("")
            w("| gradient (float64) | first protocol | atomic step | ratio | guarded step, local | guarded step, MPI |")
            w("|---:|---:|---:|---:|---:|---:|")
            for r in proto:
                w(f"| {r['grad_floats']} | {r['round1_vote_and_sum_us']:.1f} µs | {r['atomic_vote_sum_agree_us']:.1f} µs "
                  f"| {r['ratio']:.2f} | {r['guarded_step_local_us']:.1f} µs | {r['guarded_step_mpi_us']:.1f} µs |")
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

    if a.train_step and os.path.exists(a.train_step):
        md.extend(open(a.train_step).read().splitlines())
        w("")

    with open(a.results, "a") as f:
        f.write("\n" + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
