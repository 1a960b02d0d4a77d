#!/usr/bin/env bash
# 8 writer processes x 1000 incidents into one PostgreSQL server; the server
# is stopped and started again mid-run, and while it is away one writer is
# killed with kill -9 (its spool file orphaned: another writer must adopt and
# send it) and started again. Afterwards every incident is on the
# server exactly once (counted), the writers spooled while the server was
# away, and no Record() call blocked (the queue takes it; bounded, loose on a
# loaded machine).
#   kb_pg_stress_test.sh WRITER_BINARY PG_SERVER_SCRIPT
set -euo pipefail
WRITER=$1
PG=$2
WRITERS=8
COUNT=1000
T=$(mktemp -d /tmp/oomguard-pg-stress-XXXXXX)
chmod 711 "$T"  # the server runs as nobody under root
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  "$PG" stop "$T/pg" >/dev/null 2>&1 || true
  rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; for f in "$T"/w*.out; do echo "== $f"; cat "$f"; done >&2; exit 1; }

URL=$("$PG" start "$T/pg")
SPOOL=$T/spool
start_writer() { "$WRITER" "$URL" "$SPOOL" "$1" "$COUNT" 60 >"$T/w$1.out" 2>&1 & pids[$1]=$!; }
for w in $(seq 0 $((WRITERS - 1))); do start_writer "$w"; done

count() { psql -Atq "$URL" -c "$1" 2>/dev/null || echo -1; }
# Wait for a first part on the server, then take the server away (fast stop:
# every connection breaks) while the writers go on.
for _ in $(seq 1 300); do [ "$(count 'SELECT COUNT(*) FROM incidents')" -ge 1500 ] 2>/dev/null && break; sleep 0.1; done
"$PG" stop "$T/pg"
echo "server stopped"
sleep 1
# Writer 3 dies with kill -9 while its incidents wait in its spool file.
pid3=${pids[3]}
kill -9 "$pid3"
wait "$pid3" 2>/dev/null || true
orphan=$(find "$SPOOL" -name "spool-*-$pid3-*.jsonl" -size +0c | wc -l)
echo "writer 3 killed; spool files it left with incidents: $orphan"
[ "$orphan" -ge 1 ] || fail "writer 3 left no spool (the server was not away long enough?)"
"$PG" restart "$T/pg"
echo "server restarted"
# The killed writer starts again: it records its incidents again (same ids).
start_writer 3

rc=0
for w in $(seq 0 $((WRITERS - 1))); do
  wait "${pids[$w]}" || { echo "writer $w exited $?" >&2; rc=1; }
done
pids=()
cat "$T"/w*.out
[ $rc -eq 0 ] || fail "a writer failed"

total=$(count "SELECT COUNT(*) FROM incidents")
distinct=$(count "SELECT COUNT(DISTINCT id) FROM incidents")
expected=$(count "SELECT COUNT(*) FROM incidents WHERE id ~ '^w[0-7]-[0-9]{4}\$'")
echo "incidents: $total rows, $distinct distinct ids, $expected of the expected form"
[ "$total" -eq $((WRITERS * COUNT)) ] || fail "expected $((WRITERS * COUNT)) incidents, found $total"
[ "$distinct" -eq "$total" ] || fail "duplicates"
[ "$expected" -eq "$total" ] || fail "unexpected ids"
for w in $(seq 0 $((WRITERS - 1))); do
  n=$(count "SELECT COUNT(*) FROM incidents WHERE id LIKE 'w$w-%'")
  [ "$n" -eq $COUNT ] || fail "writer $w: $n incidents on the server"
done
spooled=$(cat "$T"/w*.out | sed -n 's/.*spooled=\([0-9]*\).*/\1/p' | awk '{s+=$1} END {print s+0}')
echo "spooled while the server was away: $spooled"
[ "$spooled" -gt 0 ] || fail "no writer spooled: the restart was not exercised"
# Records are copied into the queue: even on a loaded machine far below a second.
longest=$(cat "$T"/w*.out | sed -n 's/.*longest_record_us=\([0-9]*\).*/\1/p' | sort -n | tail -1)
echo "longest Record() call: ${longest} us"
[ "$longest" -lt 250000 ] || fail "a Record() call took ${longest} us"
left=$(find "$SPOOL" -name 'spool-*.jsonl' -size +0c | wc -l)
[ "$left" -eq 0 ] || fail "$left spool file(s) still hold incidents (the killed writer's was not adopted?)"
echo "PASS"
