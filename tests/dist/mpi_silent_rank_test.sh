#!/usr/bin/env bash
# mpirun NP ranks where the last never votes: the others time out within the
# deadline, say so, and exit with code 75; mpirun ends the job (no hang).
set -uo pipefail
MPIRUN=$1 BIN=$2 NP=${3:-4}
out=$(mktemp)
start=$(date +%s)
timeout 60 "$MPIRUN" --allow-run-as-root --oversubscribe -np "$NP" "$BIN" > "$out" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$out"
ok=$(grep -c "TIMEOUT-OK" "$out")
rm -f "$out"
[ "$rc" -ne 124 ] || { echo "FAIL: the job hung"; exit 1; }
[ "$rc" -ne 0 ] || { echo "FAIL: mpirun should report the timeout exit code"; exit 1; }
[ "$ok" -ge 1 ] || { echo "FAIL: no rank reported the timeout"; exit 1; }
[ "$elapsed" -le 30 ] || { echo "FAIL: took ${elapsed}s"; exit 1; }
echo "silent rank: $ok rank(s) timed out cleanly, job ended in ${elapsed}s (mpirun rc $rc)"
