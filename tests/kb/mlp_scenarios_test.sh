#!/usr/bin/env bash
# The knowledge base on incidents that mlp_train really produces: each scenario
# flag yields its OOM pattern, and a second run of the same workload with the
# same --kb starts at the learned micro-batch and hits fewer OOMs.
set -uo pipefail
PY=${OOMGUARD_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/scripts/python}  # the project's interpreter
BIN=$1 CLI=$2
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OOMGUARD_LOG_LEVEL=off
pass=0 fails=0
check() { local n=$1; shift; if "$@"; then pass=$((pass + 1)); else echo "FAIL: $n"; fails=$((fails + 1)); fi; }

patterns() {  # patterns DB: the patterns of every incident, one per line
  "$CLI" kb export --db "$1" | "$PY" -c 'import json,sys; [print(json.loads(l)["pattern"]) for l in sys.stdin]'
}
scenario() {  # scenario NAME EXPECTED_PATTERN MLP_ARGS...
  local name=$1 want=$2; shift 2
  "$BIN" --quiet --json --kb "$T/$name.sqlite" --workload "$name" "$@" > "$T/$name.out" 2>&1
  patterns "$T/$name.sqlite" > "$T/$name.patterns"
  check "$name: some incident is $want (got: $(sort "$T/$name.patterns" | uniq -c | tr '\n' ' '))" \
    grep -qx "$want" "$T/$name.patterns"
}
scenario startup startup_capacity --steps 10 --global-batch 512 --hidden 128 --device-budget-mib 1.5
scenario costly activation_spike --steps 10 --global-batch 512 --hidden 128 --device-budget-mib 1.5 --costly-samples
scenario leak gradual_growth --steps 60 --global-batch 256 --hidden 64 --device-budget-mib 1.0 --leak-bytes-per-step 16384
# The search's probes are what run into fragmentation here; the predictive
# controller keeps below what the fragmented cache lets fit.
scenario frag fragmentation --steps 20 --global-batch 512 --hidden 128 --device-budget-mib 1.5 --fragmentation \
  --controller search
scenario optstate optimizer_state --steps 5 --global-batch 64 --hidden 128 --device-budget-mib 0.9 --lazy-optimizer-state
scenario ranks rank_imbalance --steps 12 --global-batch 512 --hidden 64 --dist threads --ranks 4 --rank-budget-mib 1=0.3

# Incidents of a multi-rank run carry every rank's memory.
"$CLI" kb export --db "$T/ranks.sqlite" | "$PY" -c '
import json, sys
items = [json.loads(l) for l in sys.stdin]
assert items and all(len(i.get("ranks", [])) == 4 for i in items), [len(i.get("ranks", [])) for i in items]
' && pass=$((pass + 1)) || { echo "FAIL: ranks[] on multi-rank incidents"; fails=$((fails + 1)); }

# Learned priors: the same workload again starts where the first run ended.
ARGS=(--steps 20 --global-batch 512 --hidden 128 --device-budget-mib 1.5 --quiet --json --kb "$T/prior.sqlite")
"$BIN" "${ARGS[@]}" > "$T/first.out"
"$BIN" "${ARGS[@]}" > "$T/second.out"
"$PY" - "$T/first.out" "$T/second.out" <<'PY' && pass=$((pass + 1)) || { echo "FAIL: priors"; fails=$((fails + 1)); }
import json, sys
a = json.loads(open(sys.argv[1]).read().splitlines()[-1])
b = json.loads(open(sys.argv[2]).read().splitlines()[-1])
assert b["ooms"] < a["ooms"], (a["ooms"], b["ooms"])
assert b["initial_micro_batch"] < a["initial_micro_batch"], (a["initial_micro_batch"], b["initial_micro_batch"])
PY

# A broken knowledge base never stops training.
echo "not a database" > "$T/corrupt.sqlite"
"$BIN" --steps 3 --global-batch 64 --hidden 32 --quiet --kb "$T/corrupt.sqlite" > "$T/corrupt.out" 2>&1
check "corrupt --kb: training still succeeds" test $? -eq 0
check "corrupt --kb: says so" grep -q "training without it" "$T/corrupt.out"

echo "$pass passed, $fails failed"
[ $fails -eq 0 ]
