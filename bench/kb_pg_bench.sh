#!/usr/bin/env bash
# Runs bench/kb_pg_bench.cc against a PostgreSQL server started for it
# (tests/kb/pg_server.sh) and prints its Markdown section.
#   bench/kb_pg_bench.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
T=$(mktemp -d /tmp/oomguard-pg-bench-XXXXXX)
chmod 711 "$T"  # the server runs as nobody under root
trap '"$root/tests/kb/pg_server.sh" stop "$T/pg" >/dev/null 2>&1 || true; rm -rf "$T"' EXIT
url=$("$root/tests/kb/pg_server.sh" start "$T/pg")
OOMGUARD_LOG_LEVEL=off "$build/bin/kb_pg_bench" "$url" "$T"
