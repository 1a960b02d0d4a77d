#!/usr/bin/env python3
"""Headless Chromium loads the knowledge-base browser and the test asserts the rendered DOM.

Usage: browser_test.py --oomguard BIN [--db PATH ...] [--pg-server SCRIPT] [--artifacts DIR] [--chromium PATH]

--pg-server (tests/kb/pg_server.sh) starts a PostgreSQL server for the test and browses the test data
imported into it (a postgresql:// --db) beside the XSS incident's SQLite file: every view as on SQLite.

--db (repeatable) is the knowledge base to browse, e.g. one that mlp_train wrote; without it the
test imports tests/kb/testdata/patterns.jsonl and testdata/runs.jsonl. Either way a second file
with an XSS incident is served beside it. Expectations are read from the API, so any knowledge
base works. Exits 77 (ctest SKIP_RETURN_CODE) when Chromium is not installed."""
import argparse
import json
import html.parser
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_fixture as fx  # noqa: E402

SKIP = 77
FAILS = []


def check(cond, what):
    if not cond:
        FAILS.append(what)
        print("FAIL:", what)


class Dom(html.parser.HTMLParser):
    """Just enough of a DOM: every element with its attributes, and the text under id'd elements."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.elements = []  # (tag, attrs dict)
        self.text_by_id = {}
        self._open = []  # ids being collected
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elements.append((tag, a))
        if tag not in ("br", "img", "input", "meta", "link", "circle", "rect", "line", "polyline"):
            self._open.append(a.get("id"))
            if a.get("id"):
                self.text_by_id[a["id"]] = ""

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for i in self._open:
            if i:
                self.text_by_id[i] += data

    def count(self, tag, cls=None):
        return sum(1 for t, a in self.elements
                   if t == tag and (cls is None or cls in (a.get("class") or "").split()))


def chromium(browser, profile, url, *args):
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--user-data-dir=" + profile,
           "--virtual-time-budget=5000"] + list(args) + [url]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        # A page that opened a dialog (alert) never finishes loading headless.
        FAILS.append("chromium hung on " + url + " (did a script open a dialog?)")
        print("FAIL:", FAILS[-1])
        return ""
    if r.returncode != 0:
        raise RuntimeError("chromium failed (%d): %s" % (r.returncode, r.stderr[-2000:]))
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oomguard", required=True)
    ap.add_argument("--db", action="append", default=[])
    ap.add_argument("--artifacts", default=None)
    ap.add_argument("--chromium", default=None)
    ap.add_argument("--pg-server", default=None)
    a = ap.parse_args()
    browser = a.chromium or shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not browser or not os.access(browser, os.X_OK):
        print("SKIP: Chromium is not installed (apt-get install chromium, or scripts/install-deps)")
        return SKIP

    tmp = tempfile.mkdtemp()
    profile = tempfile.mkdtemp()
    artifacts = a.artifacts or os.path.join(tmp, "artifacts")
    os.makedirs(artifacts, exist_ok=True)
    pg_dir = None
    try:
        if a.pg_server:
            pg_dir = tempfile.mkdtemp(prefix="oomguard-pg-browser-", dir="/tmp")
            os.chmod(pg_dir, 0o711)  # the server runs as nobody when the tests run as root
            url = subprocess.run([a.pg_server, "start", os.path.join(pg_dir, "pg")], check=True, text=True,
                                 capture_output=True, timeout=120).stdout.strip()
            fx.import_jsonl(a.oomguard, url, fx.PATTERNS_JSONL, fx.RUNS_JSONL)
            a.db = [url]
        dbs = (a.db or fx.default_dbs(a.oomguard, tmp)) + [fx.xss_db(a.oomguard, tmp)]
        token = "browser-test-token-0123456789"
        token_file = os.path.join(tmp, "notes.token")
        with open(token_file, "w") as f:
            f.write(token + "\n")
        # Several stores and the token: where notes go must be named (--notes-db).
        args = [a.oomguard, "kb", "serve", "--port", "0", "--notes-token-file", token_file]
        for db in dbs:
            args += ["--db", db]
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
        check(r.returncode != 0 and "--notes-db" in r.stderr,
              "two stores and a token without --notes-db are refused: %d %r" % (r.returncode, r.stderr[-300:]))
        with fx.Server(a.oomguard, dbs, extra=["--notes-token-file", token_file, "--notes-db", dbs[0]]) as s:
            stats = s.json("/api/stats")
            total = stats["incidents"]

            # 0. Pages, filters and counts come from the stores (SQL per request, merged over the
            # two stores): pages of 7 put together are the one long page; a filtered total is the
            # pattern's count; the groups add up to the total.
            everything = s.json("/api/incidents?limit=1000")
            check(everything["total"] == total and len(everything["items"]) == total,
                  "one page of everything: %d of %d" % (len(everything["items"]), total))
            pieced = []
            for off in range(0, total, 7):
                page = s.json("/api/incidents?limit=7&offset=%d" % off)
                check(page["total"] == total, "paged total %d, want %d" % (page["total"], total))
                pieced += [i["id"] for i in page["items"]]
            check(pieced == [i["id"] for i in everything["items"]], "pages of 7 are the long page, in order")
            for row in stats["by_pattern"]:
                got = s.json("/api/incidents?limit=1&pattern=" + row["name"])["total"]
                check(got == row["count"], "filtered total of %s: %d, want %d" % (row["name"], got, row["count"]))
            groups = s.json("/api/groups")
            check(sum(g["count"] for g in groups) == total and len(groups) == stats["groups"],
                  "groups add up: %d in %d groups" % (sum(g["count"] for g in groups), len(groups)))
            hits = s.json("/api/incidents?limit=1000&q=ONERROR")
            check(hits["total"] == 1 and hits["items"][0]["id"] == "xss-00000001",
                  "search is case-insensitive, server-side: %r" % [i["id"] for i in hits["items"]])

            # 1. The incident table and the per-pattern summary chart.
            dom = Dom(chromium(browser, profile, s.url, "--dump-dom"))
            check(dom.count("tr", "incident-row") == min(total, 50),
                  "rows: %d, want %d" % (dom.count("tr", "incident-row"), min(total, 50)))
            bars = sum(1 for r in stats["by_pattern"] if r["count"] > 0)
            check(dom.count("svg", "chart-patterns") == 1 and dom.count("rect", "bar") == bars,
                  "pattern chart bars: %d, want %d" % (dom.count("rect", "bar"), bars))
            check("of %d" % total in dom.text_by_id.get("total", "").replace(",", ""),
                  "pager says the total: %r" % dom.text_by_id.get("total"))
            chromium(browser, profile, s.url, "--screenshot=" + os.path.join(artifacts, "browser.png"),
                     "--window-size=1400,1000", "--hide-scrollbars")

            # 1b. The second page, as the pager's "older" link asks for it.
            if total > 50:
                dom = Dom(chromium(browser, profile, s.url + "#/?offset=50", "--dump-dom"))
                check(dom.count("tr", "incident-row") == min(total - 50, 50),
                      "second page rows: %d, want %d" % (dom.count("tr", "incident-row"), min(total - 50, 50)))
                check(dom.text_by_id.get("total", "").startswith("51"),
                      "the pager of page 2: %r" % dom.text_by_id.get("total"))

            # 2. A filtered table (the hash carries the filter, as the page's own controls set it).
            top = stats["by_pattern"][0]
            dom = Dom(chromium(browser, profile, s.url + "#/?pattern=" + top["name"], "--dump-dom"))
            check(dom.count("tr", "incident-row") == min(top["count"], 50), "filtered rows for %s" % top["name"])

            # 3. An incident's detail: memory bars, step peaks, ranks, diagnosis, ladder, run timeline.
            items = s.json("/api/incidents?limit=1000")["items"]
            rich = sorted(items, key=lambda i: (len(i.get("ranks", [])) > 0, len(i["history"]["step_peaks"]) > 0,
                                                bool(i["run_id"]), i["memory"]["total"] > 0), reverse=True)[0]
            # The team's note on its group: written through the API with the token (as the page's
            # form does), refused without it, shown on the incident after the next reload.
            note_path = "/api/notes/%s?text=%s&author=ci" % (rich["fingerprint"], "fixed+by+expandable_segments")
            status, _, _ = s.get(note_path, method="POST", headers={"Authorization": "Bearer wrong-token-0123456789"})
            check(status == 401, "a note with a wrong token is 401, got %d" % status)
            status, _, body = s.get(note_path, method="POST", headers={"Authorization": "Bearer " + token})
            check(status == 200, "a note with the token is written: %d %r" % (status, body[:200]))
            for _ in range(100):
                if s.get("/api/notes/" + rich["fingerprint"])[0] == 200:
                    break
                time.sleep(0.1)
            # The note went to the store named by --notes-db (the first), not beside it.
            noted = json.loads(subprocess.run([a.oomguard, "kb", "groups", "--json", "--db", dbs[0]], check=True,
                                              capture_output=True, text=True, timeout=60).stdout)
            check(any(g["fingerprint"] == rich["fingerprint"] and (g.get("note") or {}).get("text") ==
                      "fixed by expandable_segments" for g in noted), "the note is in --notes-db's store")
            dom = Dom(chromium(browser, profile, s.url + "#/incident/" + rich["id"], "--dump-dom"))
            check(dom.text_by_id.get("team-note") == "fixed by expandable_segments",
                  "the team note on the incident: %r" % dom.text_by_id.get("team-note"))
            check(dom.count("form", "note-form") == 1 and dom.count("input") >= 3, "the note form is there")
            check(dom.count("svg", "chart-memory") == 1, "memory chart present")
            mem = rich["memory"]
            want_segments = sum(1 for v in (mem["allocated"], max(mem["reserved"], mem["allocated"]) - mem["allocated"],
                                            max(0, mem["total"] - max(mem["reserved"], mem["allocated"]) - mem["free"])
                                            if mem["total"] else 0, mem["free"]) if v > 0)
            segs = sum(dom.count("rect", c) for c in ("allocated", "cached", "outside", "free"))
            check(segs == want_segments, "memory segments: %d, want %d" % (segs, want_segments))
            peaks = rich["history"]["step_peaks"]
            check(dom.count("circle", "point") == len(peaks), "step-peak points: %d, want %d" % (dom.count("circle", "point"), len(peaks)))
            check(dom.count("rect", "rank-bar") == len(rich.get("ranks", [])),
                  "rank bars: %d, want %d" % (dom.count("rect", "rank-bar"), len(rich.get("ranks", []))))
            rungs = rich["actions"] or ([rich["action"]] if rich["action"] else [])
            check(dom.count("li", "rung") == len(rungs), "ladder rungs: %d, want %d" % (dom.count("li", "rung"), len(rungs)))
            check(dom.text_by_id.get("evidence", "") == (rich["evidence"] or "No evidence recorded."), "evidence shown")
            check(dom.count("ol", "remedies") == (1 if rich["remedies"] else 0), "remedies list")
            if rich["run_id"]:
                run = s.json("/api/runs/" + rich["run_id"])
                check(dom.count("svg", "chart-timeline") == 1 and dom.count("circle", "oom") == len(run["points"]),
                      "timeline OOM marks: %d, want %d" % (dom.count("circle", "oom"), len(run["points"])))
                check(dom.count("circle", "current") == 1, "the open incident is marked on its run")
            chromium(browser, profile, s.url + "#/incident/" + rich["id"],
                     "--screenshot=" + os.path.join(artifacts, "browser-detail.png"), "--window-size=1400,1800",
                     "--hide-scrollbars")

            # 4. The XSS incident: its text on screen, no element injected.
            for view in ("#/incident/xss-00000001", "#/?q=onerror"):
                dom = Dom(chromium(browser, profile, s.url + view, "--dump-dom"))
                check(dom.count("img") == 0, view + ": an <img> was injected")
                scripts = [at for t, at in dom.elements if t == "script"]
                check(scripts == [{"type": "module", "src": "/app.js"}], view + ": scripts in the DOM: %r" % scripts)
                check(dom.count("svg") == sum(1 for t, at in dom.elements if t == "svg" and "chart" in (at.get("class") or "")),
                      view + ": an <svg> not drawn by the page")
                check(not any(k.startswith("on") for t, at in dom.elements for k in at), view + ": an on* attribute")
            dom = Dom(chromium(browser, profile, s.url + "#/incident/xss-00000001", "--dump-dom"))
            check(dom.text_by_id.get("message") == fx.XSS_MESSAGE, "payload shown as text: %r" % dom.text_by_id.get("message"))
            dom = Dom(chromium(browser, profile, s.url + "#/?q=onerror", "--dump-dom"))
            check(dom.count("tr", "incident-row") == 1, "search for the payload finds its row")

            # 5. Unknown incident: an error view, not a blank page.
            dom = Dom(chromium(browser, profile, s.url + "#/incident/does-not-exist", "--dump-dom"))
            check("does-not-exist" in dom.text_by_id.get("error", ""), "unknown id explained: %r" % dom.text_by_id.get("error"))

        # 6. The self-contained report: same views from a file, no server.
        report = os.path.join(artifacts, "report.html")
        args = [a.oomguard, "kb", "report", "--html", report]
        for db in dbs:
            args += ["--db", db]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        text = open(report, encoding="utf-8").read()
        check("<img src=x" not in text and "alert(2)</script>" not in text, "report embeds the payload escaped")
        dom = Dom(chromium(browser, profile, "file://" + report, "--dump-dom"))
        check(dom.count("tr", "incident-row") == min(total, 50), "report rows: %d" % dom.count("tr", "incident-row"))
        check(dom.count("rect", "bar") >= 1, "report pattern chart")
        check(dom.count("img") == 0, "report: no injected <img>")
        dom = Dom(chromium(browser, profile, "file://" + report + "#/incident/xss-00000001", "--dump-dom"))
        check(dom.text_by_id.get("message") == fx.XSS_MESSAGE, "report detail shows the payload as text")
        check(dom.count("img") == 0 and dom.count("svg", "chart-memory") == 1, "report detail renders safely")
    finally:
        if pg_dir:
            subprocess.run([a.pg_server, "stop", os.path.join(pg_dir, "pg")], capture_output=True, timeout=120)
            shutil.rmtree(pg_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(profile, ignore_errors=True)
    if FAILS:
        print("%d failure(s)" % len(FAILS))
        return 1
    print("browser: all checks passed; screenshots in " + artifacts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
