#!/usr/bin/env python3
"""`oomguard kb serve` over 100,000 incidents, measured over HTTP, on an SQLite
file and on a PostgreSQL server (issue 26): how long from the start of the
process to the first page, then the page's requests (first page, a deep page,
a filtered page, a text search, groups, stats, runs, one run, one incident and
its similar cases), each answered by the store (no load into memory).

  bench/kb_serve_http_bench.py [BUILD_DIR] [--n 100000] [--work DIR]

--work DIR keeps the SQLite file and the server's data there and reuses them
on the next run (the imports take minutes).

Starts its own PostgreSQL (tests/kb/pg_server.sh) and prints a Markdown
section for bench/RESULTS.md on stdout.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PG = os.path.join(ROOT, "tests", "kb", "pg_server.sh")


def incidents(n):
    """n incidents of 8 hosts, runs of 500, 7 workloads, memory that classifies into several patterns."""
    rnd = random.Random(26)
    for k in range(n):
        w = k % 8
        total = 16 << 30
        allocated = (8 + k % 7) << 30
        frag = (4 << 30) if k % 5 == 0 else 0
        yield {
            "id": "h%07d" % k,
            "run_id": "run-%d-%d" % (w, k // 4000),
            "time_unix_ms": 1_700_000_000_000 + k * 1000,
            "host": "host%d" % w,
            "rank": w,
            "step": k // 8,
            "phase": "forward" if k % 3 == 0 else "backward",
            "kind": "device",
            "workload": "bench-%d" % (k % 7),
            "requested_bytes": 1 << (20 + k % 10),
            "outcome": ("recovered", "recovered", "rolled_back", "failed")[k % 4],
            "message": "CUDA out of memory. Tried to allocate %d MiB (case %d)" % (1 << (k % 10), rnd.randrange(1000)),
            "memory": {"total": total, "allocated": allocated, "reserved": allocated + frag + (1 << 30),
                       "free": total - allocated - frag - (1 << 30), "inactive_split": frag},
            "history": {"steps_ok_before": 40 + k % 100, "step_peaks": [9 << 30] * 8},
        }


class Serve:
    def __init__(self, oomguard, db):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([oomguard, "kb", "serve", "--port", "0", "--db", db],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("Serving "):
            raise RuntimeError("kb serve did not start: %r %s" % (line, self.proc.stderr.read()))
        self.url = line.split()[1].rstrip("/")

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=120) as r:
            body = r.read()
            if r.status != 200:
                raise RuntimeError("%s: %d" % (path, r.status))
            return json.loads(body)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def ms(f):
    t = time.monotonic()
    out = f()
    return (time.monotonic() - t) * 1000, out


def measure(oomguard, db, runs=5):
    res = {}
    # Cold: the process starts, answers its first page, then its first groups and stats
    # (read from the store, then kept until the store changes). Median of 3 starts.
    starts, cold_groups, cold_stats = [], [], []
    for _ in range(3):
        s = Serve(oomguard, db)
        try:
            s.get("/api/incidents?limit=50")
            starts.append((time.monotonic() - s.t0) * 1000)
            cold_stats.append(ms(lambda: s.get("/api/stats"))[0])
            cold_groups.append(ms(lambda: s.get("/api/groups"))[0])
        finally:
            s.close()
    res["start to first page"] = statistics.median(starts)
    res["stats, first after start (read from the store)"] = statistics.median(cold_stats)
    res["groups, first after start"] = statistics.median(cold_groups)
    s = Serve(oomguard, db)
    try:
        total = s.get("/api/incidents?limit=1")["total"]
        some = s.get("/api/incidents?limit=1&offset=%d" % (total // 3))["items"][0]
        paths = [
            ("first page (50, newest first)", "/api/incidents?limit=50"),
            ("deep page (offset %d)" % (total // 2), "/api/incidents?limit=50&offset=%d" % (total // 2)),
            ("filtered page (workload)", "/api/incidents?limit=50&workload=bench-3"),
            ("filtered deep page (workload, offset 5000)", "/api/incidents?limit=50&workload=bench-3&offset=5000"),
            ("filtered page (pattern + rank)", "/api/incidents?limit=50&pattern=%s&rank=3" % some["pattern"]),
            ("text search (q, no index: reads every row's text)", "/api/incidents?limit=50&q=case+917"),
            ("groups (cached until the store changes)", "/api/groups"),
            ("groups filtered (workload)", "/api/groups?workload=bench-3"),
            ("stats (cached until the store changes)", "/api/stats"),
            ("runs", "/api/runs"),
            ("one run's timeline", "/api/runs/" + some["run_id"]),
            ("one incident", "/api/incidents/" + some["id"]),
            ("similar incidents of one", "/api/incidents/%s/similar" % some["id"]),
        ]
        for name, path in paths:
            s.get(path)
            res[name] = statistics.median(ms(lambda: s.get(path))[0] for _ in range(runs))
    finally:
        s.close()
    return total, res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build", nargs="?", default=os.path.join(ROOT, "build"))
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    oomguard = os.path.join(a.build, "bin", "oomguard")
    tmp = a.work or tempfile.mkdtemp(prefix="oomguard-serve-bench-", dir="/tmp")
    os.makedirs(tmp, exist_ok=True)
    os.chmod(tmp, 0o711)  # the server runs as nobody under root
    pg = os.path.join(tmp, "pg")
    t_lite = t_pg = 0
    try:
        lite = os.path.join(tmp, "bench.db")
        if not os.path.exists(lite):
            jsonl = os.path.join(tmp, "incidents.jsonl")
            with open(jsonl, "w") as f:
                for i in incidents(a.n):
                    f.write(json.dumps(i) + "\n")
            t_lite = ms(lambda: subprocess.run([oomguard, "kb", "import", "--db", lite, jsonl], check=True,
                                               stdout=subprocess.DEVNULL))[0]
        fresh = not os.path.exists(os.path.join(pg, "data"))
        url = subprocess.run([PG, "start" if fresh else "restart", pg], check=True, text=True,
                             capture_output=True, timeout=120).stdout.strip()
        if not fresh:
            url = subprocess.run([PG, "url", pg], check=True, text=True, capture_output=True,
                                 timeout=60).stdout.strip()
        if fresh:
            # The same incidents as classified into the file (kb import --from copies them as stored).
            t_pg = ms(lambda: subprocess.run([oomguard, "kb", "import", "--db", url, "--from", lite], check=True,
                                             stdout=subprocess.DEVNULL))[0]
        n_lite, lite_res = measure(oomguard, lite)
        n_pg, pg_res = measure(oomguard, url)
    finally:
        subprocess.run([PG, "stop", pg], capture_output=True, timeout=120)
        if not a.work:
            shutil.rmtree(tmp, ignore_errors=True)
    print("## kb serve over %d incidents, over HTTP (issue 26)\n" % n_lite)
    print("`oomguard kb serve` answers every request with the store's SQL (no load into memory);")
    print("bench/kb_serve_http_bench.py, one run, median of 5 requests (3 starts for the first rows), ms,")
    print("client and server on the same machine.")
    if t_lite and t_pg:
        print("Import of the %d incidents: into SQLite from JSONL (classified) %.0f s, copied into PostgreSQL"
              % (n_lite, t_lite / 1000))
        print("(kb import --from) %.0f s." % (t_pg / 1000))
    print()
    print("| request | SQLite | PostgreSQL |\n|---|---:|---:|")
    for k in lite_res:
        print("| %s | %.1f | %.1f |" % (k, lite_res[k], pg_res[k]))
    print()
    return 0 if n_lite == n_pg == a.n else 1


if __name__ == "__main__":
    sys.exit(main())
