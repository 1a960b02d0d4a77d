#!/usr/bin/env bash
# The GPU checks of oomguard, in one script (docs/gpu.md).
#
#   tests/gpu/run.sh            # from the repository root
#   PYTHON=/path/to/python3 OOMGUARD_GPU_BUILD=/tmp/og-gpu tests/gpu/run.sh
#
# On a Linux machine with an NVIDIA GPU, the CUDA toolkit and PyTorch, it
# builds oomguard with CUDA (and NCCL when installed) in its own build
# directory and runs:
#   1. CudaDevice gtests: real cudaMalloc exhaustion caught as DeviceOomError
#      and recovered (sdk/memory/cuda_device_test.cc);
#   2. examples/cpp/libtorch_train on CUDA under a caching-allocator memory
#      fraction: real CUDA OOMs recovered, final float64 parameters equal to
#      an unconstrained run's within 1e-10;
#   3. examples/python/train_torch.py's model through oomguard.torch on CUDA
#      with the device filled for real, the same promise; and fit_mlp.py's
#      through oomguard.torch.fit(), with checkpoints and guarded evaluation
#      (tests/gpu/fit_cuda.py);
#   4. checkpoint staging from device memory: the CheckpointerCuda gtests
#      (pinned staging on a side stream, restore from snapshot and disk) and
#      libtorch_train on CUDA with --ckpt-dir, resumed to equal parameters;
#   5. the NCCL coordinator with one rank (tests/gpu/nccl_one_rank.cc);
#   6. with two GPUs: guarded DDP (overlap and today's mode) and FSDP2 over
#      plain, over NCCL (bench/parallel_bench.py --backend nccl; the overlap
#      mode's target is 1.02).
# It prints a summary table and exits non-zero when any check FAILs. SKIP
# (a missing optional piece, with the reason) and NOT IMPLEMENTED do not fail.
# Without a GPU (nvidia-smi missing or failing, or cudaGetDeviceCount failing)
# it says so and exits 0 without building or running anything.
#
#   tests/gpu/run.sh --bundle DIR
# runs instead on a machine without oomguard's build dependencies, from a
# bundle made elsewhere by tests/gpu/bundle.sh (tests/gpu/run_bundle.sh).
set -uo pipefail

if [ "${1:-}" = "--bundle" ]; then
  shift
  exec "$(dirname "${BASH_SOURCE[0]}")/run_bundle.sh" "$@"
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${OOMGUARD_GPU_BUILD:-$ROOT/build-gpu}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
JOBS=${OOMGUARD_GPU_JOBS:-$(nproc)}
START=$SECONDS
LOG=$BUILD/gpu-logs

# ---- is there a GPU at all? ----
if ! command -v nvidia-smi > /dev/null 2>&1; then
  echo "tests/gpu/run.sh: no GPU: nvidia-smi not found. Nothing was run."
  exit 0
fi
if ! SMI=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) || [ -z "$SMI" ]; then
  echo "tests/gpu/run.sh: no GPU: nvidia-smi failed: ${SMI:-no output}. Nothing was run."
  exit 0
fi
if [ ! -f "$CUDA_HOME/include/cuda_runtime_api.h" ]; then
  echo "tests/gpu/run.sh: a GPU is present ($SMI) but no CUDA toolkit at $CUDA_HOME (set CUDA_HOME)." >&2
  exit 1
fi
# The CUDA runtime's own view (a driver/runtime mismatch shows up here, not in
# nvidia-smi), probed in a scratch directory so that nothing is left behind.
PROBE=$(mktemp -d)
trap 'rm -rf "$PROBE"' EXIT
cat > "$PROBE/count.c" <<'EOF'
#include <cuda_runtime_api.h>
#include <stdio.h>
int main(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) { printf("cudaGetDeviceCount: %s\n", cudaGetErrorString(e)); return 1; }
  if (n == 0) { printf("cudaGetDeviceCount: 0 devices\n"); return 1; }
  printf("%d\n", n);
  return 0;
}
EOF
CUDA_LIB=$CUDA_HOME/lib64
[ -d "$CUDA_LIB" ] || CUDA_LIB=$CUDA_HOME/lib
if ! cc -o "$PROBE/count" "$PROBE/count.c" -I"$CUDA_HOME/include" -L"$CUDA_LIB" -Wl,-rpath,"$CUDA_LIB" -lcudart \
    > "$PROBE/count.build" 2>&1; then
  echo "tests/gpu/run.sh: cannot build a cudaGetDeviceCount probe against $CUDA_HOME:" >&2
  cat "$PROBE/count.build" >&2
  exit 1
fi
if ! NGPU=$("$PROBE/count" 2>&1); then
  echo "tests/gpu/run.sh: no GPU usable by the CUDA runtime ($NGPU). Nothing was run."
  exit 0
fi
echo "GPU: $SMI ($NGPU visible to the CUDA runtime)"
mkdir -p "$LOG"

# ---- the summary table ----
ROWS=()
FAILED=0
row() {  # row STATUS CHECK DETAIL
  ROWS+=("$1|$2|$3")
  [ "$1" = FAIL ] && FAILED=1
  printf '  %-15s %s: %s\n' "$1" "$2" "$3"
}
summary() {
  echo
  echo "oomguard GPU checks ($SMI, $((SECONDS - START)) s)"
  printf '%-16s| %-44s| %s\n' "status" "check" "detail"
  printf '%s\n' "----------------+---------------------------------------------+------------------------------"
  for r in "${ROWS[@]}"; do
    IFS='|' read -r s c d <<< "$r"
    printf '%-16s| %-44s| %s\n' "$s" "$c" "$d"
  done
  [ $FAILED -eq 0 ] && echo "result: no failures" || echo "result: FAILED"
}
# json FILE EXPR: evaluate a Python expression over `d`, the file's last JSON line.
json() {
  "$PY" -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(eval(sys.argv[2]))' "$1" "$2" 2>/dev/null
}

# ---- PyTorch with CUDA: which interpreter, and is its libtorch linkable? ----
PY=""
for cand in ${PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$cand" > /dev/null 2>&1 && "$cand" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null; then
    PY=$(command -v "$cand"); break
  fi
done
TORCH_ARGS=(-DOOMGUARD_WITH_TORCH=OFF)
TORCH_WHY=""
if [ -z "$PY" ]; then
  PY=${PYTHON:-python3}
  TORCH_WHY="no Python with a CUDA-enabled torch (set PYTHON)"
else
  read -r TV TCUDA TPREFIX TABI < <("$PY" -c 'import torch,os; print(torch.__version__, torch.version.cuda, os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))')
  echo "PyTorch $TV (CUDA $TCUDA) at $TPREFIX, $PY"
  if [ "$TABI" != 1 ]; then
    # oomguard and its system dependencies (spdlog, fmt) use the C++11 ABI.
    TORCH_WHY="torch $TV uses the pre-C++11 ABI; libtorch cannot be linked with oomguard"
  else
    TORCH_ARGS=(-DOOMGUARD_WITH_TORCH=ON "-DTorch_DIR=$TPREFIX/share/cmake/Torch"
                "-DC10_INCLUDE_DIR=$TPREFIX/include" "-DC10_LIBRARY=$TPREFIX/lib/libc10.so")
  fi
fi
NCCL_ARGS=(-DOOMGUARD_WITH_NCCL=OFF)
if [ -f "$CUDA_HOME/include/nccl.h" ] || [ -f /usr/include/nccl.h ]; then NCCL_ARGS=(-DOOMGUARD_WITH_NCCL=ON); fi

# ---- build (its own directory; only the targets the checks need) ----
echo "building in $BUILD (log: $LOG/build.log) ..."
if ! timeout 330 cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DOOMGUARD_WITH_CUDA=ON \
      "-DCUDAToolkit_ROOT=$CUDA_HOME" "${NCCL_ARGS[@]}" "${TORCH_ARGS[@]}" "-DPython_EXECUTABLE=$PY" \
      -DOOMGUARD_BUILD_BENCH=OFF > "$LOG/configure.log" 2>&1; then
  row FAIL "configure with CUDA" "see $LOG/configure.log"; tail -n 30 "$LOG/configure.log"; summary; exit 1
fi
TARGETS=(oomguard_unit_tests)
grep -q "OOMGUARD_BUILD_LIBTORCH_EXAMPLE=ON" "$LOG/configure.log" && TARGETS+=(libtorch_train)
grep -q "OOMGUARD_BUILD_PYTHON=ON" "$LOG/configure.log" && TARGETS+=(oomguard_python)
grep -q "OOMGUARD_WITH_NCCL=ON" "$LOG/configure.log" && TARGETS+=(nccl_one_rank)
if ! timeout 330 cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" > "$LOG/build.log" 2>&1; then
  row FAIL "build (${TARGETS[*]})" "see $LOG/build.log"; grep -m 20 -E "error|Error" "$LOG/build.log"; summary; exit 1
fi
row PASS "build with CUDA" "$(grep -o 'OOMGUARD_WITH_CUDA=ON ([^)]*)' "$LOG/configure.log" | head -1)"
BIN=$BUILD/bin
export OOMGUARD_LOG_LEVEL=warn

# ---- 1. CudaDevice: real cudaMalloc exhaustion ----
timeout 120 "$BIN/oomguard_unit_tests" --gtest_filter='CudaDeviceGpuTest.*' > "$LOG/cuda_device.log" 2>&1; rc=$?
passed=$(grep -c '^\[       OK \] CudaDeviceGpuTest' "$LOG/cuda_device.log")
skipped=$(grep -c '^\[  SKIPPED \] CudaDeviceGpuTest' "$LOG/cuda_device.log")
if [ $rc -eq 0 ] && [ "$passed" -ge 1 ] && [ "$skipped" -eq 0 ] \
    && grep -q 'OK \] CudaDeviceGpuTest.ExhaustionThrowsDeviceOomErrorAndRecovers' "$LOG/cuda_device.log"; then
  row PASS "CudaDevice: cudaMalloc exhaustion recovered" "$passed gtests passed"
else
  row FAIL "CudaDevice: cudaMalloc exhaustion recovered" "rc $rc, $passed passed, $skipped skipped ($LOG/cuda_device.log)"
fi

# ---- 2. libtorch_train on CUDA under a memory fraction ----
LT=(--device cuda --steps 10 --global-batch 4096 --hidden 2048 --seed 3 --json)
if [ ! -x "$BIN/libtorch_train" ]; then
  if [ -n "$TORCH_WHY" ]; then
    row SKIP "libtorch_train on CUDA" "$TORCH_WHY"
  else
    row FAIL "libtorch_train on CUDA" "not built: $(grep -o 'OOMGUARD_BUILD_LIBTORCH_EXAMPLE=OFF.*' "$LOG/configure.log")"
  fi
else
  timeout 120 "$BIN/libtorch_train" "${LT[@]}" --dump-params "$LOG/lt_ref.f64" > "$LOG/lt_ref.out" 2> "$LOG/lt_ref.err"
  rc=$?
  if [ $rc -ne 0 ]; then
    row FAIL "libtorch_train on CUDA" "unconstrained run exit $rc ($LOG/lt_ref.err)"
  else
    # Parameters, gradients and Adam state take ~130 MiB, the whole batch's
    # activations ~400 MiB: try budgets until one forces OOMs yet fits the model.
    verdict="no budget produced a recovered OOM"
    status=FAIL
    for mib in 384 288 224 512 768; do
      timeout 120 "$BIN/libtorch_train" "${LT[@]}" --budget-mib "$mib" --check-against "$LOG/lt_ref.f64" \
        > "$LOG/lt_$mib.out" 2> "$LOG/lt_$mib.err"
      rc=$?
      if [ $rc -eq 3 ]; then
        status=FAIL; verdict="budget $mib MiB: parameters DIFFER (max rel $(json "$LOG/lt_$mib.out" 'd["max_rel_diff"]'))"
        break
      fi
      [ $rc -eq 0 ] || continue  # the model alone did not fit: try the next budget
      ooms=$(json "$LOG/lt_$mib.out" 'd["ooms"]')
      if [ "${ooms:-0}" -ge 1 ]; then
        status=PASS
        verdict="budget $mib MiB: $ooms CUDA OOMs, micro-batch 4096 -> $(json "$LOG/lt_$mib.out" 'd["final_micro_batch"]'), max rel diff $(json "$LOG/lt_$mib.out" 'd["max_rel_diff"]')"
        break
      fi
    done
    row "$status" "libtorch_train on CUDA: OOMs, equal params" "$verdict"
  fi

  # ---- 4. checkpoint staging from device memory ----
  timeout 120 "$BIN/oomguard_unit_tests" --gtest_filter='CheckpointerCuda.*' > "$LOG/ckpt_cuda.log" 2>&1
  if grep -q 'OK \] CheckpointerCuda.RoundTripThroughSnapshotAndDisk' "$LOG/ckpt_cuda.log"; then
    row PASS "Checkpointer: CUDA tensor round trip" "pinned staging, snapshot and disk restore"
  else
    row FAIL "Checkpointer: CUDA tensor round trip" "($LOG/ckpt_cuda.log)"
  fi
  timeout 120 "$BIN/libtorch_train" "${LT[@]}" --steps 4 --ckpt-dir "$LOG/ck" --ckpt-every 2 \
    > "$LOG/lt_ck.out" 2> "$LOG/lt_ck.err"
  rc=$?
  if [ $rc -eq 0 ]; then
    timeout 120 "$BIN/libtorch_train" "${LT[@]}" --ckpt-dir "$LOG/ck" --ckpt-every 2 --resume \
      --check-against "$LOG/lt_ref.f64" > "$LOG/lt_resume.out" 2> "$LOG/lt_resume.err"
    rc=$?
    if [ $rc -eq 0 ]; then
      row PASS "checkpoint from device memory + resume" "resumed from step $(json "$LOG/lt_resume.out" 'd["resumed_from_step"]'), params equal"
    else
      row FAIL "checkpoint from device memory + resume" "resume exit $rc ($LOG/lt_resume.err)"
    fi
  else
    row FAIL "checkpoint staging from device memory" "exit $rc ($LOG/lt_ck.err)"
  fi
fi
[ -x "$BIN/libtorch_train" ] || row SKIP "checkpoint from device memory + resume" "libtorch_train not built"

# ---- 3. train_torch.py's model on CUDA through oomguard.torch ----
if [ -n "$TORCH_WHY" ]; then
  row SKIP "train_torch.py model on CUDA (oomguard.torch)" "$TORCH_WHY"
elif [ ! -d "$BUILD/python/oomguard" ]; then
  row FAIL "train_torch.py model on CUDA (oomguard.torch)" "the Python package was not built (see $LOG/configure.log)"
else
  verdict="no headroom produced a recovered OOM"
  status=FAIL
  for mib in 160 96 256; do
    PYTHONPATH=$BUILD/python timeout 180 "$PY" "$ROOT/tests/gpu/train_torch_cuda.py" --headroom-mib "$mib" \
      > "$LOG/py_$mib.out" 2> "$LOG/py_$mib.err"
    rc=$?
    [ $rc -eq 0 ] || { verdict="exit $rc ($LOG/py_$mib.err)"; continue; }
    ooms=$(json "$LOG/py_$mib.out" 'd["tight"]["ooms"]')
    rel=$(json "$LOG/py_$mib.out" 'd["max_rel_diff"]')
    if [ "$(json "$LOG/py_$mib.out" 'd["max_rel_diff"] <= 1e-10')" != True ]; then
      status=FAIL; verdict="headroom $mib MiB: parameters DIFFER (max rel $rel)"; break
    fi
    if [ "${ooms:-0}" -ge 1 ] && [ "$(json "$LOG/py_$mib.out" 'd["clean"]["ooms"]')" = 0 ]; then
      status=PASS
      verdict="headroom $mib MiB: $ooms CUDA OOMs, micro-batch -> $(json "$LOG/py_$mib.out" 'd["tight"]["final_micro_batch"]'), max rel diff $rel"
      break
    fi
  done
  row "$status" "train_torch.py model on CUDA: OOMs, equal params" "$verdict"
fi

# ---- 3b. the same promise through oomguard.torch.fit(): checkpoints and guarded evaluation on CUDA ----
if [ -n "$TORCH_WHY" ]; then
  row SKIP "fit() on CUDA: OOMs, equal params" "$TORCH_WHY"
elif [ ! -d "$BUILD/python/oomguard" ]; then
  row FAIL "fit() on CUDA: OOMs, equal params" "the Python package was not built (see $LOG/configure.log)"
else
  PYTHONPATH=$BUILD/python timeout 240 "$PY" "$ROOT/tests/gpu/fit_cuda.py" > "$LOG/fit.out" 2> "$LOG/fit.err"
  rc=$?
  if [ $rc -eq 0 ]; then
    row PASS "fit() on CUDA: OOMs, equal params" "$(json "$LOG/fit.out" '"%d CUDA OOMs with %s MiB left, micro-batch %d -> %d, checkpoint at step %d, max rel diff %.1e" % (d["tight"]["ooms"], d["tight"]["headroom_mib"], d["global_batch"], d["tight"]["final_micro_batch"], d["tight"]["checkpoint_step"], d["max_rel_diff"])')"
  else
    row FAIL "fit() on CUDA: OOMs, equal params" "exit $rc ($LOG/fit.err): $(tail -n 1 "$LOG/fit.err")"
  fi
fi

# ---- 5. the NCCL coordinator with one rank ----
if [ -x "$BIN/nccl_one_rank" ]; then
  timeout 120 "$BIN/nccl_one_rank" > "$LOG/nccl.log" 2>&1; rc=$?
  case $rc in
    0) row PASS "NCCL coordinator, one rank" "$(grep -c '^ok' "$LOG/nccl.log") checks" ;;
    77) row FAIL "NCCL coordinator, one rank" "skipped although a GPU is visible: $(head -1 "$LOG/nccl.log")" ;;
    *) row FAIL "NCCL coordinator, one rank" "exit $rc: $(grep -m 1 FAIL "$LOG/nccl.log")" ;;
  esac
else
  row SKIP "NCCL coordinator, one rank" "NCCL not installed (no nccl.h under $CUDA_HOME/include or /usr/include)"
fi

# ---- 6. what guarding DDP (overlap mode, today's mode) and FSDP2 costs over NCCL (issue 29: overlap <= 1.02) ----
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ -n "$TORCH_WHY" ]; then
  row SKIP "DDP/FSDP2 guarded over plain, NCCL" "$TORCH_WHY"
elif [ "${NGPU:-0}" -lt 2 ]; then
  row SKIP "DDP/FSDP2 guarded over plain, NCCL" "needs 2 GPUs (NCCL runs one rank per GPU), found ${NGPU:-0}"
else
  PYTHONPATH=$BUILD/python timeout 600 "$PY" "$ROOT/bench/parallel_bench.py" --backend nccl --json --width 4096 \
    --layers 8 --batch 512 --bucket-mb 25 --rounds 12 > "$LOG/parallel_nccl.out" 2> "$LOG/parallel_nccl.err"
  rc=$?
  if [ $rc -ne 0 ]; then
    row FAIL "DDP/FSDP2 guarded over plain, NCCL" "exit $rc ($LOG/parallel_nccl.err): $(tail -n 1 "$LOG/parallel_nccl.err")"
  else
    ratios=$(json "$LOG/parallel_nccl.out" '"overlap %.3f, today %.3f, fsdp (check agreement) %.3f" % (d["ddp_overlap_ratio"], d["ddp_today_ratio"], d["fsdp_ratio"])')
    if [ "$(json "$LOG/parallel_nccl.out" 'd["ddp_overlap_ratio"] <= 1.02')" = True ]; then
      row PASS "DDP/FSDP2 guarded over plain, NCCL" "$ratios"
    else
      row FAIL "DDP/FSDP2 guarded over plain, NCCL" "$ratios: overlap above 1.02"
    fi
  fi
fi

summary
exit $FAILED
