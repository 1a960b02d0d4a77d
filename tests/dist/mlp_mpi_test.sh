#!/usr/bin/env bash
# mlp_train under mpirun -np 4: OOMs on one rank, on every rank, in commit; a
# rank killed mid-step and one killed while writing a checkpoint. Every run
# ends within its deadline, ranks agree, the parameters equal the single-process
# reference, and a resumed run never loads a checkpoint with a missing shard.
set -uo pipefail
PY=${OOMGUARD_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/scripts/python}  # the project's interpreter
MPIRUN=$1 BIN=$2 CLI=$3
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OOMGUARD_LOG_LEVEL=error
pass=0 fails=0
check() { local n=$1; shift; if "$@"; then pass=$((pass + 1)); else echo "FAIL: $n"; fails=$((fails + 1)); fi; }
contains() { grep -q -- "$2" "$1"; }
ARGS=(--steps 12 --global-batch 512 --hidden 64 --seed 4)
mpi() { timeout 120 "$MPIRUN" --allow-run-as-root --oversubscribe -np 4 "$@"; }

"$BIN" "${ARGS[@]}" --quiet --dump-params "$T/ref.bin"
check "reference" test -s "$T/ref.bin"

run_case() {  # run_case NAME FAULTS EXTRA...
  local name=$1 faults=$2; shift 2
  mpi -x OOMGUARD_FAULTS="$faults" "$BIN" "${ARGS[@]}" --dist mpi --json --check-against "$T/ref.bin" "$@" \
    > "$T/$name.out" 2>&1
  local rc=$?
  check "$name: exit 0 (rc $rc)" test $rc -eq 0
  check "$name: ranks agree" contains "$T/$name.out" "all 4 ranks end with identical parameters"
  check "$name: equals the reference" contains "$T/$name.out" "equal within 1e-10"
  check "$name: world size in JSON" contains "$T/$name.out" '"world_size":4'
  [ $rc -eq 0 ] || tail -20 "$T/$name.out"
}
run_case uneven "" --rank-budget-mib 1=0.3
check "uneven: rank 1's budget caused OOMs" contains "$T/uneven.out" "\[rank 1\] step"
run_case forward_one "oom@step=3,rank=1,site=forward"
run_case backward_one "oom@step=4,rank=2,site=backward"
run_case every_rank "oom@step=2,site=backward"
run_case commit_one "oom@step=5,rank=3,site=optimizer" --ckpt-dir "$T/ck-commit" --ckpt-every 2
check "commit_one: rolled back" contains "$T/commit_one.out" '"rollbacks":1'

# A rank killed mid-step: the job ends (no hang); relaunched with --resume
# every rank continues from the newest complete checkpoint.
kill_case() {  # kill_case NAME FAULTS
  local name=$1 faults=$2 dir=$T/ck-$1
  local start=$(date +%s)
  mpi -x OOMGUARD_FAULTS="$faults" "$BIN" "${ARGS[@]}" --dist mpi --ckpt-dir "$dir" --ckpt-every 2 --quiet \
    > "$T/$name.kill.out" 2>&1
  local rc=$? took=$(( $(date +%s) - start ))
  check "$name: killed job fails (rc $rc)" test $rc -ne 0 -a $rc -ne 124
  check "$name: ends within the deadline (${took}s)" test $took -le 60
  # Every checkpoint the resume may load is complete: all 4 shards verify.
  local newest=null
  if "$CLI" ckpt list "$dir" --json > "$T/$name.list" 2>&1; then
    for step in $("$PY" -c "import json,sys; [print(c['step']) for c in json.load(open(sys.argv[1])) if c['committed']]" "$T/$name.list" 2>/dev/null); do
      check "$name: checkpoint $step verifies" "$CLI" ckpt verify "$dir" --step "$step" --world-size 4
      [ "$newest" = null ] || [ "$step" -gt "$newest" ] && newest=$step
    done
  fi
  mpi "$BIN" "${ARGS[@]}" --dist mpi --ckpt-dir "$dir" --ckpt-every 2 --resume --json \
    --check-against "$T/ref.bin" > "$T/$name.resume.out" 2>&1
  rc=$?
  check "$name: resume exit 0 (rc $rc)" test $rc -eq 0
  # Saves are asynchronous and committed once every rank's shard is durable:
  # on a loaded machine none may have been committed before the kill, and
  # the run then starts afresh. Either way it resumes from what was committed.
  check "$name: resumed from the newest committed checkpoint ($newest)" \
    grep -q "\"resumed_from_step\":${newest}[,}]" "$T/$name.resume.out"
  check "$name: resumed run equals the reference" contains "$T/$name.resume.out" "equal within 1e-10"
  [ $rc -eq 0 ] || tail -20 "$T/$name.resume.out"
}
kill_case midstep "kill@step=7,rank=2,site=backward"
kill_case ckpt_write "kill@step=5,rank=1,site=ckpt_write"

echo "$pass passed, $fails failed"
[ $fails -eq 0 ]
