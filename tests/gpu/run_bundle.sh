#!/usr/bin/env bash
# The device run: oomguard's GPU checks on a machine that has a GPU, PyTorch
# and the CUDA 13 runtime but none of oomguard's build dependencies, using a
# bundle prepared elsewhere by tests/gpu/bundle.sh (docs/gpu.md).
#
#   tests/gpu/run.sh --bundle DIR          # from the repository root
#   PYTHON=/opt/torch/.venv/bin/python3 OUT=/tmp/out tests/gpu/run.sh --bundle DIR
#
# Checks, each one PASS, FAIL or SKIP (with the reason) line:
#   - the bundle's programs find every library they need here;
#   - a real cudaMalloc OOM in a guarded step, with the device nearly full,
#     recovered with the exact result (gpu_checks guard-oom);
#   - the Python package built here from the bundle and this machine's
#     Python, pybind11 and torch (build_python.sh), then real torch CUDA OOMs
#     with the device filled for real: TrainStep recovers and its float64
#     parameters equal an unconstrained run's within 1e-10
#     (train_torch_cuda.py); and oomguard.torch.fit() does the same with
#     checkpoints and guarded evaluation on the device (fit_cuda.py);
#   - checkpoint staging of >= 4 GiB of CUDA tensors against one plain
#     cudaMemcpy device -> pinned host of the same bytes (target <= 1.2x), with
#     a round trip through memory and disk (gpu_checks staging);
#   - the NCCL coordinator with one rank, including a deadline that fires
#     (nccl_one_rank);
#   - libtorch_train on CUDA, compiled here against this Python's torch
#     (build_libtorch_train.sh): real CUDA OOMs under a memory fraction, equal
#     parameters. SKIP when it does not compile against this torch (the
#     reason is printed).
# Ends with "N passed, N failed, N skipped"; exits 1 when any check failed.
# Writes $OUT/gpu-run.log (everything printed) and $OUT/gpu-results.md (a
# section for bench/RESULTS.md); detailed logs go to $OUT/gpu-logs. Without
# $OUT, into ./gpu-out. Without a GPU it says so and exits 0.
# Every step has a timeout, and the whole run stops starting new checks after
# OOMGUARD_GPU_BUDGET_S seconds (default 420), so it fits one 8-minute call.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUNDLE=${1:?usage: tests/gpu/run.sh --bundle DIR}
BUNDLE=$(cd "$BUNDLE" 2> /dev/null && pwd) || { echo "run.sh --bundle: no directory $1" >&2; exit 2; }
[ -x "$BUNDLE/bin/gpu_checks" ] || { echo "run.sh --bundle: $BUNDLE is not a bundle (no bin/gpu_checks; make one with tests/gpu/bundle.sh)" >&2; exit 2; }
RESULTS=${OUT:-$PWD/gpu-out}
mkdir -p "$RESULTS/gpu-logs"
LOG=$RESULTS/gpu-logs
WORK=$(mktemp -d /tmp/oomguard-gpu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
exec > >(tee "$RESULTS/gpu-run.log") 2>&1
TEE=$!
finish() {  # finish RC: close the log (tee flushes) and exit
  exec 1>&- 2>&-
  wait "$TEE" 2> /dev/null
  exit "$1"
}
BUDGET_S=${OOMGUARD_GPU_BUDGET_S:-420}
START=$SECONDS
PY=${PYTHON:-python3}

# ---- is there a GPU at all? ----
if ! command -v nvidia-smi > /dev/null 2>&1; then
  echo "tests/gpu/run.sh --bundle: no GPU: nvidia-smi not found. Nothing was run."
  finish 0
fi
if ! SMI=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) || [ -z "$SMI" ]; then
  echo "tests/gpu/run.sh --bundle: no GPU: nvidia-smi failed: ${SMI:-no output}. Nothing was run."
  finish 0
fi
SMI=$(head -1 <<< "$SMI")
echo "GPU: $SMI"
echo "bundle: $(head -2 "$BUNDLE/BUNDLE.txt" | tr '\n' ' ')"

# ---- the CUDA runtime and NCCL the image has: the pip wheels, or a toolkit ----
find_lib() {  # find_lib NAME: the directory holding NAME, wheels first
  local roots=() d
  mapfile -t roots < <("$PY" -c 'import site, sys; print("\n".join(site.getsitepackages()))' 2> /dev/null)
  for d in "${roots[@]}"; do
    [ -d "$d/nvidia" ] || continue
    d=$(find "$d/nvidia" -maxdepth 4 -name "$1" -print -quit 2> /dev/null)
    [ -n "$d" ] && { dirname "$d"; return 0; }
  done
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/$1" ] && { echo "$d"; return 0; }
  done
  return 1
}
CUDART_DIR=$(find_lib 'libcudart.so.13') || CUDART_DIR=""
NCCL_DIR=$(find_lib 'libnccl.so.2') || NCCL_DIR=""
echo "CUDA runtime: ${CUDART_DIR:-not found}; NCCL: ${NCCL_DIR:-not found}"
LIBPATH=$BUNDLE/lib
for d in "$CUDART_DIR" "$NCCL_DIR"; do [ -n "$d" ] && LIBPATH=$LIBPATH:$d; done
export LD_LIBRARY_PATH=$LIBPATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OOMGUARD_LOG_LEVEL=warn

PASSED=0 FAILED=0 SKIPPED=0
ROWS=()
row() {  # row STATUS CHECK DETAIL
  case $1 in PASS) PASSED=$((PASSED + 1)) ;; FAIL) FAILED=$((FAILED + 1)) ;; *) SKIPPED=$((SKIPPED + 1)) ;; esac
  ROWS+=("$1|$2|$3")
  printf '%s  %s: %s\n' "$1" "$2" "$3"
}
left() {  # seconds a step may take: its own limit, or what is left of the budget
  local rest=$((BUDGET_S - (SECONDS - START)))
  [ "$rest" -lt "$1" ] && echo $((rest > 5 ? rest : 5)) || echo "$1"
}
out_of_time() { [ $((SECONDS - START)) -ge "$BUDGET_S" ]; }
# field FILE EXPR: a Python expression over `d`, the last JSON line of FILE.
field() {
  "$PY" - "$1" "$2" 2> /dev/null <<'EOF'
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")]
d = json.loads(lines[-1])
print(eval(sys.argv[2]))
EOF
}

# ---- the builds that happen here, in the background while the C++ checks run ----
HAVE_TORCH=0
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null; then
  HAVE_TORCH=1
  read -r TV TPREFIX < <("$PY" -c 'import torch, os; print(torch.__version__, os.path.dirname(torch.__file__))')
  echo "PyTorch $TV at $TPREFIX ($PY)"
  timeout "$(left 240)" "$ROOT/tests/gpu/build_python.sh" "$BUNDLE" "$WORK/py" "$PY" > "$LOG/build_python.log" 2>&1 &
  PY_BUILD=$!
  timeout "$(left 300)" "$ROOT/tests/gpu/build_libtorch_train.sh" "$BUNDLE" "$WORK" "$PY" \
    > "$LOG/build_libtorch_train.log" 2>&1 &
  LT_BUILD=$!
else
  echo "no Python with a CUDA-enabled torch at '$PY' (set PYTHON)"
fi

# ---- 1. the bundle loads here ----
missing=$(ldd "$BUNDLE/bin/gpu_checks" "$BUNDLE"/bin/nccl_one_rank 2> /dev/null | grep 'not found' | sort -u | tr -s ' \t\n' ' ')
if [ -z "$missing" ]; then
  row PASS "bundle libraries resolve" "$(ls "$BUNDLE/lib" | wc -l) libraries in the bundle, runtime from ${CUDART_DIR:-?}"
else
  row FAIL "bundle libraries resolve" "missing:$missing"
fi

# ---- 2. a real cudaMalloc OOM in a guarded step ----
timeout "$(left 120)" "$BUNDLE/bin/gpu_checks" guard-oom > "$LOG/guard_oom.out" 2>&1; rc=$?
G_OOMS=$(field "$LOG/guard_oom.out" 'd["ooms"]')
G_MS=$(field "$LOG/guard_oom.out" 'd["step_ms"]')
if [ $rc -eq 0 ]; then
  row PASS "guard: real cudaMalloc OOM recovered" "$G_OOMS OOMs, micro-batch -> $(field "$LOG/guard_oom.out" 'd["final_micro_batch"]'), exact result, step $G_MS ms"
else
  row FAIL "guard: real cudaMalloc OOM recovered" "exit $rc: $(tail -c 300 "$LOG/guard_oom.out")"
fi

# ---- 3. the NCCL coordinator with one rank ----
if [ ! -x "$BUNDLE/bin/nccl_one_rank" ]; then
  row SKIP "NCCL coordinator, one rank" "the bundle was built without NCCL"
elif [ -z "$NCCL_DIR" ]; then
  row FAIL "NCCL coordinator, one rank" "no libnccl.so.2 on this machine"
else
  timeout "$(left 120)" "$BUNDLE/bin/nccl_one_rank" > "$LOG/nccl.log" 2>&1; rc=$?
  case $rc in
    0) row PASS "NCCL coordinator, one rank" "$(grep -c '^ok' "$LOG/nccl.log") checks, deadline included" ;;
    *) row FAIL "NCCL coordinator, one rank" "exit $rc: $(grep -m 2 -E 'FAIL|SKIP' "$LOG/nccl.log" | tr '\n' ' ')" ;;
  esac
fi

# ---- 4. checkpoint staging of >= 4 GiB of CUDA tensors against cudaMemcpy ----
if out_of_time; then
  row FAIL "checkpoint staging, 4 GiB" "not run: the run's time budget ($BUDGET_S s) was spent"
else
  mkdir -p "$WORK/ckpt"
  timeout "$(left 180)" "$BUNDLE/bin/gpu_checks" staging --gib 4 --dir "$WORK/ckpt" > "$LOG/staging.out" 2>&1; rc=$?
  S_RATIO=$(field "$LOG/staging.out" 'd["ratio"]')
  S_STALL=$(field "$LOG/staging.out" 'd["stall_ms"]')
  S_BASE=$(field "$LOG/staging.out" 'd["memcpy_ms"]')
  S_GIB=$(field "$LOG/staging.out" 'd["gib"]')
  detail="$S_GIB GiB: staging $S_STALL ms vs cudaMemcpy $S_BASE ms, ratio $S_RATIO (target <= 1.2); round trip memory $(field "$LOG/staging.out" 'd["restore_from_memory"]'), disk $(field "$LOG/staging.out" 'd["load_from_disk"]')"
  [ $rc -eq 0 ] && row PASS "checkpoint staging, 4 GiB" "$detail" || row FAIL "checkpoint staging, 4 GiB" "exit $rc; $detail $(tail -c 200 "$LOG/staging.out")"
  rm -rf "$WORK/ckpt"
fi

# ---- 5. a real torch CUDA OOM, the device filled for real, through TrainStep ----
P_OOMS=""
PY_WHY=""  # why the Python checks cannot run ("": they can)
if [ $HAVE_TORCH -eq 0 ]; then
  PY_WHY="no Python with a CUDA-enabled torch (set PYTHON)"
elif ! wait "$PY_BUILD"; then
  PY_WHY="the Python package did not build here: $(grep -m 3 -E 'error|Error|build_python:' "$LOG/build_python.log" | tr '\n' ' ')"
fi
if [ -n "$PY_WHY" ]; then
  row FAIL "TrainStep: real torch CUDA OOM, equal params" "$PY_WHY"
else
  verdict="no headroom produced a recovered OOM"
  status=FAIL
  for mib in 160 96 320; do
    out_of_time && { verdict="$verdict; the run's time budget was spent"; break; }
    PYTHONPATH=$WORK/py timeout "$(left 150)" "$PY" "$ROOT/tests/gpu/train_torch_cuda.py" --headroom-mib "$mib" \
      > "$LOG/py_$mib.out" 2> "$LOG/py_$mib.err"
    rc=$?
    [ $rc -eq 0 ] || { verdict="headroom $mib MiB: exit $rc: $(tail -c 300 "$LOG/py_$mib.err")"; continue; }
    rel=$(field "$LOG/py_$mib.out" 'd["max_rel_diff"]')
    if [ "$(field "$LOG/py_$mib.out" 'd["max_rel_diff"] <= 1e-10')" != True ]; then
      status=FAIL; verdict="headroom $mib MiB: parameters DIFFER (max rel $rel)"; break
    fi
    P_OOMS=$(field "$LOG/py_$mib.out" 'd["tight"]["ooms"]')
    if [ "${P_OOMS:-0}" -ge 1 ] && [ "$(field "$LOG/py_$mib.out" 'd["clean"]["ooms"]')" = 0 ]; then
      status=PASS
      verdict="device filled with $(field "$LOG/py_$mib.out" 'd["tight"]["filled_gib"]') GiB, $mib MiB left: $P_OOMS CUDA OOMs, micro-batch -> $(field "$LOG/py_$mib.out" 'd["tight"]["final_micro_batch"]'), max rel diff $rel, $(field "$LOG/py_$mib.out" 'd["tight"]["wall_s"]') s"
      break
    fi
    verdict="headroom $mib MiB: no OOM ($P_OOMS)"
  done
  row "$status" "TrainStep: real torch CUDA OOM, equal params" "$verdict"
  if [ $status = PASS ]; then
    f=$LOG/py_$mib.out
    if [ "$(field "$f" '(lambda m: m["reserved"] > 0 and m["num_ooms"] >= 1 and m["total"] > 0)(d["tight"]["incident_memory"])')" = True ]; then
      row PASS "incident carries torch.cuda.memory_stats" "$(field "$f" '(lambda m: "reserved %.1f GiB, allocated %.1f GiB, inactive split %.0f MiB, alloc retries %d, num_ooms %d" % (m["reserved"] / 2**30, m["allocated"] / 2**30, m["inactive_split"] / 2**20, m["num_alloc_retries"], m["num_ooms"]))(d["tight"]["incident_memory"])')"
    else
      row FAIL "incident carries torch.cuda.memory_stats" "$(field "$f" 'd["tight"]["incident_memory"]')"
    fi
  fi
fi

# ---- 6. the same promise through oomguard.torch.fit(): checkpoints and guarded evaluation on the device ----
# fit_cuda.py judges (its exit status); it tries headroom shares in turn itself.
if [ -n "$PY_WHY" ]; then
  row FAIL "fit(): real torch CUDA OOM, equal params" "$PY_WHY"
elif out_of_time; then
  row FAIL "fit(): real torch CUDA OOM, equal params" "not run: the run's time budget ($BUDGET_S s) was spent"
else
  PYTHONPATH=$WORK/py timeout "$(left 240)" "$PY" "$ROOT/tests/gpu/fit_cuda.py" > "$LOG/fit.out" 2> "$LOG/fit.err"
  rc=$?
  if [ $rc -eq 0 ]; then
    row PASS "fit(): real torch CUDA OOM, equal params" "$(field "$LOG/fit.out" '"device filled with %s GiB, %s MiB left (%s of the %s MiB its steps needed): %d CUDA OOMs (%d in evaluation), %d rollbacks, micro-batch %d -> %d, checkpoint at step %d, max rel diff params %.1e, losses %.1e, evals %.1e; %s s" % (d["tight"]["filled_gib"], d["tight"]["headroom_mib"], d["headroom_share"], d["clean"]["need_mib"], d["tight"]["ooms"], d["tight"]["eval_ooms"], d["tight"]["rollbacks"], d["global_batch"], d["tight"]["final_micro_batch"], d["tight"]["checkpoint_step"], d["max_rel_diff"], d["losses_max_rel_diff"], d["evals_max_rel_diff"], d["tight"]["wall_s"])')"
  else
    row FAIL "fit(): real torch CUDA OOM, equal params" "exit $rc: $(tail -c 400 "$LOG/fit.err")"
  fi
fi

# ---- 7. libtorch_train on CUDA, built here against this torch ----
if [ $HAVE_TORCH -eq 0 ]; then
  row SKIP "libtorch_train on CUDA" "no Python with a CUDA-enabled torch"
elif ! wait "$LT_BUILD" || [ ! -x "$WORK/libtorch_train" ]; then
  row SKIP "libtorch_train on CUDA" "does not compile against torch $TV: $(grep -m 2 -E 'error|build_libtorch_train:' "$LOG/build_libtorch_train.log" | cut -c1-240 | tr '\n' ' ')"
elif out_of_time; then
  row FAIL "libtorch_train on CUDA" "not run: the run's time budget ($BUDGET_S s) was spent"
else
  LT=(--device cuda --steps 10 --global-batch 4096 --hidden 2048 --seed 3 --json)
  timeout "$(left 120)" "$WORK/libtorch_train" "${LT[@]}" --dump-params "$WORK/lt_ref.f64" > "$LOG/lt_ref.out" 2> "$LOG/lt_ref.err"
  rc=$?
  if [ $rc -ne 0 ]; then
    row FAIL "libtorch_train on CUDA" "unconstrained run exit $rc: $(tail -c 300 "$LOG/lt_ref.err")"
  else
    verdict="no budget produced a recovered OOM"
    status=FAIL
    for mib in 384 288 512; do
      out_of_time && break
      timeout "$(left 120)" "$WORK/libtorch_train" "${LT[@]}" --budget-mib "$mib" --check-against "$WORK/lt_ref.f64" \
        > "$LOG/lt_$mib.out" 2> "$LOG/lt_$mib.err"
      rc=$?
      if [ $rc -eq 3 ]; then verdict="budget $mib MiB: parameters DIFFER"; break; fi
      [ $rc -eq 0 ] || continue
      ooms=$(field "$LOG/lt_$mib.out" 'd["ooms"]')
      if [ "${ooms:-0}" -ge 1 ]; then
        status=PASS
        verdict="torch $TV, budget $mib MiB: $ooms CUDA OOMs, micro-batch 4096 -> $(field "$LOG/lt_$mib.out" 'd["final_micro_batch"]'), max rel diff $(field "$LOG/lt_$mib.out" 'd["max_rel_diff"]')"
        break
      fi
    done
    row "$status" "libtorch_train on CUDA" "$verdict"
  fi
fi

# ---- the summary and the markdown section ----
echo
echo "$PASSED passed, $FAILED failed, $SKIPPED skipped ($((SECONDS - START)) s, $SMI)"
{
  echo "## On a GPU (device run)"
  echo
  echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') by \`tests/gpu/run.sh --bundle\` on $SMI"
  echo "($(nproc) CPU cores${TV:+, PyTorch $TV}), bundle from $(sed -n 2p "$BUNDLE/BUNDLE.txt")."
  echo
  echo "| check | result | figures |"
  echo "|---|---|---|"
  for r in "${ROWS[@]}"; do
    IFS='|' read -r s c d <<< "$r"
    echo "| $c | $s | ${d//|//} |"
  done
  echo
  echo "$PASSED passed, $FAILED failed, $SKIPPED skipped, in $((SECONDS - START)) s."
} > "$RESULTS/gpu-results.md"
echo "results: $RESULTS/gpu-run.log, $RESULTS/gpu-results.md"
[ $FAILED -eq 0 ] && finish 0 || finish 1
