#!/usr/bin/python3
"""Draws bench/controller.svg from controller_bench's CSV (standard library only).

Usage: plot_controller.py CSV SVG [--L 300] [--start 4096]

x: optimizer step; y: micro-batch size, in two panels: every step on a log2
scale, and the steady state on a linear scale around L. One step-shaped line
per policy (the size each step completed at), OOMs as small dots at the size
that failed, and a dashed line at L, the largest size that fits.
"""
import argparse
import csv
import math
import sys
from xml.sax.saxutils import escape

POLICIES = [  # (name in the CSV, legend label, colour)
    ("oomguard", "oomguard SizeController", "#1f77b4"),
    ("halving", "halving only", "#d62728"),
    ("accel_x0.9", "Accelerate \u00d70.9 rule", "#2ca02c"),
]
WIDTH, HEIGHT = 820, 640
LEFT, RIGHT, TOP, BOTTOM = 78, 24, 48, 58


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
    for pol, _, colour in POLICIES:
        pts = []
        for s in sorted(ok[pol]):
            if pts:
                pts.append((x(s), pts[-1][1]))
            pts.append((x(s), y(ok[pol][s])))
        if pts:
            pts.append((x(steps - 1), pts[-1][1]))
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
        w(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2" '
          'stroke-linejoin="round" opacity="0.9"/>')
    # Dots offset a little per policy, so that OOMs at the same step and size stay visible.
    for i, (pol, _, colour) in enumerate(POLICIES):
        dx = (i - 1) * 3.5
        for s, v in ooms[pol]:
            w(f'<circle cx="{x(s) + dx:.1f}" cy="{y(v):.1f}" r="2.6" fill="{colour}" '
              'stroke="white" stroke-width="0.6"/>')
    w('</g>')
    w(f'<rect x="{LEFT}" y="{top}" width="{pw}" height="{h}" fill="none" stroke="#333"/>')
    w(f'<text x="{LEFT + pw - 6}" y="{yl - 6:.1f}" text-anchor="end" fill="#555">'
      f'L = {limit} (largest that fits)</text>')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("svg")
    ap.add_argument("--L", type=int, default=300)
    ap.add_argument("--start", type=int, default=4096)
    args = ap.parse_args()

    ok = {p[0]: {} for p in POLICIES}
    ooms = {p[0]: [] for p in POLICIES}
    steps = 0
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            if int(row["L"]) != args.L or int(row["start"]) != args.start:
                continue
            pol = row["policy"]
            if pol not in ok:
                continue
            step, size = int(row["step"]), int(row["size"])
            steps = max(steps, step + 1)
            if row["event"] == "oom":
                ooms[pol].append((step, size))
            else:
                ok[pol][step] = size
    if steps == 0:
        sys.exit(f"no rows for L={args.L} start={args.start} in {args.csv}")

    sizes = [s for d in ok.values() for s in d.values()] + [s for v in ooms.values() for _, s in v]
    pw = WIDTH - LEFT - RIGHT
    out = []
    w = out.append
    w(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
      f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="12">')
    w(f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>')
    w(f'<text x="{LEFT + pw / 2}" y="24" text-anchor="middle" font-size="15" font-weight="bold">'
      f'Micro-batch size per step: hidden limit L = {args.L}, start {args.start}</text>')

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
    lx, ly = LEFT + pw - 250, TOP + 16
    w(f'<rect x="{lx - 10}" y="{ly - 12}" width="250" height="{18 * (len(POLICIES) + 1) + 8}" '
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


if __name__ == "__main__":
    main()
