#!/usr/bin/env bash
# `oomguard kb` over a PostgreSQL server (started here by pg_server.sh):
# import --from moves an SQLite file into the server and back with the same
# incident JSON, every read view answers as on the SQLite file, notes show
# with their group, OOMGUARD_KB_URL stands in for --db, and the password of
# the URL appears in no output.
# Usage: kb_pg_cli_test.sh OOMGUARD_BINARY TESTDATA_DIR PG_SERVER_SCRIPT
set -u
OG="$1"
DATA="$2"
PG="$3"
PY=${OOMGUARD_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/scripts/python}
T=$(mktemp -d /tmp/oomguard-pg-cli-XXXXXX)
chmod 711 "$T"  # the server runs as nobody under root
trap '"$PG" stop "$T/pg" >/dev/null 2>&1; rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

PLAIN=$("$PG" start "$T/pg") || { echo "FAIL: no server"; exit 1; }
# Trust authentication ignores the password, so it can stand in the URL here
# and must never come out.
URL=${PLAIN/oomguard@/oomguard:hunter2secret@}
export OOMGUARD_KB_SPOOL="$T/spool"
out() { "$@" >>"$T/all.out" 2>&1; }

"$OG" kb import --db "$T/a.db" "$DATA/patterns.jsonl" > /dev/null || fail "import into SQLite"
"$OG" kb import --db "$URL" --from "$T/a.db" > "$T/imp.txt" 2>&1 || fail "import --from SQLite into the server: $(cat "$T/imp.txt")"
cat "$T/imp.txt" >> "$T/all.out"
grep -q "imported 10 incident" "$T/imp.txt" || fail "import said: $(cat "$T/imp.txt")"
# Again: idempotent (ids), still 10.
"$OG" kb import --db "$URL" --from "$T/a.db" >> "$T/all.out" 2>&1 || fail "second import"

# Every view: the same answer from the file and from the server.
for view in "list --limit 0" "list --limit 3" "list --limit 3 --offset 4" "list --pattern fragmentation" "groups" "export" "list --rank 1"; do
  # shellcheck disable=SC2086
  "$OG" kb $view --json --db "$T/a.db" > "$T/lite.json" 2>&1 || fail "$view on SQLite"
  # shellcheck disable=SC2086
  "$OG" kb $view --json --db "$URL" > "$T/pg.json" 2>>"$T/all.out" || fail "$view on the server"
  cat "$T/pg.json" >> "$T/all.out"
  cmp -s "$T/lite.json" "$T/pg.json" || fail "$view differs: $(diff "$T/lite.json" "$T/pg.json" | head -5)"
done
"$OG" kb stats --json --db "$T/a.db" | $PY -c 'import json,sys; d=json.load(sys.stdin); d.pop("files"); print(json.dumps(d, sort_keys=True))' > "$T/lite.json"
"$OG" kb stats --json --db "$URL" > "$T/pgstats.json" 2>>"$T/all.out" || fail "stats on the server"
cat "$T/pgstats.json" >> "$T/all.out"
$PY -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["files"][0]["schema_version"] == 5, d; d.pop("files"); print(json.dumps(d, sort_keys=True))' "$T/pgstats.json" > "$T/pg.json" || fail "stats json"
cmp -s "$T/lite.json" "$T/pg.json" || fail "stats differ"

# Paging across a file and the server (merged, then sliced) is the same page as of one file.
"$OG" kb import --db "$T/b.db" "$DATA/../../browser/testdata/runs.jsonl" > /dev/null || fail "import runs into b.db"
"$OG" kb import --db "$T/ab.db" --from "$T/a.db" > /dev/null && "$OG" kb import --db "$T/ab.db" --from "$T/b.db" > /dev/null || fail "ab.db"
"$OG" kb list --json --limit 4 --offset 7 --db "$T/ab.db" > "$T/one.json" || fail "page of one file"
"$OG" kb list --json --limit 4 --offset 7 --db "$URL" --db "$T/b.db" > "$T/two.json" 2>>"$T/all.out" || fail "page of the server and a file"
cmp -s "$T/one.json" "$T/two.json" || fail "a merged page differs: $(diff "$T/one.json" "$T/two.json" | head -4)"
[ "$($PY -c 'import json,sys; print(len(json.load(open(sys.argv[1]))))' "$T/two.json")" = 4 ] || fail "a page of 4"

# OOMGUARD_KB_URL stands in for --db.
n=$(OOMGUARD_KB_URL="$URL" "$OG" kb list --json --limit 0 2>>"$T/all.out" | $PY -c 'import json,sys; print(len(json.load(sys.stdin)))')
[ "$n" = 10 ] || fail "OOMGUARD_KB_URL: list saw $n incidents"

# A note on a group shows with its incidents (show, groups) and survives the way back.
fp=$("$OG" kb groups --json --db "$URL" | $PY -c 'import json,sys; print(json.load(sys.stdin)[0]["fingerprint"])')
id=$("$OG" kb list --json --db "$URL" --limit 0 | $PY -c 'import json,sys; fp=sys.argv[1]; print([i["id"] for i in json.load(sys.stdin) if i["fingerprint"]==fp][0])' "$fp")
out "$OG" kb note --db "$URL" "$fp" "fixed by expandable_segments" --author ana || fail "note"
"$OG" kb note --db "$URL" 0000000000000000 "typo" > "$T/bad.txt" 2>&1 && fail "a note on an unknown group was accepted"
grep -q "no incident has fingerprint" "$T/bad.txt" || fail "unknown group: $(cat "$T/bad.txt")"
"$OG" kb show --db "$URL" "$id" > "$T/show.txt" 2>&1 || fail "show"
cat "$T/show.txt" >> "$T/all.out"
grep -q "team note.*fixed by expandable_segments (ana" "$T/show.txt" || fail "show lacks the note: $(grep -i note "$T/show.txt")"
"$OG" kb groups --json --db "$URL" | $PY -c '
import json,sys
g = {x["fingerprint"]: x for x in json.load(sys.stdin)}
assert g[sys.argv[1]]["note"]["text"] == "fixed by expandable_segments", g[sys.argv[1]]
assert sum(1 for x in g.values() if x["note"]) == 1
' "$fp" || fail "groups --json note"

# Back into a new SQLite file: the same incident JSON, the note too.
"$OG" kb import --db "$T/back.db" --from "$URL" >> "$T/all.out" 2>&1 || fail "import --from the server into SQLite"
"$OG" kb export --db "$T/a.db" > "$T/a.jsonl"
"$OG" kb export --db "$T/back.db" > "$T/back.jsonl"
cmp -s "$T/a.jsonl" "$T/back.jsonl" || fail "the round trip changed incidents"
"$OG" kb show --db "$T/back.db" "$id" | grep -q "team note.*expandable_segments" || fail "the note did not come back"

# kb serve over the server: a write by anyone shows after the next poll (the server's change stamp).
"$OG" kb serve --port 0 --poll-ms 100 --db "$URL" > "$T/serve.out" 2>>"$T/all.out" &
serve_pid=$!
for _ in $(seq 1 100); do grep -qs "^Serving http://" "$T/serve.out" && break; sleep 0.1; done
base=$(sed -n 's/^Serving \(http:[^ ]*\).*/\1/p' "$T/serve.out" | head -1)
total() { $PY -c 'import json,sys,urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1] + "api/stats"))["incidents"])' "$base"; }
[ "$(total)" = 10 ] || fail "kb serve over the server: $(total) incidents, want 10"
"$OG" kb import --db "$URL" "$DATA/../../browser/testdata/runs.jsonl" >> "$T/all.out" 2>&1 || fail "import runs"
want=$(( 10 + $(grep -c . "$DATA/../../browser/testdata/runs.jsonl") ))
n=0
for _ in $(seq 1 100); do n=$(total); [ "$n" = "$want" ] && break; sleep 0.1; done
[ "$n" = "$want" ] || fail "kb serve did not reload from the server: $n incidents, want $want"
$PY -c 'import json,sys,urllib.request; print(json.dumps(json.load(urllib.request.urlopen(sys.argv[1] + "api/stats"))))' "$base" >> "$T/all.out"
kill "$serve_pid"; wait "$serve_pid" 2>/dev/null

# A server that is not there: a clear error, no password.
"$OG" kb list --db "postgresql://oomguard:hunter2secret@/oomguard?host=$T/nowhere" > "$T/down.txt" 2>&1 && fail "list on no server succeeded"
cat "$T/down.txt" >> "$T/all.out"
grep -q "cannot connect" "$T/down.txt" || fail "no server: $(cat "$T/down.txt")"
grep -q "oomguard:\*\*\*@" "$T/down.txt" || fail "the error does not name the (redacted) URL: $(cat "$T/down.txt")"

if grep -q hunter2secret "$T/all.out"; then fail "the password appeared: $(grep hunter2secret "$T/all.out" | head -3)"; fi
[ "$fails" -eq 0 ] && echo "PASS" || { echo "$fails failure(s)"; exit 1; }
