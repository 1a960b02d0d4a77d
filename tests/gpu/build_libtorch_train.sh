#!/usr/bin/env bash
# shellcheck disable=SC2054  # the commas in -Wl,... are the linker's, not array separators
# Builds examples/cpp/libtorch_train on the machine that runs it, from a device
# bundle (tests/gpu/bundle.sh) and this tree, against PYTHON's own torch (its
# headers and libraries: on the GPU image, torch 2.11 from pip with CUDA).
#
#   tests/gpu/build_libtorch_train.sh BUNDLE OUT PYTHON
#
# Writes OUT/libtorch_train (rpath: BUNDLE/lib and torch's lib/). Six
# translation units, compiled side by side with the machine's compiler (CXX,
# a launcher such as ccache first if wanted): the example, its MLP helpers,
# and the sources of liboomguard_torch (sdk/torch: the budgeted CPU
# allocator, TrainStep and the state helpers; sdk/memory/torch_oom.cc, the
# c10 OOM translator). Those are compiled in rather than carried as the
# bundle's liboomguard_torch.so: a library built here would be linked to this
# machine's libtorch, while compiled there they see the types of the very
# torch the example runs with; the translator's static initialiser registers
# it through the bundle's liboomguard (RegisterOomTranslator), the same
# registry the guard asks. With CUDA (-DOOMGUARD_EXAMPLE_TORCH_CUDA) when that torch has
# libc10_cuda. Exits non-zero, with the compiler's output, when it does not build.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
usage="usage: build_libtorch_train.sh BUNDLE OUT PYTHON"
BUNDLE=${1:?$usage}
OUT=${2:?$usage}
PY=${3:?$usage}
die() { echo "build_libtorch_train: $*" >&2; exit 1; }
read -ra CXX <<< "${CXX:-c++}"  # a launcher may come first: CXX="ccache c++"

read -r TV TPREFIX TABI < <("$PY" -c 'import os, torch; print(torch.__version__, os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2> /dev/null) ||
  die "$PY has no torch"
[[ $TABI == 1 ]] || die "torch $TV uses the pre-C++11 ABI; oomguard's bundle uses the C++11 one"
[[ -f $TPREFIX/include/torch/csrc/api/include/torch/torch.h ]] || die "torch $TV at $TPREFIX ships no C++ headers"
[[ -f $BUNDLE/include/CLI/CLI.hpp ]] || die "$BUNDLE has no CLI11 headers (include/CLI)"

defs=(-D_GLIBCXX_USE_CXX11_ABI=1)
libs=(-Wl,--no-as-needed -ltorch -Wl,--as-needed -ltorch_cpu -lc10)
incs=()
if [[ -f $TPREFIX/lib/libc10_cuda.so ]]; then
  # The CUDA headers c10/cuda includes: from the nvidia wheels beside torch, else a toolkit.
  cuda_h=$("$PY" - 2> /dev/null <<'PY' || true
import glob, os, site
found = [h for d in site.getsitepackages() for h in sorted(glob.glob(f"{d}/nvidia/*/include/cuda_runtime_api.h"))]
found.append("/usr/local/cuda/include/cuda_runtime_api.h")
print(next(h for h in found if os.path.exists(h)) if any(os.path.exists(h) for h in found) else "")
PY
)
  [[ -n $cuda_h ]] || die "torch $TV has CUDA but no cuda_runtime_api.h was found (nvidia wheels or /usr/local/cuda)"
  defs+=(-DOOMGUARD_EXAMPLE_TORCH_CUDA=1)
  incs+=(-isystem "$(dirname "$cuda_h")")
  libs=(-Wl,--no-as-needed -ltorch -ltorch_cuda -Wl,--as-needed -ltorch_cpu -lc10_cuda -lc10)
fi
mkdir -p "$OUT"
FLAGS=(-std=c++20 -O2 "${defs[@]}" -I"$ROOT/include" -I"$BUNDLE/include" -I"$ROOT/examples/cpp" -I"$ROOT"
       -isystem "$TPREFIX/include" -isystem "$TPREFIX/include/torch/csrc/api/include" "${incs[@]}")
source "$ROOT/tests/gpu/compile_units.sh"
compile_units "$OUT" "$ROOT/examples/cpp/libtorch_train.cpp" "$ROOT/examples/cpp/mlp.cc" \
  "$ROOT/sdk/torch/torch_budget.cc" "$ROOT/sdk/torch/state.cc" "$ROOT/sdk/torch/train_step.cc" \
  "$ROOT/sdk/memory/torch_oom.cc" ||
  die "libtorch_train does not compile against torch $TV (above)"
"${CXX[@]}" -o "$OUT/libtorch_train" "${OBJS[@]}" -L"$BUNDLE/lib" -loomguard -L"$TPREFIX/lib" "${libs[@]}" \
  -Wl,-rpath,"$BUNDLE/lib:$TPREFIX/lib"
rm -f "${OBJS[@]}"
echo "build_libtorch_train: $OUT/libtorch_train (torch $TV at $TPREFIX$([[ ${#incs[@]} -gt 0 ]] && echo ", CUDA"))"
