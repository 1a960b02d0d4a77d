#!/usr/bin/env python3
"""Draws the size controller's plots from controller_bench's CSV (standard library only).

Usage: plot_controller.py CSV SVG [--L 300] [--start 4096] [--panels PANELS_SVG]

SVG: one scenario ("bare": the controller alone) at one L, in two panels:
every step on a log2 scale, and the steady state on a linear scale around L.
One step-shaped line per policy (the size each step completed at), OOMs as
small dots at the size that failed, and a dashed line at L.

PANELS_SVG: the guard end to end, one L per column: the top row from a cold
start (4096), the bottom row with another process taking 30% of the device
at step 150. Each panel shows every policy's size over the steps relative
to the largest size that fits then (the oracle: 1 is the dashed line), with
OOMs as dots; sizes above 1.25 x the oracle are drawn at the top edge.
"""
import argparse
import csv
import math
import sys
from collections import defaultdict
from xml.sax.saxutils import escape

POLICIES = [  # (name in the CSV, legend label, colour)
    ("predictive", "oomguard predictive", "#1f77b4"),
    ("search", "oomguard search (before)", "#9467bd"),
    ("halving", "halving only", "#d62728"),
    ("accel_x0.9", "Accelerate \u00d70.9 rule", "#2ca02c"),
]
WIDTH, HEIGHT = 820, 640
LEFT, RIGHT, TOP, BOTTOM = 78, 24, 48, 58


def read(path):
    """{(scenario, L, start, policy): {"ok": {step: size}, "oom": [(step, size)], "oracle": {step: oracle}}}"""
    runs = defaultdict(lambda: {"ok": {}, "oom": [], "oracle": {}})
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = (row["scenario"], int(row["L"]), int(row["start"]), row["policy"])
            step, size, oracle = int(row["step"]), int(row["size"]), int(row["oracle"])
            r = runs[key]
            if row["event"] == "oom":
                r["oom"].append((step, size))
            else:
                r["ok"][step] = size
            if oracle > 0:
                r["oracle"][step] = oracle
    return runs


def panel(w, title, top, h, y, yticks, x, steps, pw, limit, ok, ooms, clip_id):
    """Draws one panel: grid, ticks, the dashed limit, the lines and the OOM dots."""
    w(f'<text x="{LEFT}" y="{top - 8}" fill="#444">{escape(title)}</text>')
    for v in yticks:
        yy = y(v)
        w(f'<line x1="{LEFT}" y1="{yy:.1f}" x2="{LEFT + pw}" y2="{yy:.1f}" stroke="#e5e5e5"/>')
        w(f'<text x="{LEFT - 8}" y="{yy + 4:.1f}" text-anchor="end">{v}</text>')
    tick = 50 if steps > 100 else 10
    for s in range(0, steps, tick):
        xx = x(s)
        w(f'<line x1="{xx:.1f}" y1="{top + h}" x2="{xx:.1f}" y2="{top + h + 5}" stroke="#333"/>')
        w(f'<text x="{xx:.1f}" y="{top + h + 18}" text-anchor="middle">{s}</text>')
    w(f'<clipPath id="{clip_id}"><rect x="{LEFT}" y="{top}" width="{pw}" height="{h}"/></clipPath>')
    w(f'<g clip-path="url(#{clip_id})">')
    yl = y(limit)
    w(f'<line x1="{LEFT}" y1="{yl:.1f}" x2="{LEFT + pw}" y2="{yl:.1f}" stroke="#555" '
      'stroke-width="1.2" stroke-dasharray="6 4"/>')
    for pol, _, colour in reversed(POLICIES):  # the predictive policy on top
        pts = []
        for s in sorted(ok[pol]):
            yy = y(ok[pol][s])
            if pts and abs(yy - pts[-1][1]) < 0.05:
                continue  # a step line needs a point only where it moves
            if pts:
                pts.append((x(s), pts[-1][1]))
            pts.append((x(s), yy))
        if pts:
            pts.append((x(steps - 1), pts[-1][1]))
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
        w(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2" '
          'stroke-linejoin="round" opacity="0.9"/>')
    # Dots offset a little per policy, so that OOMs at the same step and size stay visible.
    for i, (pol, _, colour) in enumerate(POLICIES):
        dx = (i - 1.5) * 3.0
        for s, v in ooms[pol]:
            w(f'<circle cx="{x(s) + dx:.1f}" cy="{y(v):.1f}" r="2.6" fill="{colour}" '
              'stroke="white" stroke-width="0.6"/>')
    w('</g>')
    w(f'<rect x="{LEFT}" y="{top}" width="{pw}" height="{h}" fill="none" stroke="#333"/>')
    w(f'<text x="{LEFT + pw - 6}" y="{yl - 6:.1f}" text-anchor="end" fill="#555">'
      f'L = {limit} (largest that fits)</text>')


def single(runs, args):
    ok = {p[0]: {} for p in POLICIES}
    ooms = {p[0]: [] for p in POLICIES}
    steps = 0
    for pol, _, _ in POLICIES:
        r = runs.get(("bare", args.L, args.start, pol))
        if r is None:
            continue
        ok[pol] = r["ok"]
        ooms[pol] = r["oom"]
        steps = max([steps] + [s + 1 for s in r["ok"]] + [s + 1 for s, _ in r["oom"]])
    if steps == 0:
        sys.exit(f"no bare rows for L={args.L} start={args.start} in {args.csv}")

    sizes = [s for d in ok.values() for s in d.values()] + [s for v in ooms.values() for _, s in v]
    pw = WIDTH - LEFT - RIGHT
    out = []
    w = out.append
    w(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
      f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="12">')
    w(f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>')
    w(f'<text x="{LEFT + pw / 2}" y="24" text-anchor="middle" font-size="15" font-weight="bold">'
      f'Micro-batch size per step: the controller alone, L = {args.L}, start {args.start}</text>')

    def x(step):
        return LEFT + pw * step / max(1, steps - 1)

    # Top panel: everything, log2 scale. Bottom panel: the steady state, linear.
    lo = 2 ** math.floor(math.log2(min(sizes + [args.L]) * 0.8))
    hi = 2 ** math.ceil(math.log2(max(sizes + [args.L])))
    top_h = 250
    zoom_top = TOP + top_h + 62
    zoom_h = HEIGHT - BOTTOM - zoom_top

    def ylog(size, top=TOP, h=top_h):
        t = (math.log2(size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return top + h * (1 - t)

    z_lo = int(args.L * 0.8)
    z_hi = int(math.ceil(args.L * 1.05))

    def ylin(size, top=zoom_top, h=zoom_h):
        return top + h * (1 - (size - z_lo) / (z_hi - z_lo))

    ticks_log = []
    p = lo
    while p <= hi:
        ticks_log.append(p)
        p *= 2
    step_z = max(1, round((z_hi - z_lo) / 5 / 10) * 10) if z_hi - z_lo > 60 else max(1, (z_hi - z_lo) // 5)
    ticks_lin = list(range((z_lo + step_z - 1) // step_z * step_z, z_hi + 1, step_z))

    panel(w, "all steps (log scale)", TOP, top_h, ylog, ticks_log, x, steps, pw, args.L, ok, ooms,
          "clip-top")
    panel(w, f"steady state (linear, {z_lo} to {z_hi})", zoom_top, zoom_h, ylin, ticks_lin, x, steps,
          pw, args.L, ok, ooms, "clip-zoom")
    w(f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 14}" text-anchor="middle" font-size="13">'
      'optimizer step</text>')
    w(f'<text transform="translate(20 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" '
      'text-anchor="middle" font-size="13">micro-batch size</text>')

    # Legend, in the top panel's empty upper right.
    lx, ly = LEFT + pw - 270, TOP + 16
    w(f'<rect x="{lx - 10}" y="{ly - 12}" width="270" height="{18 * (len(POLICIES) + 1) + 8}" '
      'fill="white" fill-opacity="0.92" stroke="#ccc"/>')
    for i, (pol, label, colour) in enumerate(POLICIES):
        yy = ly + 18 * i
        n = len(ooms[pol])
        w(f'<line x1="{lx}" y1="{yy}" x2="{lx + 24}" y2="{yy}" stroke="{colour}" stroke-width="2.5"/>')
        w(f'<text x="{lx + 32}" y="{yy + 4}">{escape(label)} ({n} OOM{"s" if n != 1 else ""})</text>')
    yy = ly + 18 * len(POLICIES)
    w(f'<circle cx="{lx + 12}" cy="{yy}" r="2.6" fill="#666"/>')
    w(f'<text x="{lx + 32}" y="{yy + 4}">OOM at that size</text>')
    w("</svg>")
    with open(args.svg, "w") as f:
        f.write("\n".join(out) + "\n")


def panels(runs, path):
    """The guard end to end: one L per column, cold start and capacity drop as rows."""
    limits = sorted({key[1] for key in runs if key[0] == "cold"})
    rows = [("cold", 4096, "cold start"), ("drop", 4096, "30% taken at step 150")]
    if not limits:
        sys.exit("no guard end-to-end rows (scenario cold) in the CSV")
    pw, ph = 230, 190
    gap_x, gap_y = 22, 64
    left, top = 64, 76
    width = left + len(limits) * (pw + gap_x) + 8
    height = top + len(rows) * (ph + gap_y) + 40
    y_hi = 1.25
    out = []
    w = out.append
    w(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
      f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">')
    w(f'<rect width="{width}" height="{height}" fill="white"/>')
    w(f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">'
      'Micro-batch size per step through Guard::Step, relative to the largest balanced split that fits</text>')
    # Legend across the top.
    lx = left
    for pol, label, colour in POLICIES:
        w(f'<line x1="{lx}" y1="44" x2="{lx + 22}" y2="44" stroke="{colour}" stroke-width="2.5"/>')
        w(f'<text x="{lx + 28}" y="48">{escape(label)}</text>')
        lx += 28 + 7 * len(label) + 24
    w(f'<circle cx="{lx + 6}" cy="44" r="2.6" fill="#666"/><text x="{lx + 14}" y="48">OOM</text>')
    for ri, (scenario, start, row_title) in enumerate(rows):
        for ci, L in enumerate(limits):
            px = left + ci * (pw + gap_x)
            py = top + ri * (ph + gap_y)
            steps = 1
            for pol, _, _ in POLICIES:
                r = runs.get((scenario, L, start, pol))
                if r:
                    steps = max([steps] + [s + 1 for s in r["ok"]])

            def x(step, px=px, steps=steps):
                return px + pw * step / max(1, steps - 1)

            def y(ratio, py=py):
                return py + ph * (1 - min(ratio, y_hi) / y_hi)

            counts = []
            for pol, _, _ in POLICIES:
                r = runs.get((scenario, L, start, pol))
                counts.append(len(r["oom"]) if r else 0)
            w(f'<text x="{px}" y="{py - 8}" fill="#222">L = {L}, {escape(row_title)}</text>')
            for v in (0, 0.25, 0.5, 0.75, 1.0, 1.25):
                yy = y(v)
                w(f'<line x1="{px}" y1="{yy:.1f}" x2="{px + pw}" y2="{yy:.1f}" stroke="#eee"/>')
                if ci == 0:
                    w(f'<text x="{px - 6}" y="{yy + 4:.1f}" text-anchor="end">{v:g}</text>')
            for s in range(0, steps, 100):
                w(f'<text x="{x(s):.1f}" y="{py + ph + 14}" text-anchor="middle">{s}</text>')
            clip = f"clip-{scenario}-{L}"
            w(f'<clipPath id="{clip}"><rect x="{px}" y="{py - 3}" width="{pw}" height="{ph + 6}"/></clipPath>')
            w(f'<g clip-path="url(#{clip})">')
            w(f'<line x1="{px}" y1="{y(1):.1f}" x2="{px + pw}" y2="{y(1):.1f}" stroke="#555" '
              'stroke-dasharray="5 4"/>')
            # The predictive policy last, on top of the others.
            for i, (pol, _, colour) in reversed(list(enumerate(POLICIES))):
                r = runs.get((scenario, L, start, pol))
                if not r:
                    continue
                pts = []
                for s in sorted(r["ok"]):
                    yy = y(r["ok"][s] / r["oracle"].get(s, 1))
                    if pts and abs(yy - pts[-1][1]) < 0.05:
                        continue  # a step line needs a point only where it moves
                    if pts:
                        pts.append((x(s), pts[-1][1]))
                    pts.append((x(s), yy))
                if pts:
                    pts.append((x(steps - 1), pts[-1][1]))
                coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
                w(f'<polyline points="{coords}" fill="none" stroke="{colour}" '
                  f'stroke-width="{2.4 if pol == "predictive" else 1.6}" stroke-linejoin="round" opacity="0.9"/>')
                for s, v in r["oom"]:
                    ratio = v / r["oracle"].get(s, r["oracle"].get(s - 1, 1) if r["oracle"] else 1)
                    w(f'<circle cx="{x(s) + (i - 1.5) * 2.5:.1f}" cy="{y(ratio):.1f}" r="2.3" fill="{colour}" '
                      'stroke="white" stroke-width="0.5"/>')
            w('</g>')
            w(f'<rect x="{px}" y="{py}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
            summary = "  ".join(f"{n}" for n in counts)
            w(f'<text x="{px + pw - 4}" y="{py + ph - 6}" text-anchor="end" fill="#555">OOMs: {summary}</text>')
    w(f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle" font-size="12">'
      'optimizer step (OOM counts in the legend\'s order; sizes above 1.25 drawn at the top edge)</text>')
    w("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("svg")
    ap.add_argument("--L", type=int, default=300)
    ap.add_argument("--start", type=int, default=4096)
    ap.add_argument("--panels", default="")
    args = ap.parse_args()
    runs = read(args.csv)
    single(runs, args)
    if args.panels:
        panels(runs, args.panels)


if __name__ == "__main__":
    main()
