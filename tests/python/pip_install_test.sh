#!/usr/bin/env bash
# `pip install .` as a user runs it: into a fresh virtual environment that
# has torch and nothing else, with pip's default build isolation (it fetches
# scikit-build-core and pybind11 from PyPI), compiling against the torch of
# that environment. Then, away from the sources, a guarded step under a real
# torch OOM (oomguard.budget, built against that torch) must equal the same
# step without a budget.
#
#   pip_install_test.sh PYTHON SOURCE_DIR
#
# PYTHON is the project's interpreter (scripts/python): the fresh
# environment uses the same base interpreter, and its torch is that
# environment's torch, linked rather than copied (4.7 GB of CUDA wheels): a
# .pth file puts a directory on the path that holds links to torch and to
# what torch needs, and nothing else. A compiler cache (ccache), when present,
# serves the build, as it would a user's.
set -euo pipefail
PYTHON=$1
SOURCE_DIR=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/oomguard-pip.XXXXXX")
trap 'rm -rf "$work"' EXIT

base=$("$PYTHON" -c 'import sys; print(sys._base_executable)')
"$base" -m venv "$work/venv"
venv_site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# torch and its dependency closure, as links in one directory.
"$PYTHON" - "$work/torch-only" "$venv_site/torch-only.pth" <<'PY'
import importlib.metadata as md
import os
import pathlib
import re
import sys

target, pth = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
target.mkdir()
todo, seen = ["torch"], set()
while todo:
    name = re.split(r"[ ;<>=!~\[]", todo.pop())[0].lower().replace("_", "-")
    if name in seen:
        continue
    seen.add(name)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue  # a dependency for another platform
    for req in dist.requires or []:
        if "extra ==" not in req:
            todo.append(req)
    # Top-level packages, modules and the .dist-info (scripts under ../bin are not needed).
    tops = {f.parts[0] for f in dist.files or [] if f.parts[0] != ".." and not f.parts[0].endswith(".pth")}
    root = pathlib.Path(dist.locate_file(""))
    for top in tops:
        src, dst = root / top, target / top
        if src.exists() and not dst.exists():
            os.symlink(src, dst)
pth.write_text(str(target) + "\n")
print(f"torch-only environment: {len(seen)} distributions", file=sys.stderr)
PY

"$work/venv/bin/python" -c 'import torch, importlib.util as u; assert u.find_spec("numpy") is None and u.find_spec("oomguard") is None, "not a torch-only environment"; print("fresh venv with torch", torch.__version__)'

if command -v ccache >/dev/null 2>&1; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
started=$SECONDS
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$SOURCE_DIR"
echo "pip install . took $((SECONDS - started)) s"

# Away from the build tree and the sources.
cd "$work"
PYTHONPATH= "$work/venv/bin/python" - <<'PY'
import pathlib
import subprocess

import torch

import oomguard
import oomguard.budget
import oomguard.torch as ogt

where = pathlib.Path(oomguard.__file__).resolve()
assert "site-packages" in where.parts, f"imported {where}, not the installed package"
assert (where.parent / "py.typed").exists(), "py.typed is missing"
assert oomguard.budget.available(), "oomguard._budget was not built against the installed torch"
native = next(where.parent.glob("_oomguard*.so"))
assert "libc10" not in subprocess.run(["ldd", str(native)], capture_output=True, text=True).stdout, \
    "the extension must not link libtorch (it would break on a torch upgrade)"

def train(budget):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).double()
    step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 16, generator=g, dtype=torch.float64), torch.randn(512, 1, generator=g, dtype=torch.float64)
    if budget:
        oomguard.budget.install(budget)
    try:
        for _ in range(3):
            step(x, y)
    finally:
        if budget:
            oomguard.budget.uninstall()
    return ogt.flat_parameters(model), step.guard.total_ooms

whole, none = train(0)
# 512 samples' activations (2 x 1 MiB) do not fit in 1.5 MiB; a quarter of them do.
split, ooms = train(3 << 19)
assert none == 0 and ooms >= 1, (none, ooms)
rel = float((whole - split).abs().max() / whole.abs().max())
assert rel <= 1e-10, rel
print(f"installed oomguard {oomguard.__version__} at {where.parent}: torch {torch.__version__}, "
      f"{ooms} real torch OOM(s) recovered, parameters within {rel:.1e} of the unconstrained run")
PY
