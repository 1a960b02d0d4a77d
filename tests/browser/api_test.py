#!/usr/bin/env python3
"""`oomguard kb serve` over real HTTP on 127.0.0.1: the JSON API, errors, limits, metrics, reloads, stop.

Usage: api_test.py OOMGUARD_BINARY"""
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_fixture as fx  # noqa: E402

FAILS = []


def check(cond, what):
    if not cond:
        FAILS.append(what)
        print("FAIL:", what)


def raw(server, data, read=65536):
    """Sends raw bytes on a fresh connection; returns what comes back before the server closes."""
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(data)
        out = b""
        try:
            while len(out) < read:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return out


def main():
    og = sys.argv[1]
    tmp = tempfile.mkdtemp()
    try:
        dbs = fx.default_dbs(og, tmp) + [fx.xss_db(og, tmp)]
        with fx.Server(og, dbs) as s:
            check(s.host == "127.0.0.1", "binds loopback by default: %s" % s.url)

            # Listing: totals, paging, newest first, filters shared with the CLI.
            page = s.json("/api/incidents")
            check(page["total"] == 18 and len(page["items"]) == 18, "18 incidents: %d" % page["total"])
            times = [i["time_unix_ms"] for i in page["items"]]
            check(times == sorted(times, reverse=True), "newest first")
            p2 = s.json("/api/incidents?limit=5&offset=5")
            check([i["id"] for i in p2["items"]] == [i["id"] for i in page["items"][5:10]], "offset/limit page")
            check(p2["total"] == 18 and p2["limit"] == 5 and p2["offset"] == 5, "page header %r" % {k: p2[k] for k in ("total", "limit", "offset")})
            f = s.json("/api/incidents?pattern=fragmentation")
            check(f["total"] == 1 and f["items"][0]["id"] == "p-frag", "pattern filter")
            r = s.json("/api/incidents?run=run-7f3a&rank=3")
            check([i["id"] for i in r["items"]] == ["run7f3a-03"], "run+rank filter: %r" % [i["id"] for i in r["items"]])
            q = s.json("/api/incidents?q=BAD_ALLOC")
            check([i["id"] for i in q["items"]] == ["runb21c-00"], "case-insensitive text search")
            q = s.json("/api/incidents?q=" + "%3Cscript%3E")
            check([i["id"] for i in q["items"]] == ["xss-00000001"], "search finds markup as text")
            check(s.json("/api/incidents?since=1h")["total"] == 0, "since=1h: the test data is from 2024")
            check(s.json("/api/incidents?since=2024-05-01")["total"] == 8, "since a date")

            # One incident, runs, groups, patterns, stats.
            one = s.json("/api/incidents/p-frag")
            check(one["pattern"] == "fragmentation" and one["memory"]["inactive_split"] > 0, "incident by id")
            check(one["remedies"] and one["evidence"], "incident carries evidence and remedies")
            xss = s.json("/api/incidents/xss-00000001")
            check(xss["message"] == fx.XSS_MESSAGE, "JSON keeps the message byte for byte")
            runs = s.json("/api/runs")
            check([x["run_id"] for x in runs] == ["run-xss", "run-b21c", "run-7f3a"], "runs: %r" % [x["run_id"] for x in runs])
            tl = s.json("/api/runs/run-7f3a")
            check([p["step"] for p in tl["points"]] == [120, 410, 905, 1500, 2210], "timeline by step")
            check([(p["micro_before"], p["micro_after"]) for p in tl["points"]][0] == (32, 16), "timeline sizes")
            groups = s.json("/api/groups")
            check(sum(g["count"] for g in groups) == 18, "groups cover every incident")
            check(len(s.json("/api/groups?pattern=gradual_growth")) >= 1, "groups take filters")
            pats = s.json("/api/patterns")
            check(len(pats) == 14 and all(p["remedies"] for p in pats), "catalogue of 14")
            check({p["name"]: p["count"] for p in pats}["gradual_growth"] == 6, "pattern counts")
            st = s.json("/api/stats")
            check(st["incidents"] == 18 and len(st["files"]) == 2, "stats over two files")
            check({x["name"]: x["count"] for x in st["by_outcome"]}.get("failed") == 1, "stats by outcome")

            # Errors: JSON, right status, naming the parameter.
            for path, code, needle in [
                ("/api/incidents?rank=abc", 400, "rank"),
                ("/api/incidents?limit=0", 400, "limit"),
                ("/api/incidents?limit=100000", 400, "limit"),
                ("/api/incidents?offset=-1", 400, "offset"),
                ("/api/incidents?since=yesterday", 400, "since"),
                ("/api/incidents?colour=red", 400, "colour"),
                ("/api/incidents?q=" + "x" * 300, 400, "q"),
                ("/api/incidents?q=%zz", 400, "percent"),
                ("/api/incidents?pattern=a&pattern=b", 400, "pattern"),
                ("/api/incidents/nope", 404, "nope"),
                ("/api/runs/nope", 404, "nope"),
                ("/api/nothing", 404, "/api/nothing"),
                ("/etc/passwd", 404, "no such path"),
                ("/../../etc/passwd", 404, "no such path"),
                ("/%2e%2e/%2e%2e/etc/passwd", 404, "no such path"),
                ("/app.js/../../CMakeLists.txt", 404, "no such path"),
                ("/api/stats?x=1", 400, "x"),
                ("/" + "a" * 5000, 414, "longer"),
            ]:
                status, headers, body = s.get(path)
                ok = status == code
                try:
                    err = json.loads(body)["error"]
                except Exception:
                    err, ok = body[:80], False
                check(ok and needle in err, "%s -> %d %r (want %d naming %r)" % (path[:60], status, err, code, needle))
            status, headers, _ = s.get("/api/stats", method="POST")
            check(status == 405 and "GET" in headers.get("Allow", ""), "POST is 405 with Allow")
            # Notes: readable by anyone, written only by a server given a token (this one has none).
            status, _, body = s.get("/api/notes/0123456789abcdef?text=x", method="POST",
                                    headers={"Authorization": "Bearer whatever-token-here"})
            check(status == 403 and b"notes-token-file" in body, "a note POST without a token configured is 403: %r" % body)
            check(s.json("/api/notes") == {}, "no notes yet")
            status, _, _ = s.get("/api/notes/0123456789abcdef")
            check(status == 404, "an unknown group's note is 404")
            status, headers, body = s.get("/api/incidents", method="HEAD")
            check(status == 200 and body == b"" and int(headers["Content-Length"]) > 100, "HEAD: headers, no body")

            # Page and headers.
            status, headers, body = s.get("/")
            check(status == 200 and b'<script type="module" src="/app.js">' in body, "the page")
            csp = headers.get("Content-Security-Policy", "")
            check("script-src 'self'" in csp and "default-src 'none'" in csp, "CSP: %s" % csp)
            check(headers.get("X-Content-Type-Options") == "nosniff", "nosniff")
            status, headers, body = s.get("/app.js")
            check(status == 200 and headers["Content-Type"].startswith("text/javascript"), "app.js")
            check(re.search(rb"\.(inner|outer)HTML\s*=|insertAdjacentHTML\(|document\.write\(", body) is None,
                  "the script never writes markup from strings")

            # Raw HTTP: limits and hostile requests.
            big = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"a" * 20000 + b"\r\n\r\n"
            check(raw(s, big).startswith(b"HTTP/1.1 431"), "oversized header is 431")
            body = b"GET /api/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello"
            check(raw(s, body).startswith(b"HTTP/1.1 400"), "a request body is refused")
            rebind = b"GET /api/stats HTTP/1.1\r\nHost: evil.example:80\r\nConnection: close\r\n\r\n"
            check(raw(s, rebind).startswith(b"HTTP/1.1 421"), "foreign Host header on loopback is refused")
            check(raw(s, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400"), "garbage is 400")
            # Host header (issue 15, item 10): RFC 9112 wants 400 for several or,
            # in HTTP/1.1, none; host names are case-insensitive; HTTP/1.0 may omit it.
            for head, want in [
                (b"Host: 127.0.0.1\r\nHost: evil.example\r\n", b"HTTP/1.1 400"),
                (b"Host: localhost\r\nHost: localhost\r\n", b"HTTP/1.1 400"),
                (b"", b"HTTP/1.1 400"),
                (b"Host: LOCALHOST\r\n", b"HTTP/1.1 200"),
                (b"Host: LocalHost:%d\r\n" % s.port, b"HTTP/1.1 200"),
            ]:
                got = raw(s, b"GET /api/stats HTTP/1.1\r\n" + head + b"Connection: close\r\n\r\n")
                check(got.startswith(want), "%r -> %r (want %r)" % (head, got[:12], want))
            got = raw(s, b"GET /api/stats HTTP/1.0\r\n\r\n")
            check(got.startswith(b"HTTP/1.0 200"), "HTTP/1.0 without Host is served: %r" % got[:12])

            # Slow clients (issue 15, item 11): more connections trickling their
            # headers than the server keeps open must not lock a new client out.
            slow = []
            for _ in range(130):
                c = socket.create_connection((s.host, s.port), timeout=10)
                c.sendall(b"GET /api/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
                slow.append(c)
            t0 = time.time()
            got = raw(s, b"GET /api/stats HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            check(got.startswith(b"HTTP/1.1 200") and time.time() - t0 < 3,
                  "a new client is served beside 130 slow ones: %r after %.1f s" % (got[:12], time.time() - t0))
            for c in slow:
                c.close()

            two = (b"GET /api/stats HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                   b"GET /api/patterns HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            check(raw(s, two).count(b"HTTP/1.1 200") == 2, "keep-alive: two requests on one connection")

            # Prometheus text format.
            status, headers, body = s.get("/metrics")
            text = body.decode()
            check(status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4"), "metrics type")
            check("# TYPE oomguard_incidents_by_pattern_total counter" in text, "TYPE line")
            check("# HELP oomguard_last_recovery_seconds" in text, "HELP line")
            check('oomguard_incidents_by_pattern_total{pattern="gradual_growth"} 6' in text, "by pattern")
            check('oomguard_incidents_by_kind_total{kind="host"} 2' in text, "by kind")
            check('oomguard_incidents_by_rank_total{rank="3"} ' in text, "by rank")
            check(re.search(r"^oomguard_last_recovery_seconds 0\.00125$", text, re.M) is not None, "last recovery (xss incident, 1.25 ms)")
            for line in text.splitlines():
                if line and not line.startswith("#"):
                    check(re.match(r'^[a-z_]+(\{[a-z_]+="(?:[^"\\]|\\.)*"\})? [-0-9.e+]+$', line) is not None, "sample syntax: " + line)

            # A new incident written while serving shows up after a reload.
            fx.import_jsonl(og, dbs[-1], fx.PATTERNS_JSONL)
            deadline = time.time() + 5
            while time.time() < deadline and s.json("/api/stats")["incidents"] != 28:
                time.sleep(0.1)
            check(s.json("/api/stats")["incidents"] == 28, "reload after the file changed")

            # A file replaced atomically (mv new.db kb.db, as rsync and scp do) is
            # another inode: the server notices and reads the new file (issue 15, item 8).
            replacement = os.path.join(tmp, "replacement.db")
            fx.import_jsonl(og, replacement, fx.XSS_JSONL)
            # As with any SQLite file, replace it only with no -wal beside it: a
            # -wal left there belongs to the old file. The writer above removes
            # its -wal on close, unless a reload of the server read at that very
            # moment; then a writer that opens and closes it removes it.
            if os.path.exists(dbs[-1] + "-wal"):
                fx.import_jsonl(og, dbs[-1], os.devnull)
            check(not os.path.exists(dbs[-1] + "-wal"), "no -wal is left beside the served file")
            os.replace(replacement, dbs[-1])
            deadline = time.time() + 5
            while time.time() < deadline and s.json("/api/stats")["incidents"] != 18:
                time.sleep(0.1)
            check(s.json("/api/stats")["incidents"] == 18,
                  "reload after the file was replaced: %d incidents" % s.json("/api/stats")["incidents"])

            rc = s.stop()
            check(rc == 0, "SIGTERM stops the server with exit code 0 (got %r)" % rc)

        # Bad arguments.
        import subprocess
        r = subprocess.run([og, "kb", "serve", "--db", os.path.join(tmp, "missing.db"), "--port", "0"],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode == 1 and "no such file" in r.stderr, "missing db: %r" % r.stderr)
        r = subprocess.run([og, "kb", "serve", "--db", dbs[0], "--bind", "not-an-ip", "--port", "0"],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode == 1 and "--bind" in r.stderr, "bad --bind: %r" % r.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if FAILS:
        print("%d failure(s)" % len(FAILS))
        sys.exit(1)
    print("kb serve API: all checks passed")


if __name__ == "__main__":
    main()
