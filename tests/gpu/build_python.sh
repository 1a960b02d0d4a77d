#!/usr/bin/env bash
# Builds the oomguard Python package on the machine that runs it, from a device
# bundle (tests/gpu/bundle.sh) and this tree: the GPU image's Python (3.12)
# cannot import an extension built here for Debian's 3.11, so the module is
# compiled there with the image's own compiler and pybind11, against the
# bundle's liboomguard and headers.
#
#   tests/gpu/build_python.sh BUNDLE OUT [PYTHON]
#
# OUT/oomguard becomes importable (PYTHONPATH=OUT, LD_LIBRARY_PATH=BUNDLE/lib).
# The budgeted CPU allocator (oomguard._budget) is built too when PYTHON's
# torch ships its c10 headers and library. Prints what it built; exits non-zero
# when the main module does not build or import.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUNDLE=${1:?usage: build_python.sh BUNDLE OUT [PYTHON]}
OUT=${2:?usage: build_python.sh BUNDLE OUT [PYTHON]}
PY=${3:-python3}
CXX=${CXX:-c++}
SRC=$ROOT/bindings/python/src
PKG=$OUT/oomguard
mkdir -p "$PKG"

# pybind11: the pip package's headers where there is one, else the system's.
PYBIND_INC=$("$PY" -c 'import pybind11; print(pybind11.get_include())' 2> /dev/null || echo /usr/include)
PY_INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
FLAGS=(-std=c++20 -O2 -fPIC -fvisibility=hidden -I"$ROOT/include" -I"$BUNDLE/include" -I"$SRC"
       -isystem "$PY_INC" -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL)
# (a system directory named again with -isystem would break <cstdlib>'s include_next)
[[ $PYBIND_INC == /usr/include ]] || FLAGS+=(-isystem "$PYBIND_INC")
JOBS=$(nproc)

# The module's translation units in parallel, then one link.
objs=()
pids=()
# Every translation unit of the module: those in src/ less the torch allocator's.
for src in "$SRC"/*.cc; do
  f=$(basename "$src" .cc)
  case $f in budget_allocator*) continue ;; esac
  "$CXX" "${FLAGS[@]}" -c "$src" -o "$OUT/$f.o" &
  pids+=($!)
  objs+=("$OUT/$f.o")
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.2; done
done
for p in "${pids[@]}"; do wait "$p" || { echo "build_python: a translation unit failed" >&2; exit 1; }; done
"$CXX" -shared -o "$PKG/_oomguard$SUFFIX" "${objs[@]}" -L"$BUNDLE/lib" -loomguard -Wl,-rpath,"$BUNDLE/lib"
echo "build_python: $PKG/_oomguard$SUFFIX"

# The package's Python files, all of them.
find "$ROOT/bindings/python/oomguard" -maxdepth 1 -type f \( -name '*.py' -o -name '*.pyi' -o -name py.typed \) \
  -exec cp {} "$PKG/" \;

# oomguard._budget, against the torch this Python imports.
read -r TINC TLIB < <("$PY" -c 'import os, torch; d=os.path.dirname(torch.__file__); print(os.path.join(d, "include"), os.path.join(d, "lib"))' 2> /dev/null || echo "- -")
if [[ -f $TINC/c10/core/Allocator.h && -f $TLIB/libc10.so ]]; then
  "$CXX" "${FLAGS[@]}" -shared -I"$ROOT" -isystem "$TINC" -o "$PKG/_budget$SUFFIX" "$SRC/budget_allocator.cc" \
    "$ROOT/sdk/memory/torch_budget_allocator.cc" -L"$TLIB" -lc10 -Wl,-rpath,"$TLIB"
  echo "build_python: $PKG/_budget$SUFFIX (torch at $(dirname "$TINC"))"
else
  echo "build_python: oomguard._budget not built (no c10 headers and libc10.so next to $PY's torch)"
fi

LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$OUT \
  "$PY" -c 'import oomguard, sys; print("build_python: import oomguard", oomguard.__version__, "on Python", sys.version.split()[0])'
