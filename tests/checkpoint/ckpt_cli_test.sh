#!/usr/bin/env bash
# `oomguard ckpt list|verify|inspect` on checkpoints written by mlp_train,
# before and after corruption. Usage: ckpt_cli_test.sh OOMGUARD MLP_TRAIN
set -u
PY=${OOMGUARD_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/scripts/python}  # the project's interpreter
CLI=$1
MLP=$2
WORK=$(mktemp -d /tmp/oomguard-ckptcli-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
D="$WORK/ck"
"$MLP" --steps 15 --hidden 16 --quiet --ckpt-dir "$D" --ckpt-every 5 --keep 0 || fail "mlp_train"

out=$("$CLI" ckpt list "$D") || fail "list: $out"
[ "$(echo "$out" | grep -c committed)" = "3" ] || fail "list shows 3 committed checkpoints: $out"
out=$("$CLI" ckpt list "$D" --json) || fail "list --json"
echo "$out" | "$PY" -c 'import json,sys; l=json.load(sys.stdin); assert [c["step"] for c in l]==[4,9,14] and all(c["committed"] for c in l), l' \
  || fail "list --json: $out"
"$CLI" ckpt verify "$D" > /dev/null || fail "verify of good checkpoints"
out=$("$CLI" ckpt inspect "$D/step-00000014/rank-00000.h5" --json) || fail "inspect"
echo "$out" | "$PY" -c 'import json,sys; j=json.load(sys.stdin); assert j["step"]==14 and j["format"]=="oomguard-ckpt/2"; t={x["path"]:x for x in j["tensors"]}; assert t["/model/fc2.weight"]["shape"]==[16,16] and t["/model/fc2.weight"]["filters"]==["shuffle","zstd(level=1)"], t' \
  || fail "inspect --json: $out"

# Flip one byte near the end of a shard's data: verify names the file, exits 1.
F="$D/step-00000009/rank-00000.h5"
"$PY" -c 'import sys; p=sys.argv[1]; b=bytearray(open(p,"rb").read()); b[len(b)//2]^=0xff; open(p,"wb").write(b)' "$F"
out=$("$CLI" ckpt verify "$D" --step 9 2>&1)
[ $? -eq 1 ] || fail "verify of a flipped byte must exit 1: $out"
echo "$out" | grep -q "rank-00000.h5" || fail "verify must name the shard: $out"
rm "$D/step-00000014/MANIFEST.json"
out=$("$CLI" ckpt verify "$D" --step 14 --json)
[ $? -eq 1 ] || fail "verify of a missing manifest must exit 1"
echo "$out" | grep -q "no MANIFEST.json" || fail "verify must say the manifest is missing: $out"
"$CLI" ckpt inspect "$WORK/nope.h5" > /dev/null 2>&1
[ $? -eq 1 ] || fail "inspect of a missing file exits 1"
"$CLI" ckpt verify > /dev/null 2>&1
[ $? -eq 2 ] || fail "verify without DIR exits 2"
# Verify of a whole directory reports every checkpoint it could not verify
# (issue 15, item 4): a manifest that does not parse, or that names another
# step, is a bad checkpoint, not one to skip; with all of them bad it lists
# each and exits 1. A step directory without a manifest is only listed.
E="$WORK/every"
"$MLP" --steps 15 --hidden 16 --quiet --ckpt-dir "$E" --ckpt-every 5 --keep 0 || fail "mlp_train (every)"
echo '{"format": "oomguard-ckpt/1", "step": 9,' > "$E/step-00000009/MANIFEST.json"
cp "$E/step-00000004/MANIFEST.json" "$E/step-00000014/MANIFEST.json"
mkdir "$E/step-00000020"
out=$("$CLI" ckpt verify "$E" 2>&1)
[ $? -eq 1 ] || fail "verify with an unparseable and a mismatched manifest must exit 1: $out"
echo "$out" | grep -q "step 4: ok" || fail "step 4 verifies: $out"
echo "$out" | grep -q "step 9: BAD: .*MANIFEST.json" || fail "the unparseable manifest is reported: $out"
echo "$out" | grep -q "step 14: BAD: .*names step 4" || fail "the mismatched manifest is reported: $out"
echo "$out" | grep -q "step 20: incomplete" || fail "the directory without a manifest is listed: $out"
echo "$out" | grep -q "2 of 3 checkpoint(s) did not verify" || fail "the summary counts the bad ones: $out"
out=$("$CLI" ckpt verify "$E" --json)
[ $? -eq 1 ] || fail "verify --json exits 1 too"
echo "$out" | "$PY" -c 'import json,sys; j=json.load(sys.stdin); assert not j["ok"] and {c["step"]:c["ok"] for c in j["checkpoints"]}=={4:True,9:False,14:False} and j["incomplete"]==[20], j' \
  || fail "verify --json lists every checkpoint: $out"
echo 'not json' > "$E/step-00000004/MANIFEST.json"
out=$("$CLI" ckpt verify "$E" 2>&1)
[ $? -eq 1 ] || fail "verify with every manifest bad must exit 1: $out"
for s in 4 9 14; do
  echo "$out" | grep -q "step $s: BAD" || fail "every bad checkpoint is named (step $s): $out"
done
echo "$out" | grep -q "no committed checkpoint" && fail "bad manifests are not 'no committed checkpoint': $out"

# Issue 28, row 14: a setting the tool cannot honour is one clear error and exit 2, not BAD for
# every healthy checkpoint; the common spellings of a log level are accepted.
G="$WORK/good"
"$MLP" --steps 10 --hidden 16 --quiet --ckpt-dir "$G" --ckpt-every 5 --keep 0 || fail "mlp_train (good)"
out=$(OOMGUARD_CKPT_READS=fast "$CLI" ckpt verify "$G" 2>&1)
[ $? -eq 2 ] || fail "verify with OOMGUARD_CKPT_READS=fast must exit 2: $out"
echo "$out" | grep -q "OOMGUARD_CKPT_READS='fast'" || fail "the setting is named: $out"
echo "$out" | grep -q "BAD" && fail "healthy checkpoints reported BAD: $out"
[ "$(echo "$out" | wc -l)" = 1 ] || fail "one line: $out"
out=$(OOMGUARD_LOG_LEVEL=loud "$CLI" ckpt verify "$G" 2>&1)
[ $? -eq 2 ] || fail "OOMGUARD_LOG_LEVEL=loud must exit 2: $out"
echo "$out" | grep -q "OOMGUARD_LOG_LEVEL='loud' is not a level" || fail "the log level is named: $out"
for level in OFF DEBUG Warning; do
  OOMGUARD_LOG_LEVEL=$level "$CLI" ckpt verify "$G" > /dev/null 2>&1 || fail "OOMGUARD_LOG_LEVEL=$level is a level"
done

echo "ok: ckpt list/verify/inspect"
