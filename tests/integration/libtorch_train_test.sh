#!/usr/bin/env bash
# libtorch_train on the CPU under the budgeted allocator: real torch OOMs
# (c10::OutOfMemoryError from tensor allocations) are recovered and the final
# float64 parameters equal an unconstrained run's within 1e-10; a run cut in
# two by a checkpoint and --resume ends where the uninterrupted run ends; a
# squeezed step rolls back from memory and ends where the plain libtorch loop
# ends. With libtorch_quickstart too: docs/getting-started.md shows its two
# loops as they are, with their line counts, and they end equal.
#   libtorch_train_test.sh <path to libtorch_train> [<path to libtorch_quickstart>]
set -uo pipefail
BIN=$1 QUICKSTART=${2:-}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
PY=${OOMGUARD_PYTHON:-$SRC/scripts/python}  # the project's interpreter
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OOMGUARD_LOG_LEVEL=error
fails=0
pass=0
check() {  # check NAME COMMAND...
  local name=$1; shift
  if "$@"; then pass=$((pass + 1)); else echo "FAIL: $name"; fails=$((fails + 1)); fi
}
contains() { grep -q -- "$2" "$1"; }
json_field() { "$PY" -c 'import json, sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])[sys.argv[2]])' "$1" "$2"; }
# json_check FILE PYTHON-EXPRESSION...: each expression over `d`, the last line's JSON, must hold.
json_check() {
  local file=$1; shift
  "$PY" - "$file" "$@" <<'PY'
import json, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[-1])
bad = [e for e in sys.argv[2:] if not eval(e, {"d": d})]
if bad:
    print("  JSON:", d)
    print("  does not satisfy:", "; ".join(bad))
    sys.exit(1)
PY
}

# 512 samples through a 32-256-256-1 MLP: an unconstrained step peaks at about
# 6.4 MiB, of which parameters, gradients and Adam's moments are 2.3 MiB. A
# 4 MiB budget fits a quarter of the batch (2 OOMs), not all of it; below
# about 3.5 MiB the optimizer step itself no longer fits.
ARGS=(--global-batch 512 --hidden 256 --seed 3 --json)
BUDGET=(--budget-mib 4)

"$BIN" "${ARGS[@]}" --steps 8 --dump-params "$T/ref.f64" > "$T/ref.out" 2> "$T/ref.err"; rc=$?
check "unconstrained run exits 0" test $rc -eq 0
check "unconstrained run has no OOM" json_check "$T/ref.out" 'd["ooms"] == 0' 'd["final_micro_batch"] == 512'
check "parameters dumped as float64" test "$(stat -c %s "$T/ref.f64" 2>/dev/null || echo 0)" -eq $(( 8 * (32*256 + 256 + 256*256 + 256 + 256 + 1) ))

"$BIN" "${ARGS[@]}" --steps 8 "${BUDGET[@]}" --check-against "$T/ref.f64" > "$T/tight.out" 2> "$T/tight.err"; rc=$?
check "budgeted run exits 0 (3 would be a parameter mismatch)" test $rc -eq 0
check "budgeted run recovers real OOMs and ends equal within 1e-10" json_check "$T/tight.out" \
  'd["ooms"] >= 1' 'd["final_micro_batch"] < 512' 'd["initial_micro_batch"] == 512' \
  'd["max_rel_diff"] is not None and d["max_rel_diff"] <= 1e-10' 'd["cpu_peak_mib"] <= 4' \
  'abs(d["loss_last"] - d["loss_first"]) > 0' \
  'all(k in d for k in ["steps", "global_batch", "initial_micro_batch", "final_micro_batch", "ooms", "loss_first", "loss_last", "wall_s"])'
check "the OOMs are torch's own, classified by type" contains "$T/tight.err" "c10::OutOfMemoryError"
check "the loss of the budgeted run matches" "$PY" - "$T/ref.out" "$T/tight.out" <<'PY'
import json, sys
a, b = (json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:])
assert abs(a["loss_last"] - b["loss_last"]) <= 1e-10 * abs(a["loss_last"]), (a, b)
PY

# Checkpoint + resume, under the budget: 5 steps with checkpoints every 2
# (steps 1 and 3 are saved, and one after the first recovered OOM), then
# --resume to step 8. The result equals the uninterrupted unconstrained run.
"$BIN" "${ARGS[@]}" "${BUDGET[@]}" --steps 5 --ckpt-dir "$T/ck" --ckpt-every 2 > "$T/part1.out" 2> "$T/part1.err"; rc=$?
check "first part with checkpoints exits 0" test $rc -eq 0
check "first part wrote checkpoints" json_check "$T/part1.out" 'd["checkpoints_written"] >= 2'
check "a committed checkpoint of step 3 exists" test -f "$T/ck/step-00000003/MANIFEST.json"
"$BIN" "${ARGS[@]}" --steps 8 "${BUDGET[@]}" --ckpt-dir "$T/ck" --ckpt-every 2 --resume --check-against "$T/ref.f64" \
  > "$T/part2.out" 2> "$T/part2.err"; rc=$?
check "resumed run exits 0" test $rc -eq 0
check "resumed from the newest checkpoint and ends equal" json_check "$T/part2.out" \
  'd["resumed_from_step"] is not None and d["resumed_from_step"] >= 3' \
  'd["max_rel_diff"] is not None and d["max_rel_diff"] <= 1e-10'
check "resume is announced" contains "$T/part2.err" "resumed from the checkpoint of step"

# A rollback from memory (no --ckpt-dir), for each optimizer: the plain
# libtorch loop is the reference. During step 3 a neighbour holds 1 MiB more,
# and the optimizer step (Adam's temporaries) or, for SGD with 2 MiB, even one
# sample no longer fits: the run rolls back and ends where the plain loop ends.
for spec in adamw:1 sgd:2; do
  opt=${spec%:*} squeeze=${spec#*:}
  "$BIN" "${ARGS[@]}" --steps 8 --optimizer "$opt" --plain --dump-params "$T/plain-$opt.f64" > "$T/plain-$opt.out" \
    2> "$T/plain-$opt.err"
  check "$opt: the plain loop runs" test $? -eq 0
  "$BIN" "${ARGS[@]}" --steps 8 --optimizer "$opt" --grow-after 1 "${BUDGET[@]}" --squeeze-mib "$squeeze" \
    --squeeze-step 3 --check-against "$T/plain-$opt.f64" > "$T/squeeze-$opt.out" 2> "$T/squeeze-$opt.err"; rc=$?
  check "$opt: a squeezed step rolls back from memory and ends equal to the plain loop" test $rc -eq 0
  check "$opt: rolled back, nothing written, same learning rate" json_check "$T/squeeze-$opt.out" \
    'd["rollbacks"] >= 1' 'd["checkpoints_written"] == 0' 'd["max_rel_diff"] <= 1e-10' \
    "d[\"lr\"] == $(json_field "$T/plain-$opt.out" lr)"
done

# Failures say what went wrong, with the documented exit codes.
"$BIN" "${ARGS[@]}" --steps 2 --check-against "$T/ref.f64" > "$T/mismatch.out" 2>&1; rc=$?
check "a different run fails --check-against with exit 3" test $rc -eq 3
check "the mismatch is named" contains "$T/mismatch.out" "DIFFERENT"
"$BIN" "${ARGS[@]}" --steps 2 --budget-mib 0.5 > "$T/nofit.out" 2>&1; rc=$?
check "a model that cannot fit exits 1" test $rc -eq 1
check "and says it is out of memory" contains "$T/nofit.out" "out of memory"
"$BIN" --steps 0 > "$T/bad.out" 2>&1; rc=$?
check "bad arguments exit 2" test $rc -eq 2
"$BIN" --resume > "$T/bad2.out" 2>&1; rc=$?
check "--resume without --ckpt-dir exits 2" test $rc -eq 2
check "and names the flag" contains "$T/bad2.out" "--ckpt-dir"

# ---- libtorch_quickstart: the two loops of docs/getting-started.md ----
if [ -n "$QUICKSTART" ]; then
  check "the page shows the quickstart's loops, with their line counts" "$PY" - "$SRC" <<'PY'
import re, sys
root = sys.argv[1]
code = open(f"{root}/examples/cpp/libtorch_quickstart.cpp").read()
page = open(f"{root}/docs/getting-started.md").read()
blocks = re.findall(r"```cpp\n(.*?)```", page, re.S)
for name in ("plain", "guarded"):
    region = code.split(f"// [{name}]\n")[1]
    if region not in blocks:
        sys.exit(f"docs/getting-started.md does not show the {name} loop of libtorch_quickstart.cpp as it is")
    n = sum(1 for line in region.splitlines() if line.strip())
    if f"| {name} | {n} |" not in page:
        sys.exit(f"docs/getting-started.md does not state the {name} loop's {n} lines as '| {name} | {n} |'")
PY
  "$QUICKSTART" > "$T/qs-free.out" 2>&1
  check "quickstart: without a budget the guarded loop equals the plain one" test $? -eq 0
  # 0.45 MiB: the whole batch's activations do not fit beside the model (real
  # c10 OOMs split the step); an OOM injected in step 4's optimizer step
  # rolls back to the state kept in memory.
  OOMGUARD_FAULTS="oom@step=4,site=apply" "$QUICKSTART" --budget-mib 0.45 > "$T/qs-tight.out" 2>&1
  check "quickstart: through real OOMs and a rollback it still equals the plain loop" test $? -eq 0
  check "quickstart: the budget caused real torch OOMs" grep -qE "[1-9][0-9]* torch OOMs" "$T/qs-tight.out"
  "$QUICKSTART" --budget-mib 0.45 --ckpt-dir "$T/qs-ck" > "$T/qs-dir.out" 2>&1
  check "quickstart: with a checkpoint directory too" test $? -eq 0
fi

echo "libtorch_train: $pass passed, $fails failed"
if [ $fails -ne 0 ]; then
  for f in "$T"/*.err "$T"/qs-*.out; do [ -f "$f" ] && { echo "---- $f"; tail -n 20 "$f"; }; done
  exit 1
fi
