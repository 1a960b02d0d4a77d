#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests, from Debian's packages
# (postgresql: /usr/lib/postgresql/<version>/bin), in a directory of its own:
# its data, its log and its Unix socket (no TCP port), trust authentication
# for the superuser `oomguard`, and a database `oomguard`.
#
#   pg_server.sh start DIR     creates DIR, initdb, starts; prints the URL
#   pg_server.sh restart DIR   stops (immediate: like a crash) and starts again
#   pg_server.sh stop DIR      stops it (fast); the data stays in DIR
#   pg_server.sh url DIR       prints the URL
#
# PostgreSQL refuses to run as root: as root the server runs as `nobody`
# (DIR is made theirs); as anyone else, as that user. The caller removes DIR.
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|restart|stop|url DIR" >&2
  exit 2
fi

bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
  echo "pg_server.sh: no PostgreSQL server under /usr/lib/postgresql/*/bin (scripts/install-deps installs it)" >&2
  exit 1
fi

as_owner() {
  if [ "$(id -u)" -eq 0 ]; then
    setpriv --reuid=nobody --regid=nogroup --clear-groups --reset-env -- "$@"
  else
    "$@"
  fi
}

url() { echo "postgresql://oomguard@/oomguard?host=$dir"; }

start() {
  # -w: wait until it accepts connections (bounded by -t).
  as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-k $dir -c listen_addresses='' -c fsync=off -c full_page_writes=off -c max_connections=60" start >/dev/null
}

case "$cmd" in
  start)
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [ "$(id -u)" -eq 0 ]; then
      chown nobody:nogroup "$dir"
      if ! as_owner test -x "$dir"; then
        echo "pg_server.sh: $dir is not reachable by nobody (the server's user as root); use a directory under /tmp" >&2
        exit 1
      fi
    fi
    chmod 700 "$dir"
    as_owner "$bin/initdb" -D "$dir/data" -U oomguard --auth=trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 || {
      cat "$dir/initdb.log" >&2
      exit 1
    }
    start || { cat "$dir/server.log" >&2; exit 1; }
    as_owner "$bin/createdb" -h "$dir" -U oomguard oomguard
    url
    ;;
  restart)
    dir=$(cd "$dir" && pwd)
    if [ -f "$dir/data/postmaster.pid" ]; then
      as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null
    fi
    start || { cat "$dir/server.log" >&2; exit 1; }
    ;;
  stop)
    dir=$(cd "$dir" && pwd)
    if [ -f "$dir/data/postmaster.pid" ]; then
      as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null
    fi
    ;;
  url)
    dir=$(cd "$dir" && pwd)
    url
    ;;
  *)
    echo "pg_server.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
