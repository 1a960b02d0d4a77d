#!/usr/bin/env bash
# `pip install --no-build-isolation bindings/python` into a fresh venv made
# with --system-site-packages (no package index is reachable: setuptools, torch
# and numpy come from Debian), then import the installed package.
#
#   pip_install_test.sh PYTHON SOURCE_DIR BUILD_DIR
#
# The modules already built in BUILD_DIR are packaged (OOMGUARD_PREBUILT_DIR),
# so the test does not compile the core a second time; set
# OOMGUARD_PIP_FROM_SOURCE=1 to let setup.py run CMake itself. The package
# source is copied first, so pip's in-tree build/ and egg-info stay out of
# the repository and parallel runs do not collide.
set -euo pipefail
PYTHON=$1
SOURCE_DIR=$2
BUILD_DIR=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cp -r "$SOURCE_DIR/bindings/python" "$work/src"
"$PYTHON" -m venv --system-site-packages "$work/venv"
export OOMGUARD_SOURCE_DIR=$SOURCE_DIR
if [[ "${OOMGUARD_PIP_FROM_SOURCE:-0}" != 1 ]]; then
  export OOMGUARD_PREBUILT_DIR=$BUILD_DIR
fi
"$work/venv/bin/python" -m pip install --no-build-isolation --no-index --quiet "$work/src"

# Import from the venv, away from the build tree and the sources.
cd "$work"
PYTHONPATH= "$work/venv/bin/python" - <<'PY'
import pathlib, sys
import oomguard
where = pathlib.Path(oomguard.__file__).resolve()
assert "site-packages" in where.parts, f"imported {where}, not the installed package"
assert (where.parent / "py.typed").exists(), "py.typed is missing"
guard = oomguard.Guard(initial_micro_batch=4)
sizes = []
def micro(mb):
    sizes.append(mb.size)
    if mb.size > 2:
        raise MemoryError("too big")
report = guard.step(8, micro, reset=lambda: None)
assert report.status.ok and report.ooms == 1 and sizes == [4, 2, 2, 2, 2], (report, sizes)
import oomguard.torch  # torch from Debian, through --system-site-packages
print("installed oomguard", oomguard.__version__, "at", where.parent, "budget:", __import__("oomguard.budget").budget.available())
PY
