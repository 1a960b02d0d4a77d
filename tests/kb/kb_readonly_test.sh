#!/usr/bin/env bash
# Readers never write (issue 15, items 6 and 7): `kb list`, `stats`, `groups`,
# `show`, `export`, `report` and `serve` open a knowledge base read-only.
#   * An empty file, someone else's SQLite database and a file that is not
#     SQLite are refused with a clear message and left byte for byte as they
#     were; no -wal/-shm appears beside them.
#   * A real knowledge base is read without changing a byte or leaving a file.
#   * A user who can read but not write the file (or its directory) can list
#     it; when that user can write the directory, the files it leaves do not
#     stop the owner's later writes. (As root, the other users are run with
#     setpriv; otherwise the same user reads a file and directory made
#     read-only, and the two-user part is skipped.)
# Usage: kb_readonly_test.sh OOMGUARD_BINARY TESTDATA_DIR
set -u
OG="$1"
DATA="$2"
PY=${OOMGUARD_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/scripts/python}  # the project's interpreter
T="$(mktemp -d)"
trap 'chmod -R u+w "$T" 2>/dev/null; rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
sums() { (cd "$1" && ls -A | sort && sha256sum -- * 2>/dev/null); }

readers() {  # every read command on one --db; prints "name rc" lines
  local db="$1"
  for cmd in "list" "stats" "groups" "export" "show p-frag"; do
    "$OG" kb $cmd --db "$db" > "$T/out" 2> "$T/err"
    echo "${cmd%% *} $?"
  done
  "$OG" kb report --db "$db" --html "$T/report-$(basename "$db").html" > /dev/null 2>> "$T/err"
  echo "report $?"
  # serve: prints "Serving URL" once the file is open, or exits 1.
  timeout 5 "$OG" kb serve --db "$db" --port 0 > "$T/serve.out" 2>> "$T/err" &
  local pid=$! i
  for i in $(seq 50); do
    grep -q Serving "$T/serve.out" 2>/dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
  done
  if grep -q Serving "$T/serve.out"; then
    kill $pid; wait $pid 2>/dev/null; echo "serve 0"
  else
    wait $pid; echo "serve $?"
  fi
}

# 1. Files that are not knowledge bases: refused, untouched.
mkdir "$T/odd"
: > "$T/odd/empty.db"
$PY -c 'import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute("create table users(name text)"); c.execute("insert into users values (\"ada\")"); c.commit()' "$T/odd/other.db"
head -c 5000 /dev/urandom > "$T/odd/noise.db"
before=$(sums "$T/odd")
for f in empty other noise; do
  "$OG" kb list --db "$T/odd/$f.db" > /dev/null 2> "$T/err"
  rc=$?
  [ $rc = 1 ] || fail "kb list of $f.db must exit 1, got $rc"
  grep -q "not an oomguard knowledge base" "$T/err" || fail "kb list of $f.db must say it is not a knowledge base: $(cat "$T/err")"
  readers "$T/odd/$f.db" | while read -r name rc; do
    [ "$rc" = 1 ] || echo "FAIL: kb $name of $f.db must exit 1, got $rc"
  done | grep FAIL && fails=$((fails + 1))
done
grep -q "empty (0 bytes)" <("$OG" kb stats --db "$T/odd/empty.db" 2>&1) || fail "the empty file is called empty"
grep -q "tables such as users" <("$OG" kb stats --db "$T/odd/other.db" 2>&1) || fail "someone else's database names its tables"
# Writing into someone else's database is refused too.
"$OG" kb import --db "$T/odd/other.db" "$DATA/patterns.jsonl" > /dev/null 2>&1 && fail "import into someone else's database must fail"
after=$(sums "$T/odd")
[ "$before" = "$after" ] || fail "refused files changed or gained companions: $before // $after"

# 2. A real knowledge base: every reader works, nothing changes, nothing is left.
mkdir "$T/real"
"$OG" kb import --db "$T/real/kb.db" "$DATA/patterns.jsonl" > /dev/null || fail "import"
before=$(sums "$T/real")
readers "$T/real/kb.db" | while read -r name rc; do
  [ "$rc" = 0 ] || echo "FAIL: kb $name of a real knowledge base must exit 0, got $rc"
done | grep FAIL && fails=$((fails + 1))
after=$(sums "$T/real")
[ "$before" = "$after" ] || fail "reading changed the knowledge base or left files: $before // $after"

# 3. A user who may read but not write.
mkdir "$T/shared"
"$OG" kb import --db "$T/shared/kb.db" "$DATA/patterns.jsonl" > /dev/null || fail "import (shared)"
as() { local u=$1; shift; setpriv --reuid="$u" --regid="$u" --clear-groups "$@"; }
owner=65534   # nobody owns the knowledge base ...
reader=54321  # ... and another user reads it
# The other users must be able to run the binary (a build under a private home may not let them).
if [ "$(id -u)" = 0 ] && command -v setpriv > /dev/null && as $reader "$OG" kb patterns > /dev/null 2>&1 \
   && as $owner "$OG" kb patterns > /dev/null 2>&1; then
  chown -R $owner:$owner "$T/shared"
  chmod 755 "$T/shared"; chmod 644 "$T/shared/kb.db"
  chmod 755 "$T"
  n=$(as $reader "$OG" kb list --db "$T/shared/kb.db" --json --limit 0 2> "$T/err" | $PY -c 'import json,sys; print(len(json.load(sys.stdin)))')
  [ "$n" = 10 ] || fail "a reader without write access lists 10 incidents, got '$n': $(cat "$T/err")"
  # The reader may write the directory: it must still leave nothing behind ...
  chmod 1777 "$T/shared"
  as $reader "$OG" kb stats --db "$T/shared/kb.db" > /dev/null 2> "$T/err" || fail "stats as a reader: $(cat "$T/err")"
  as $reader "$OG" kb export --db "$T/shared/kb.db" > /dev/null 2> "$T/err" || fail "export as a reader: $(cat "$T/err")"
  left=$(ls -A "$T/shared")
  [ "$left" = "kb.db" ] || fail "a reader left files: $left"
  # ... so that the owner's writes keep working.
  head -n 2 "$DATA/patterns.jsonl" | sed 's/"id": *"p-/"id": "q-/' > "$T/more.jsonl"
  chmod 644 "$T/more.jsonl"
  as $owner "$OG" kb import --db "$T/shared/kb.db" "$T/more.jsonl" > /dev/null 2> "$T/err" \
    || fail "the owner's write after a reader: $(cat "$T/err")"
  # A -shm another user left (an older reader did) is named, not a silent loss.
  as $reader touch "$T/shared/kb.db-shm" "$T/shared/kb.db-wal"
  as $owner "$OG" kb import --db "$T/shared/kb.db" "$T/more.jsonl" > /dev/null 2> "$T/err" \
    && fail "the owner's write with another user's -wal/-shm must fail"
  grep -q "not writable by this user" "$T/err" || fail "say whose files are in the way: $(cat "$T/err")"
else
  chmod 444 "$T/shared/kb.db"; chmod 555 "$T/shared"
  n=$("$OG" kb list --db "$T/shared/kb.db" --json --limit 0 2> "$T/err" | $PY -c 'import json,sys; print(len(json.load(sys.stdin)))')
  [ "$n" = 10 ] || fail "listing a read-only file in a read-only directory gives 10 incidents, got '$n': $(cat "$T/err")"
  chmod 755 "$T/shared"
  echo "note: not root (or other users cannot run $OG); the two-user part of this test is skipped"
fi

if [ $fails -ne 0 ]; then
  echo "$fails failure(s)"
  exit 1
fi
echo "ok: readers never write"
