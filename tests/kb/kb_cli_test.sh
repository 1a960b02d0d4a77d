#!/usr/bin/env bash
# The `oomguard kb` command line on hand-written JSONL: every pattern is
# recognised, import is all-or-nothing, bad input names the line, several
# --db files (and globs) are read together.
# Usage: kb_cli_test.sh OOMGUARD_BINARY TESTDATA_DIR
set -u
OG="$1"
DATA="$2"
PY=${OOMGUARD_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/scripts/python}  # the project's interpreter
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# 1. classify --json: one object per line, in input order, with the expected pattern.
"$OG" kb classify --json "$DATA/patterns.jsonl" > "$T/cls.jsonl" || fail "classify exited $?"
$PY - "$T/cls.jsonl" <<'PYEOF' || fail "classify output"
import json, sys
want = ["startup_capacity", "activation_spike", "gradual_growth", "fragmentation", "rank_imbalance",
        "optimizer_state", "host_dataloader", "checkpoint_staging", "workspace", "foreign_memory"]
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["pattern"] for r in rows] == want, [r["pattern"] for r in rows]
for r in rows:
    assert r["id"].startswith("p-"), r
    assert 0.5 <= r["confidence"] <= 1, r
    assert r["evidence"] and len(r["remedies"]) >= 3, r
    assert len(r["fingerprint"]) == 16, r
PYEOF

# 2. import into two files (one per "host"), then read both through a glob.
head -n 5 "$DATA/patterns.jsonl" > "$T/a.jsonl"
tail -n 5 "$DATA/patterns.jsonl" > "$T/b.jsonl"
"$OG" kb import --db "$T/host-a.db" "$T/a.jsonl" > /dev/null || fail "import a"
"$OG" kb import --db "$T/host-b.db" "$T/b.jsonl" > /dev/null || fail "import b"
n=$("$OG" kb list --json --db "$T/host-*.db" --limit 0 | $PY -c 'import json,sys; print(len(json.load(sys.stdin)))')
[ "$n" = 10 ] || fail "list over a glob saw $n incidents, want 10"
n=$("$OG" kb export --db "$T/host-a.db" --db "$T/host-b.db" | wc -l)
[ "$n" = 10 ] || fail "export of two --db gave $n lines, want 10"
n=$("$OG" kb list --json --db "$T/host-*.db" --pattern fragmentation | $PY -c 'import json,sys; print(len(json.load(sys.stdin)))')
[ "$n" = 1 ] || fail "--pattern fragmentation gave $n"
"$OG" kb stats --json --db "$T/host-*.db" | $PY -c 'import json,sys; s=json.load(sys.stdin); assert s["incidents"]==10 and len(s["by_pattern"])==10, s' \
  || fail "stats"
"$OG" kb groups --json --db "$T/host-*.db" | $PY -c 'import json,sys; g=json.load(sys.stdin); assert len(g)==10 and all(x["count"]==1 for x in g), g' \
  || fail "groups"
"$OG" kb show --db "$T/host-*.db" p-frag | grep -q "reserved but unallocated" || fail "show p-frag"
"$OG" kb list --db "$T/host-a.db" | head -1 | grep -q "PATTERN" || fail "human list has no header"
"$OG" kb patterns | grep -q foreign_memory || fail "patterns"

# 3. export -> import round trip keeps every incident.
"$OG" kb export --db "$T/host-*.db" > "$T/all.jsonl"
"$OG" kb import --db "$T/merged.db" "$T/all.jsonl" > /dev/null || fail "re-import"
n=$("$OG" kb export --db "$T/merged.db" | wc -l)
[ "$n" = 10 ] || fail "round trip kept $n"

# 4. a malformed line names the line and nothing of the file is imported.
{ head -n 2 "$DATA/patterns.jsonl"; echo '{"step": "seven"}'; tail -n 1 "$DATA/patterns.jsonl"; } > "$T/bad.jsonl"
"$OG" kb import --db "$T/bad.db" "$T/bad.jsonl" 2> "$T/err" && fail "import of a bad file succeeded"
grep -q "bad.jsonl:3: field 'step' must be an integer" "$T/err" || fail "error does not name line 3: $(cat "$T/err")"
if [ -f "$T/bad.db" ]; then
  n=$("$OG" kb export --db "$T/bad.db" | wc -l)
  [ "$n" = 0 ] || fail "half-imported: $n"
fi
printf '{"id":"x"}\nnot json\n' > "$T/bad2.jsonl"
"$OG" kb classify "$T/bad2.jsonl" 2> "$T/err" && fail "classify of bad JSON succeeded"
grep -q "bad2.jsonl:2: not valid JSON" "$T/err" || fail "bad JSON error: $(cat "$T/err")"
$PY -c 'print("{\"message\": \"" + "x" * 2000000 + "\"}")' > "$T/huge.jsonl"
"$OG" kb classify "$T/huge.jsonl" 2> "$T/err" && fail "huge line accepted"
grep -q "huge.jsonl:1: line is longer than 1 MiB" "$T/err" || fail "huge error: $(cat "$T/err")"
# Issue 28, row 6: a 512 MiB line is refused after its first MiB, not read whole (it took 2x its
# size in memory): import and classify stay far below the line's size.
$PY - "$OG" "$T" <<'PYEOF' || fail "a huge line was read whole"
import resource, subprocess, sys
og, t = sys.argv[1:3]
with open(t + "/giant.jsonl", "wb") as f:
    f.truncate(512 << 20)  # sparse: 512 MiB of NUL bytes, no newline
for args in (["kb", "classify"], ["kb", "import", "--db", t + "/giant.db"]):
    r = subprocess.run([og, *args, t + "/giant.jsonl"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "giant.jsonl:1: line is longer than 1 MiB" in r.stderr, (args, r.returncode, r.stderr)
peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss >> 10
assert peak_mib < 64, f"peak resident memory {peak_mib} MiB"
PYEOF

# 5. missing, corrupt and unmatched databases give clear errors.
"$OG" kb list --db "$T/none.db" 2> "$T/err" && fail "missing db accepted"
grep -q "no such file" "$T/err" || fail "missing db error: $(cat "$T/err")"
head -c 4096 /dev/urandom > "$T/corrupt.db"
"$OG" kb list --db "$T/corrupt.db" 2> "$T/err" && fail "corrupt db accepted"
grep -q "DATA_LOSS" "$T/err" || fail "corrupt db error: $(cat "$T/err")"
"$OG" kb list --db "$T/nothing-*.db" 2> "$T/err" && fail "unmatched glob accepted"
grep -q "no file matches" "$T/err" || fail "glob error: $(cat "$T/err")"
"$OG" kb list --db "$T/host-a.db" --since yesterday 2> "$T/err" && fail "bad --since accepted"
"$OG" kb bogus > /dev/null 2>&1; [ $? = 2 ] || fail "unknown subcommand should exit 2"

# 6. Imported fields never reach the terminal raw (issue 15, item 9): escape
# sequences in an id, a host or a message are shown as \xNN / \uNNNN by
# list and show; --json keeps the exact text (JSON-escaped).
$PY - "$T/esc.jsonl" <<'PYEOF'
import json, sys
inc = {"id": "esc-\u001b[2J", "host": "h\u001b]0;pwned\u0007", "run_id": "run-\u202eevil",
       "message": "line1\rFORGED \u009b31m red \u001b[1A", "step": 3, "phase": "forward", "kind": "device"}
open(sys.argv[1], "w").write(json.dumps(inc) + "\n")
PYEOF
"$OG" kb import --db "$T/esc.db" "$T/esc.jsonl" > /dev/null || fail "import of escape sequences"
"$OG" kb list --db "$T/esc.db" > "$T/esc.list" 2>&1 || fail "list of escape sequences"
"$OG" kb show esc --db "$T/esc.db" > "$T/esc.show" 2>&1 || fail "show of escape sequences"
"$OG" kb show "$(printf 'nope\033[2J')" --db "$T/esc.db" > /dev/null 2> "$T/esc.err"
for f in "$T/esc.list" "$T/esc.show" "$T/esc.err"; do
  $PY - "$f" <<'PYEOF' || fail "$(basename "$f") holds raw control characters: $(od -c "$f" | head -5)"
import sys
raw = open(sys.argv[1], "rb").read()
bad = [b for b in (b"\x1b", b"\x07", b"\r", b"\xc2\x9b", b"\xe2\x80\xae") if b in raw]
assert not bad, bad
PYEOF
done
grep -q 'esc-\\x1b\[2J' "$T/esc.list" || fail "list shows the escaped id: $(cat "$T/esc.list")"
grep -q 'line1\\x0dFORGED \\u009b31m' "$T/esc.show" || fail "show shows the escaped message: $(cat "$T/esc.show")"
grep -q 'nope\\x1b\[2J' "$T/esc.err" || fail "an error message escapes the id it names: $(cat "$T/esc.err")"
"$OG" kb show esc --db "$T/esc.db" --json | $PY -c 'import json,sys; d=json.load(sys.stdin); assert d["message"].startswith("line1\rFORGED \u009b"), d' \
  || fail "--json keeps the exact message"

if [ "$fails" -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "kb_cli: all checks passed"
