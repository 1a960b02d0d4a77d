#!/usr/bin/env bash
# mlp_train from the outside: exit codes, error messages, the JSON line, and
# parameters equal to the unlimited run under budget and injected OOMs.
set -uo pipefail
BIN=$1
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OOMGUARD_LOG_LEVEL=error
fails=0
pass=0
check() {  # check NAME CONDITION...
  local name=$1; shift
  if "$@"; then pass=$((pass + 1)); else echo "FAIL: $name"; fails=$((fails + 1)); fi
}
contains() { grep -q -- "$2" "$1"; }

ARGS=(--steps 12 --global-batch 128 --hidden 64 --seed 3)

# Reference, then a budgeted run and an injected-fault run compared against it.
"$BIN" "${ARGS[@]}" --quiet --json --dump-params "$T/ref.bin" > "$T/ref.out"; rc=$?
check "reference exits 0" test $rc -eq 0
check "reference writes 8-byte parameters" test $(( $(stat -c %s "$T/ref.bin") % 8 )) -eq 0

"$BIN" "${ARGS[@]}" --device-budget-mib 0.4 --json --check-against "$T/ref.bin" > "$T/budget.out"; rc=$?
check "budget run exits 0" test $rc -eq 0
check "budget run reports OOMs in progress lines" contains "$T/budget.out" "OOM in"
/usr/bin/python3 - "$T/budget.out" <<'PY' || { echo "FAIL: budget JSON"; fails=$((fails + 1)); }
import json, sys
lines = open(sys.argv[1]).read().splitlines()
d = json.loads(lines[-1])  # the JSON object is the last line
for k in ["steps", "global_batch", "initial_micro_batch", "final_micro_batch", "ooms", "loss_first", "loss_last", "wall_s"]:
    assert k in d, k
assert d["steps"] == 12 and d["global_batch"] == 128, d
assert d["ooms"] >= 1, d
assert d["final_micro_batch"] < 128, d
assert d["max_rel_diff"] <= 1e-10, d
PY

OOMGUARD_FAULTS="oom@step=2,site=backward;host_oom@step=5,site=forward,micro=0" \
  "$BIN" "${ARGS[@]}" --micro-batch 32 --quiet --json --check-against "$T/ref.bin" > "$T/faults.out"; rc=$?
check "env fault run exits 0" test $rc -eq 0
check "env fault run counts 2 OOMs" contains "$T/faults.out" '"ooms":2'

# Bad input: clear errors, exit code 2 (1 for a bad environment rule).
"$BIN" --steps abc > "$T/e1" 2>&1; rc=$?
check "non-numeric --steps exits 2" test $rc -eq 2
check "non-numeric --steps names the flag" contains "$T/e1" "steps"
"$BIN" --no-such-flag > "$T/e2" 2>&1; rc=$?
check "unknown flag exits 2" test $rc -eq 2
check "unknown flag is named" contains "$T/e2" "no-such-flag"
"$BIN" --faults "oom@step=1,sight=forward" > "$T/e3" 2>&1; rc=$?
check "bad --faults exits 2" test $rc -eq 2
check "bad --faults names the rule" contains "$T/e3" "oom@step=1,sight=forward"
OOMGUARD_FAULTS="boom@step=1" "$BIN" --steps 2 > "$T/e4" 2>&1; rc=$?
check "bad OOMGUARD_FAULTS exits 1" test $rc -eq 1
check "bad OOMGUARD_FAULTS names the variable and rule" contains "$T/e4" "OOMGUARD_FAULTS.*boom@step=1"
"$BIN" --micro-batch 2 --min-micro-batch 4 > "$T/e5" 2>&1; rc=$?
check "micro < min exits 2" test $rc -eq 2
"$BIN" "${ARGS[@]}" --quiet --check-against "$T/missing.bin" > "$T/e6" 2>&1; rc=$?
check "missing reference exits 2" test $rc -eq 2
check "missing reference is named" contains "$T/e6" "missing.bin"
"$BIN" "${ARGS[@]}" --optimizer sgd --quiet --check-against "$T/ref.bin" > "$T/e7" 2>&1; rc=$?
check "different parameters exit 3" test $rc -eq 3
"$BIN" "${ARGS[@]}" --device-budget-mib 0.05 > "$T/e8" 2>&1; rc=$?
check "model that does not fit exits 1" test $rc -eq 1
check "model that does not fit says so" contains "$T/e8" "do not fit"

echo "$pass passed, $fails failed"
[ $fails -eq 0 ]
