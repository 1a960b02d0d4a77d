#!/usr/bin/env bash
# Builds the oomguard Python package on the machine that runs it, from a device
# bundle (tests/gpu/bundle.sh) and this tree: the GPU image's Python (3.12,
# torch 2.11 from pip) cannot import an extension built elsewhere for another
# Python, so the module is compiled there with the image's own compiler and
# pip's pybind11, against the bundle's liboomguard.
#
#   tests/gpu/build_python.sh BUNDLE OUT PYTHON
#
# PYTHON: the interpreter that will import the package (here scripts/python,
# on the device the image's python3); it must have pybind11 (pip) and the
# Python headers. OUT/oomguard becomes importable (PYTHONPATH=OUT,
# LD_LIBRARY_PATH=BUNDLE/lib), with every Python file of the package, its
# sub-packages (oomguard.torch) included. The budgeted CPU allocator
# (oomguard._budget) is built against PYTHON's own torch (its c10 headers and
# libc10) when that torch ships them and uses the C++11 ABI; it is optional
# (the CUDA checks do not use it), so a failure there is reported, not fatal.
# Prints what it built; exits non-zero, naming what is missing, when the main
# module does not build or import.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
usage="usage: build_python.sh BUNDLE OUT PYTHON"
BUNDLE=${1:?$usage}
OUT=${2:?$usage}
PY=${3:?$usage}
read -ra CXX <<< "${CXX:-c++}"  # a launcher may come first: CXX="ccache c++"
SRC=$ROOT/bindings/python/src
PKG=$OUT/oomguard
die() { echo "build_python: $*" >&2; exit 1; }

command -v "$PY" > /dev/null 2>&1 || die "no interpreter '$PY'"
# pybind11 from pip (the image has no system pybind11, nor has this machine since torch 2).
PYBIND_INC=$("$PY" -c 'import pybind11; print(pybind11.get_include())' 2> /dev/null) ||
  die "$PY has no pybind11 (pip install pybind11)"
read -r PY_INC SUFFIX < <("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX"))')
[[ -f $PY_INC/Python.h ]] || die "no Python.h in $PY_INC (the headers of $PY's Python: a -dev package or a Python built with them)"
mkdir -p "$PKG"

FLAGS=(-std=c++20 -O2 -fPIC -fvisibility=hidden -I"$ROOT/include" -I"$SRC" -isystem "$PY_INC" -isystem "$PYBIND_INC")
source "$ROOT/tests/gpu/compile_units.sh"

# Every translation unit of the module (those in src/ less the torch
# allocator's), then one link.
units=()
for src in "$SRC"/*.cc; do
  case $(basename "$src") in budget_allocator*) ;; *) units+=("$src") ;; esac
done
compile_units "$OUT" "${units[@]}" || die "a translation unit of oomguard._oomguard failed (above)"
"${CXX[@]}" -shared -o "$PKG/_oomguard$SUFFIX" "${OBJS[@]}" -L"$BUNDLE/lib" -loomguard -Wl,-rpath,"$BUNDLE/lib"
rm -f "${OBJS[@]}"
echo "build_python: $PKG/_oomguard$SUFFIX (pybind11 $("$PY" -c 'import pybind11; print(pybind11.__version__)'))"

# The package's Python files, sub-packages included (no caches).
(cd "$ROOT/bindings/python" &&
  find oomguard -type f \( -name '*.py' -o -name '*.pyi' -o -name py.typed \) -not -path '*/__pycache__/*' -print0) |
  while IFS= read -r -d '' f; do
    mkdir -p "$OUT/$(dirname "$f")"
    cp "$ROOT/bindings/python/$f" "$OUT/$f"
  done

# oomguard._budget, against the torch this Python imports: its own c10
# headers and libc10, so that the allocator it installs is that torch's; and
# the bundle's liboomguard (its caching-device mode is a SimulatedDevice).
read -r TINC TLIB TABI TV < <("$PY" -c '
import os, torch
d = os.path.dirname(torch.__file__)
print(os.path.join(d, "include"), os.path.join(d, "lib"), int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.__version__)
' 2> /dev/null || echo "- - - -")
if [[ $TV == - ]]; then
  echo "build_python: oomguard._budget not built ($PY has no torch)"
elif [[ ! -f $TINC/c10/core/Allocator.h || ! -f $TLIB/libc10.so ]]; then
  echo "build_python: oomguard._budget not built (torch $TV ships no c10 headers and libc10.so under $(dirname "$TINC"))"
elif [[ $TABI != 1 ]]; then
  echo "build_python: oomguard._budget not built (torch $TV uses the pre-C++11 ABI)"
else
  FLAGS+=(-I"$ROOT" -isystem "$TINC")
  if compile_units "$OUT" "$SRC/budget_allocator.cc" "$ROOT/sdk/torch/torch_budget.cc" &&
      "${CXX[@]}" -shared -o "$PKG/_budget$SUFFIX" "${OBJS[@]}" -L"$TLIB" -lc10 -Wl,-rpath,"$TLIB" \
        -L"$BUNDLE/lib" -loomguard -Wl,-rpath,"$BUNDLE/lib"; then
    echo "build_python: $PKG/_budget$SUFFIX (torch $TV at $(dirname "$TINC"))"
  else
    echo "build_python: oomguard._budget not built (it does not build against torch $TV: above)"
  fi
  rm -f "${OBJS[@]}"
fi

# The package imports, and a _budget that was built imports too: a symbol
# left undefined is an error here, not a silent "budget False" on the device.
LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$OUT "$PY" - "$PKG/_budget$SUFFIX" <<'PY' ||
import os, sys
import oomguard, oomguard.budget
print("build_python: import oomguard", oomguard.__version__, "on Python", sys.version.split()[0],
      "budget", oomguard.budget.available())
if os.path.exists(sys.argv[1]) and not oomguard.budget.available():
    import oomguard._budget  # raises the loader's own error
PY
  die "the package built from the bundle does not import (above)"
