#!/usr/bin/env bash
# The demo: the same training run twice, once on an unlimited (simulated)
# device and once on a device too small for the requested micro-batch. The
# guarded run hits out-of-memory errors, recovers from each, and ends with the
# same parameters and loss as the unlimited run.
set -euo pipefail
BUILD=${1:-build}
BIN="$BUILD/bin/mlp_train"
[ -x "$BIN" ] || { echo "demo: $BIN not built (run: make demo)" >&2; exit 1; }
CLI="$BUILD/bin/oomguard"
OUT=$(mktemp -d "${TMPDIR:-/tmp}/oomguard-demo.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
# The knowledge base outlives the demo so that it can be browsed afterwards.
KB="$BUILD/demo/incidents.sqlite"
mkdir -p "$BUILD/demo"
rm -f "$KB" "$KB-wal" "$KB-shm"
export OOMGUARD_LOG_LEVEL=${OOMGUARD_LOG_LEVEL:-error}

ARGS=(--steps 40 --global-batch 512 --micro-batch 512 --hidden 128 --seed 7)
BUDGET=1.5

json_field() {  # json_field FILE KEY: a number from the JSON line mlp_train ends with
  tail -n 1 "$1" | sed -E "s/.*\"$2\":([^,}]*).*/\1/"
}

echo "== oomguard demo =="
echo "An MLP (float64, Adam) trains 40 steps with a global batch of 512 samples."
echo
echo "-- 1. Reference run on an unlimited device: the whole batch as one micro-batch"
"$BIN" "${ARGS[@]}" --device-budget-mib 0 --quiet --json --dump-params "$OUT/reference.bin" > "$OUT/reference.json"
echo "   final loss $(json_field "$OUT/reference.json" loss_last), $(json_field "$OUT/reference.json" ooms) OOMs"
echo
echo "-- 2. The same run on a device with only $BUDGET MiB, where 512 samples do not fit"
echo "   Each line below is one out-of-memory error the guard caught inside a step:"
echo "   it released the allocator caches, split the step into smaller micro-batches"
echo "   (same 512 samples per step, gradients accumulated with weights size/512),"
echo "   and retried. Later it probes larger micro-batches again to find the largest that fits."
echo
"$BIN" "${ARGS[@]}" --device-budget-mib "$BUDGET" --json --check-against "$OUT/reference.bin" --kb "$KB" \
  | tee "$OUT/guarded.txt"
echo
OOMS=$(json_field "$OUT/guarded.txt" ooms)
REF_LOSS=$(json_field "$OUT/reference.json" loss_last)
LOSS=$(json_field "$OUT/guarded.txt" loss_last)
DIFF=$(json_field "$OUT/guarded.txt" max_rel_diff)
echo "-- Summary"
echo "   The guarded run hit $OOMS out-of-memory errors and recovered from every one:"
echo "   micro-batch $(json_field "$OUT/guarded.txt" initial_micro_batch) at the start, $(json_field "$OUT/guarded.txt" final_micro_batch) at the end."
printf '   final loss: guarded %.12g, unlimited %.12g (the reported loss is summed per micro-batch,\n   so it may differ in the last bits; the parameters are the real test)\n' "$LOSS" "$REF_LOSS"
echo "   final parameters: max relative difference $DIFF (required: at most 1e-10)"
if [ "$OOMS" -lt 1 ]; then
  echo "demo: expected the small device to cause OOMs" >&2
  exit 1
fi
echo "   => same result as the unlimited run, on a device that could not hold the batch."
echo
echo "-- 3. The same run again, with the knowledge base the first one filled"
echo "   Every incident went into $KB, and so did the largest micro-batch that ran"
echo "   clean for this workload. A new run of the same workload starts there:"
"$BIN" "${ARGS[@]}" --device-budget-mib "$BUDGET" --json --quiet --check-against "$OUT/reference.bin" --kb "$KB" \
  > "$OUT/second.txt"
OOMS2=$(json_field "$OUT/second.txt" ooms)
echo "   second run: $OOMS2 OOMs (first run: $OOMS), starting at micro-batch $(json_field "$OUT/second.txt" initial_micro_batch);"
echo "   parameters again equal the unlimited run's (max relative difference $(json_field "$OUT/second.txt" max_rel_diff))."
echo
echo "-- 4. The incidents, classified into known OOM patterns"
"$CLI" kb list --db "$KB"
echo
"$CLI" kb groups --db "$KB"
echo
echo "Browse them:  $CLI kb serve --db $KB   (then open the printed address)"
echo "Or share one file:  $CLI kb report --db $KB --html incidents.html"
