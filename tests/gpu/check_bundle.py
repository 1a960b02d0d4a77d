#!/usr/bin/env python3
"""Checks a device bundle (tests/gpu/bundle.sh): it fits the size limit, and
every ELF file in it finds each library it needs either in the bundle's lib/
or in the GPU image's own set — read from the files' dynamic sections
(readelf), not from this machine's loader, so that a library this machine
happens to have cannot hide a missing one.

    check_bundle.py DIR [--limit-mib 60]

Then, as a second opinion from the loader itself, each ELF file is resolved by
ldd with only DIR/lib (and the CUDA toolkit's runtime, standing in for the
image's) on the library path: every library outside the image's set must come
from DIR/lib, and none may be missing.

Prints the bundle's size and every problem; exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

# What the GPU image provides (tests/gpu/bundle.sh says why each is there).
IMAGE_SET = re.compile(r"^(ld-linux-x86-64\.so\.2|lib(c|m|dl|pthread|rt|resolv)\.so\.\d+|libstdc\+\+\.so\.6|"
                       r"libgcc_s\.so\.1|libcuda\.so\.1|libcudart\.so\.13|libnccl\.so\.2)$")


def is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def needed(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def loader_problems(bundle: str, path: str) -> list[str]:
    """What ldd says `path` loads from outside the bundle that the image would not provide."""
    lib = os.path.realpath(os.path.join(bundle, "lib"))
    env = {"PATH": "/usr/bin:/bin",
           "LD_LIBRARY_PATH": ":".join([lib, "/usr/local/cuda/lib64", "/usr/local/cuda/lib"])}
    run = subprocess.run(["ldd", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out, rel = [], os.path.relpath(path, bundle)
    for line in run.stdout.splitlines():
        m = re.match(r"\s*(\S+) => (.+?)(?: \(0x[0-9a-f]+\))?$", line)
        if not m:
            continue
        name, where = m.group(1), m.group(2).strip()
        if where == "not found":
            if not IMAGE_SET.match(name):
                out.append(f"{rel}: the loader finds no {name}")
            continue
        if IMAGE_SET.match(name):
            continue
        if not os.path.realpath(where).startswith(lib + os.sep):
            out.append(f"{rel}: the loader takes {name} from {where}, outside the bundle")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--limit-mib", type=float, default=60)
    a = ap.parse_args()
    lib = os.path.join(a.dir, "lib")
    have = set(os.listdir(lib)) if os.path.isdir(lib) else set()
    total, problems, elves = 0, [], 0
    for root, _, files in os.walk(a.dir):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            total += os.path.getsize(path)
            if not is_elf(path):
                continue
            elves += 1
            for dep in needed(path):
                if dep in have or IMAGE_SET.match(dep):
                    continue
                problems.append(f"{os.path.relpath(path, a.dir)} needs {dep}: neither in lib/ nor in the image")
            problems.extend(loader_problems(a.dir, path))
    mib = total / (1 << 20)
    print(f"bundle {a.dir}: {mib:.1f} MiB, {elves} ELF files, limit {a.limit_mib:.0f} MiB")
    if mib > a.limit_mib:
        problems.append(f"{mib:.1f} MiB is over the {a.limit_mib:.0f} MiB limit")
    if elves == 0:
        problems.append("no ELF file at all: the bundle is empty")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
