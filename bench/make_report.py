#!/usr/bin/env python3
"""Writes bench/RESULTS.md from the benchmarks' JSON (standard library only).

Usage: make_report.py --overhead guard_overhead.json --controller controller.json
                      --out RESULTS.md [--machine machine.txt]
       make_report.py --controller-only --controller controller.json --out RESULTS.md
The second form replaces only the size controller's section and its row of
the targets in an existing RESULTS.md, keeping every other figure.
"""
import argparse
import datetime
import json
import re

OVERHEAD_NS_TARGET = 1000.0  # per micro-batch
RATIO_TARGET = 1.01          # with >= 100 us of work per micro-batch
RECOVERY_US_TARGET = 1000.0
CONTROLLER_OOMS = 2        # to converge from a cold start, or to re-converge after the drop
CONTROLLER_STEADY = 0.97   # of the oracle, mean over the last 50 steps
CONTROLLER_MEAN = 0.95     # of the oracle, mean over the run
CONTROLLER_HEADING = "## Size controller"
POLICY_NAMES = {"predictive": "predictive", "search": "search (before)", "halving": "halving",
                "accel_x0.9": "accel ×0.9"}
SCENARIOS = [  # (name in the JSON, title, what it shows)
    ("cold", "From a cold start, through `Guard::Step`",
     "start 4096, steps of the `global` samples; oracle: the largest balanced split that fits"),
    ("costs", "Variable-length samples, in cost units",
     "1-16 cost units per sample (as tokens), `cost_global` samples per step, limits in cost units, start 4096; "
     "oracle per step: its largest micro-batch when packed at the largest cost limit that fits"),
    ("drop", "Another process takes 30% of the device at step `drop_step`",
     "as the cold start; the process shows only as missing free memory. OOMs: all (from the drop on); "
     "steady: against what fits after the drop"),
    ("warm", "From below (start 32), through `Guard::Step`", "the growth without OOMs to learn from"),
    ("bare", "The controller alone: one micro-batch per step at its limit",
     "fed the figures as the guard feeds them; oracle L"),
    ("frag", "Heavier fragmentation (a stress case, not a target)",
     "as the cold start, on a workload whose layers differ by 30% in size: the caching allocator hoards and "
     "strands far more, and its reserve overstates what it needs"),
]


def yes(ok):
    return "**met**" if ok else "**NOT met**"


def params(name):
    """'BM_X/mb:8/work_us:2/dev:0/...' -> {'mb': 8, 'work_us': 2, 'dev': 0}."""
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)(?=/|$)", name)}


def load_benchmarks(path):
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        if "error_occurred" in b and b["error_occurred"]:
            raise SystemExit(f"benchmark failed: {b['name']}: {b.get('error_message')}")
        rows[b.get("run_name", b["name"])] = b
    return data.get("context", {}), rows


def controller_rows(ctl, scenario, start=None):
    rows = {}
    for r in ctl["runs"]:
        if r["scenario"] == scenario and (start is None or r["start"] == start):
            rows.setdefault(r["L"], {})[r["policy"]] = r
    return rows


def predictive_misses(ctl):
    """The issue's targets for the predictive policy, as a list of misses."""
    misses = []
    for r in ctl["runs"]:
        if r["policy"] != "predictive" or r["scenario"] == "frag":
            continue
        ooms = r["ooms_after_drop"] if r["scenario"] == "drop" else r["ooms"]
        where = f"{r['scenario']} L={r['L']} start={r['start']}"
        if r["failed"]:
            misses.append(f"{where} failed")
        if ooms > CONTROLLER_OOMS:
            misses.append(f"{where}: {ooms} OOMs")
        if r["steady"] < CONTROLLER_STEADY:
            misses.append(f"{where}: steady {r['steady']:.3f}")
        if r["mean"] < CONTROLLER_MEAN:
            misses.append(f"{where}: mean {r['mean']:.3f}")
    return misses


def controller_section(ctl, commit=""):
    """The size controller's section of RESULTS.md, as lines."""
    md = []
    w = md.append
    w(f"{CONTROLLER_HEADING}: predictive vs the search, halving and Accelerate's ×0.9 rule")
    w("")
    if commit:
        w(f"Measured at commit {commit} (where it differs from the commit under Machine, the other sections "
          "are from that one). The figures are counts and sizes from a deterministic simulation: they do not "
          "depend on the machine or its load.")
        w("")
    w(f"One run of `controller_bench`, {ctl['steps']} steps per run, on a simulated {ctl['capacity_gib']} GiB GPU: "
      "`SimulatedDevice` with PyTorch's rounding (512 B), 2 MiB segments, caching and fragmentation, running a "
      "transformer-like step (`tests/integration/sim_workload.h`: per layer a temporary and a saved activation, "
      "a workspace, small buffers kept to the end of the step, gradients in backward). For each L the memory per "
      "unit is calibrated so that L is the largest single micro-batch that runs five steps in a row; a plan "
      "*fits* when the device lets it run five steps in a row (the first step at a size can fit where later ones, "
      "with the cache fragmented, do not). Policies: **predictive** is `SizePolicy::kPredictive` (the default), "
      "**search** is `kSearch`, the controller before it (halve, then binary search); halving is Composer's rule "
      "(halve on OOM, never grow); accel ×0.9 is Accelerate's `find_executable_batch_size` (int(size × 0.9) on "
      "OOM, never grows). Halving and accel ×0.9 drive the same step loop by hand; predictive and search run "
      f"through `Guard::Step` (`global` = {ctl['global']} samples). Columns per policy: OOMs in the run (all of "
      "the predictive policy's come while converging), steady = mean of size/oracle over the last 50 steps, "
      "mean = over all steps (the throughput proxy).")
    w("")
    names = ["predictive", "search", "halving", "accel_x0.9"]
    for scenario, title, what in SCENARIOS:
        starts = [4096, 32] if scenario == "bare" else [None]
        for start in starts:
            rows = controller_rows(ctl, scenario, start)
            if not rows:
                continue
            suffix = f", start {start}" if scenario == "bare" else ""

            def fill(text):
                return (text.replace("`global`", str(ctl["global"]))
                        .replace("`cost_global`", str(ctl.get("cost_global", "?")))
                        .replace("`drop_step`", str(ctl.get("drop_step", "?"))))

            w(f"**{fill(title)}{suffix}** ({fill(what)}).")
            w("")
            head = "| L | oracle |" + "".join(f" {POLICY_NAMES[p]} OOMs | steady | mean |" for p in names)
            w(head)
            w("|---:|---:|" + "---:|---:|---:|" * len(names))
            for L in sorted(rows):
                first = next(iter(rows[L].values()))
                oracle = f"{first['oracle']}" + (f" → {first['oracle_after']}" if scenario == "drop" else "")
                cells = []
                for p in names:
                    r = rows[L].get(p)
                    if r is None:
                        cells.append(" – | – | – |")
                        continue
                    ooms = f"{r['ooms']} ({r['ooms_after_drop']})" if scenario == "drop" else f"{r['ooms']}"
                    if r["failed"]:
                        ooms += " failed"
                    bold = "**" if p == "predictive" else ""
                    cells.append(f" {bold}{ooms}{bold} | {bold}{r['steady']:.3f}{bold} | {r['mean']:.3f} |")
                w(f"| {L} | {oracle} |" + "".join(cells))
            w("")
    misses = predictive_misses(ctl)
    w(f"Issue 17's targets for the predictive policy (at most {CONTROLLER_OOMS} OOMs to converge from a cold start "
      f"and to re-converge after the drop, steady ≥ {CONTROLLER_STEADY} and mean ≥ {CONTROLLER_MEAN} of the oracle, "
      "in samples and in cost units, every scenario but the stress case): "
      + ("**met** in every run." if not misses else "**NOT met**: " + "; ".join(misses) + "."))
    w("")
    w("The controller alone at one L (log scale, then the steady state):")
    w("")
    w("![controller](controller.svg)")
    w("")
    w("Every policy through the guard, one L per panel: from a cold start, and with 30% of the device taken at "
      f"step {ctl.get('drop_step', 150)} (size over the oracle; dots are OOMs):")
    w("")
    w("![controller policies](controller_policies.svg)")
    w("")
    return md


def controller_target_row(ctl):
    worst_ooms, worst_steady, worst_mean = 0, 9.0, 9.0
    for r in ctl["runs"]:
        if r["policy"] != "predictive" or r["scenario"] == "frag":
            continue
        worst_ooms = max(worst_ooms, r["ooms_after_drop"] if r["scenario"] == "drop" else r["ooms"])
        worst_steady = min(worst_steady, r["steady"])
        worst_mean = min(worst_mean, r["mean"])
    return (f"| controller (predictive): ≤ {CONTROLLER_OOMS} OOMs to converge, steady ≥ {CONTROLLER_STEADY} and "
            f"mean ≥ {CONTROLLER_MEAN} of the largest that fits | {worst_ooms} OOMs, steady {worst_steady:.3f}, "
            f"mean {worst_mean:.3f} (every scenario but the stress case) | "
            f"{yes(not predictive_misses(ctl))} |")


def replace_controller(path, ctl, commit=""):
    """Replaces the controller's section and its targets row of an existing RESULTS.md."""
    with open(path) as f:
        lines = f.read().split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith(CONTROLLER_HEADING))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    lines[start:end] = controller_section(ctl, commit)
    for i, l in enumerate(lines):
        if l.startswith("| controller"):
            lines[i] = controller_target_row(ctl)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--overhead")
    ap.add_argument("--controller", required=True)
    ap.add_argument("--controller-only", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--machine", default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()

    with open(args.controller) as f:
        ctl = json.load(f)
    if args.controller_only:
        replace_controller(args.out, ctl, args.commit)
        return
    if not args.overhead:
        ap.error("--overhead is required unless --controller-only")
    context, rows = load_benchmarks(args.overhead)
    machine = open(args.machine).read().strip() if args.machine else ""

    md = []
    w = md.append
    w("# Benchmark results")
    w("")
    w("Generated by `bench/run.sh` (do not edit by hand). Every figure comes from one run on one machine.")
    w("")
    w("## Machine")
    w("")
    w(machine)
    w(f"- SDK: commit {args.commit}" if args.commit else "- SDK: working tree")
    w(f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}")
    w(f"- benchmark library: Google Benchmark (`library_build_type`: {context.get('library_build_type', '?')}); "
      f"work unit calibrated at {float(context.get('ns_per_work_rep', 'nan')):.1f} ns")
    w("")

    # ---- guard overhead ----
    overhead = []
    for name, b in rows.items():
        if name.startswith("BM_GuardOverhead/"):
            p = params(name)
            overhead.append((p["dev"], p["work_us"], p["mb"], b))
    overhead.sort(key=lambda t: (t[0], t[1], t[2]))
    w("## Guard overhead on a step without OOM")
    w("")
    w("A step of N micro-batches of identical arithmetic, run unguarded (PlanBySamples once per step, "
      "then the same lambdas called directly in a loop) and through `Guard::Step` in the same iteration, "
      "alternating which runs first. Figures are per-iteration paired medians (wall clock; CPU-clock "
      "figures exclude preemption). `work/mb` is the measured work per micro-batch; the levels "
      "0, 2 and 100 µs are calibrated once at start-up, so load on a shared machine moves them either way. The work-free rows give the guard's "
      "own cost most precisely; with work, the difference sits at the noise floor and can come out negative.")
    w("")
    w("| device | N | work/mb (µs) | unguarded (µs) | guarded (µs) | overhead/mb (ns) | overhead/mb, CPU (ns) | ratio | ratio, CPU |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst_ns = 0.0
    worst_ratio = 0.0
    work_at_ratio = []
    for dev, work, n, b in overhead:
        ratio = "–" if work == 0 else f"{b['ratio']:.4f}"
        ratio_cpu = "–" if work == 0 else f"{b['ratio_cpu']:.4f}"
        w(f"| {'SimulatedDevice' if dev else 'none'} | {n} | {b['work_us_per_mb']:.2f} | "
          f"{b['unguarded_us']:.2f} | {b['guarded_us']:.2f} | {b['overhead_ns_per_mb']:.0f} | "
          f"{b['overhead_cpu_ns_per_mb']:.0f} | {ratio} | {ratio_cpu} |")
        worst_ns = max(worst_ns, b["overhead_cpu_ns_per_mb"])
        if work >= 100:
            worst_ratio = max(worst_ratio, b["ratio_cpu"])
            work_at_ratio.append(b["work_us_per_mb"])
    w("")
    fit = {}
    for dev, work, n, b in overhead:
        if work == 0:
            fit[(dev, n)] = b["overhead_cpu_ns_per_mb"] * n  # per step
    for dev in (0, 1):
        if (dev, 1) in fit and (dev, 64) in fit:
            per_mb = (fit[(dev, 64)] - fit[(dev, 1)]) / 63
            fixed = fit[(dev, 1)] - per_mb
            w(f"From the work-free rows ({'SimulatedDevice' if dev else 'no device'}): about "
              f"{fixed:.0f} ns per step plus {per_mb:.1f} ns per micro-batch.")
            w("")
    mark = rows.get("BM_MarkPhasePair")
    if mark:
        w(f"`Guard::MarkPhase` (forward + backward, as in guard.h's example; not in the lambdas above): "
          f"{mark['real_time']:.1f} ns per micro-batch.")
        w("")

    # ---- recovery ----
    w("## Recovery: SDK time from an OOM to the retry")
    w("")
    w("Each iteration resets the limit to 64 (`SetMicroLimit`), so the step's micro-batch of 64 OOMs once; "
      "the guard records the incident, releases caches, halves to 32 and retries. `recovery` is the mean "
      "`StepReport::recovery_ms` (from catching the OOM to the re-planned retry, user cache releasers "
      "excluded); `throw→retry` is measured by the micro lambda from its `throw` to the retry's call, so it "
      "includes unwinding. The SDK's warning per OOM is formatted into a null sink.")
    w("")
    w("| OOM source | device | recovery (µs) | throw→retry (µs) | whole step (µs) |")
    w("|---|---|---:|---:|---:|")
    worst_rec = 0.0
    for name, b in sorted(rows.items()):
        if not name.startswith("BM_Recovery/"):
            continue
        p = params(name)
        src = "fault injection" if p["src"] else "user throws DeviceOomError"
        ttr = f"{b['throw_to_retry_us']:.2f}" if "throw_to_retry_us" in b else "–"
        w(f"| {src} | {'SimulatedDevice' if p['dev'] else 'none'} | {b['recovery_us']:.2f} | {ttr} | "
          f"{b['real_time']:.2f} |")
        worst_rec = max(worst_rec, b["recovery_us"], b.get("throw_to_retry_us", 0.0))
    w("")

    # ---- controller ----
    md.extend(controller_section(ctl))

    # ---- targets ----
    w("## Targets")
    w("")
    w("| target | measured (worst case) | |")
    w("|---|---|---|")
    w(f"| guard overhead < 1 µs per micro-batch | {worst_ns:.0f} ns (CPU clock, any N, any work) | "
      f"{yes(worst_ns < OVERHEAD_NS_TARGET)} |")
    work_span = (f"{min(work_at_ratio):.0f}–{max(work_at_ratio):.0f} µs" if work_at_ratio else "?")
    w(f"| guarded/unguarded ≤ {RATIO_TARGET} at the 100 µs work level (measured {work_span} per "
      f"micro-batch) | {worst_ratio:.4f} (CPU clock) | {yes(worst_ratio <= RATIO_TARGET)} |")
    w(f"| recovery (OOM to retry) < 1 ms | {worst_rec:.1f} µs | {yes(worst_rec < RECOVERY_US_TARGET)} |")
    w(controller_target_row(ctl))
    w("")
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
