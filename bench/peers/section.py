#!/usr/bin/env python3
"""Puts bench/peers/RESULTS.md into bench/RESULTS.md as its peers section
(between the markers below, replaced on every run; appended the first time),
so that bench/run.sh, which writes bench/RESULTS.md anew, keeps the last peers
run too.

    section.py bench/peers/RESULTS.md bench/RESULTS.md"""

from __future__ import annotations

import sys

BEGIN, END = "<!-- bench/peers: begin -->", "<!-- bench/peers: end -->"


def main(argv) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    peers = open(argv[1]).read().splitlines()
    # one level down: "# title" -> "## title (issue 24)"; the figure is beside it in bench/peers/
    body = ["## oomguard against the real peers (issue 24)"]
    for line in peers[1:]:
        if line.startswith("#"):
            line = "#" + line
        body.append(line.replace("](peers.svg)", "](peers/peers.svg)"))
    section = "\n".join([BEGIN] + body + [END])
    results = open(argv[2]).read()
    if BEGIN in results and END in results:
        head, rest = results.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        results = head + section + tail
    else:
        results = results.rstrip("\n") + "\n\n" + section + "\n"
    with open(argv[2], "w") as f:
        f.write(results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
