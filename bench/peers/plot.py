#!/usr/bin/env python3
"""bench/peers' figure, an SVG written directly (no plotting library in the
project's environment), from peers.py's JSON:

    plot.py RESULTS.json OUT.svg

One row per system of the one-process table, four panels: OOMs until stable;
the final (micro-)batch against the oracle (the largest that fits, a tick);
CPU milliseconds per sample once stable; the max relative difference of the
final parameters from the unconstrained run (log scale, 1e-16..1)."""

from __future__ import annotations

import json
import math
import sys
from html import escape

ROW, TOP, LEFT, PANEL, GAP = 22, 48, 330, 190, 44


def main(argv) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    data = json.load(open(argv[1]))["one_rank"]
    rows = [r for r in data["rows"] if "error" not in r]
    panels = [
        ("OOMs until stable", lambda r: r["ooms"], None, False),
        ("final (micro-)batch | oracle", lambda r: r["final_batch"], lambda r: r["oracle"], False),
        ("CPU ms/sample once stable", lambda r: r["cpu_ms_per_sample_stable"] or 0.0, None, False),
        ("max rel diff of params", lambda r: r["max_rel_diff"], None, True),
    ]
    width = LEFT + len(panels) * (PANEL + GAP) + 10
    height = TOP + ROW * len(rows) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="8" y="18" font-size="13">oomguard against the real peers: {data["steps"]} steps, global batch '
           f'{data["global_batch"]}, budget {data["budget_bytes"]} bytes (one process, CPU, simulated device)</text>']
    for i, r in enumerate(rows):
        y = TOP + i * ROW
        colour = "#1f6fb4" if r["system"].startswith("oomguard") else "#888" if r["system"].startswith(
            ("unconstrained", "plain")) else "#d2691e"
        name = r["system"] if len(r["system"]) <= 52 else r["system"][:50] + "…"
        out.append(f'<text x="{LEFT - 8}" y="{y + 14}" text-anchor="end" fill="{colour}">{escape(name)}</text>')
    for p, (title, value, tick, log) in enumerate(panels):
        x0 = LEFT + p * (PANEL + GAP)
        out.append(f'<text x="{x0}" y="{TOP - 8}" font-weight="bold">{escape(title)}</text>')
        values = [value(r) for r in rows] + ([tick(r) for r in rows] if tick else [])
        top = max(values) if values and max(values) > 0 else 1.0

        def scale(v, top=top, log=log):
            if log:
                lo, hi = -16.0, 0.0
                v = max(v, 1e-16)
                return PANEL * (math.log10(v) - lo) / (hi - lo)
            return PANEL * v / top

        out.append(f'<line x1="{x0}" y1="{TOP}" x2="{x0}" y2="{TOP + ROW * len(rows)}" stroke="#444"/>')
        for i, r in enumerate(rows):
            y = TOP + i * ROW
            v = value(r)
            colour = "#1f6fb4" if r["system"].startswith("oomguard") else "#aaa" if r["system"].startswith(
                ("unconstrained", "plain")) else "#d2691e"
            w = scale(v)
            out.append(f'<rect x="{x0}" y="{y + 4}" width="{w:.1f}" height="{ROW - 8}" fill="{colour}"/>')
            label = f"{v:.0e}" if log else (f"{v:g}" if isinstance(v, int) else f"{v:.2f}")
            if tick:
                t = tick(r)
                out.append(f'<line x1="{x0 + scale(t):.1f}" y1="{y + 1}" x2="{x0 + scale(t):.1f}" y2="{y + ROW - 1}" '
                           f'stroke="black" stroke-width="2"/>')
                label = f"{v} | {t}"
                w = max(w, scale(t))
            out.append(f'<text x="{x0 + w + 4:.1f}" y="{y + 15}">{label}</text>')
        if log:
            for e in (-16, -12, -8, -4, 0):
                x = x0 + scale(10.0 ** e)
                out.append(f'<text x="{x:.1f}" y="{TOP + ROW * len(rows) + 14}" text-anchor="middle" '
                           f'fill="#444">1e{e}</text>')
    out.append(f'<text x="8" y="{height - 8}" fill="#444">blue: oomguard; orange: the peers; grey: the plain loop '
               f'(unconstrained, and accumulating at the oracle). The black tick: the oracle.</text>')
    out.append("</svg>")
    with open(argv[2], "w") as f:
        f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
