#!/usr/bin/env bash
# mlp_train from the outside: exit codes, error messages, the JSON line, and
# parameters equal to the unlimited run under budget and injected OOMs.
set -uo pipefail
PY=${OOMGUARD_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/scripts/python}  # the project's interpreter
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
"$PY" - "$T/budget.out" <<'PY' || { echo "FAIL: budget JSON"; fails=$((fails + 1)); }
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

# The predictive controller on a budget whose segments (256 KiB) leave the
# capacity's last 102.4 KiB out of the allocator's reach: the cold OOM and
# one miss that shows that tail, then the largest balanced split that fits
# (15 x 137; 14 x 147 does not fit).
"$BIN" --device-budget-mib 0.6 --global-batch 2048 --micro-batch 2048 --steps 40 --quiet --json \
  > "$T/tail.out"; rc=$?
check "0.6 MiB run exits 0" test $rc -eq 0
"$PY" -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); assert d["ooms"] <= 2 and d["final_micro_batch"] >= 128, d' "$T/tail.out" \
  || { echo "FAIL: 0.6 MiB run converges in <= 2 OOMs"; fails=$((fails + 1)); }
# 0.4 MiB: one segment of 256 KiB and a tail of 153.6 KiB; the segment's cache
# after a small micro-batch fills the reachable room and is no overhead
# evidence: 41 fits (not 18, where that cache pinned it).
"$BIN" --device-budget-mib 0.4 --global-batch 2048 --micro-batch 2048 --steps 40 --quiet --json \
  > "$T/wall.out"; rc=$?
check "0.4 MiB run exits 0" test $rc -eq 0
"$PY" -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); assert d["ooms"] <= 2 and d["final_micro_batch"] >= 40, d' "$T/wall.out" \
  || { echo "FAIL: 0.4 MiB run converges in <= 2 OOMs at >= 40"; fails=$((fails + 1)); }

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

# Careless input (issue 15, item 12): NaN, infinities, budgets that round to
# "unlimited", a non-number after R=, an endless delay. Each exits 2 naming
# the flag and what is wrong.
bad_input() {  # bad_input NAME NEEDLE ARGS...
  local name=$1 needle=$2; shift 2
  "$BIN" --steps 2 --quiet "$@" > "$T/bad" 2>&1; local rc=$?
  check "$name exits 2 (got $rc)" test $rc -eq 2
  check "$name says '$needle'" contains "$T/bad" "$needle"
}
bad_input "--lr nan" "--lr: must be a finite number" --lr nan
bad_input "--lr inf" "--lr: must be a finite number" --lr inf
bad_input "--device-budget-mib nan" "--device-budget-mib: must be a finite number" --device-budget-mib nan
check "a NaN budget is not reported as a huge negative number" bash -c "! grep -q -- -9223372036854775808 '$T/bad'"
bad_input "--device-budget-mib 1e-7" "less than one byte (0 means unlimited)" --device-budget-mib 1e-7
bad_input "--rank-budget-mib 0=abc" "'abc' is not a number of MiB" --rank-budget-mib 0=abc
bad_input "--rank-budget-mib 0=nan" "'nan' is not a number of MiB" --rank-budget-mib 0=nan
bad_input "--rank-budget-mib 0=1e-9" "less than one byte" --rank-budget-mib 0=1e-9
bad_input "delay@ms=1e17" "at most 3600000" --faults "delay@ms=99999999999999999"

# A diverging loss still gives valid JSON: null, not nan.
"$BIN" --steps 20 --optimizer sgd --lr 1e9 --quiet --json > "$T/div.out"; rc=$?
check "diverging run exits 0" test $rc -eq 0
"$PY" - "$T/div.out" <<'PY' || { echo "FAIL: diverged JSON"; fails=$((fails + 1)); }
import json, sys
line = open(sys.argv[1]).read().splitlines()[-1]
d = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError("not JSON: " + c)))
assert d["loss_last"] is None, d
PY

# Lost incidents are part of the result (issue 15, item 7): every write of the
# knowledge base fails (the kb_write fault site), so the run says how many
# operations it lost and exits 4; a run that loses none says 0 and exits 0.
"$BIN" "${ARGS[@]}" --device-budget-mib 0.4 --kb "$T/lost.db" --faults "oom@site=kb_write,times=0" --quiet --json \
  > "$T/lost.out" 2> "$T/lost.err"; rc=$?
check "a run that lost incidents exits 4 (got $rc)" test $rc -eq 4
check "a run that lost incidents says so on stderr" contains "$T/lost.err" "incident operation(s) were not recorded"
"$PY" -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); assert d["incident_ops_lost"] > 0 and d["ooms"] > 0, d' "$T/lost.out" \
  || { echo "FAIL: incident_ops_lost in the JSON line"; fails=$((fails + 1)); }
"$BIN" "${ARGS[@]}" --device-budget-mib 0.4 --kb "$T/kept.db" --quiet --json > "$T/kept.out"; rc=$?
check "a run that kept its incidents exits 0" test $rc -eq 0
check "a run that kept its incidents reports 0 lost" contains "$T/kept.out" '"incident_ops_lost":0'

echo "$pass passed, $fails failed"
[ $fails -eq 0 ]
