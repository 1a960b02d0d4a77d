"""Shared by the browser tests: build a knowledge base, run `oomguard kb serve`, fetch over HTTP.

Only the standard library of /usr/bin/python3 (curl may not be installed)."""
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PATTERNS_JSONL = os.path.join(REPO, "tests", "kb", "testdata", "patterns.jsonl")
RUNS_JSONL = os.path.join(HERE, "testdata", "runs.jsonl")
XSS_JSONL = os.path.join(HERE, "testdata", "xss.jsonl")
XSS_MESSAGE = "<img src=x onerror=alert(1)><script>alert(2)</script>"


def import_jsonl(oomguard, db, *files):
    for f in files:
        subprocess.run([oomguard, "kb", "import", "--db", db, f], check=True, stdout=subprocess.DEVNULL)


def default_dbs(oomguard, tmp):
    """The ten catalogue patterns plus two runs with timelines (one knowledge base)."""
    db = os.path.join(tmp, "incidents.db")
    import_jsonl(oomguard, db, PATTERNS_JSONL, RUNS_JSONL)
    return [db]


def xss_db(oomguard, tmp):
    """A second file holding one incident whose message is an XSS payload."""
    db = os.path.join(tmp, "xss.db")
    import_jsonl(oomguard, db, XSS_JSONL)
    return db


class Server:
    """`oomguard kb serve --port 0` for the duration of a with-block."""

    def __init__(self, oomguard, dbs, extra=()):
        args = [oomguard, "kb", "serve", "--port", "0", "--poll-ms", "100"]
        for db in dbs:
            args += ["--db", db]
        self.proc = subprocess.Popen(args + list(extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("Serving http://"):
            self.proc.kill()
            raise RuntimeError("kb serve did not start: %r %s" % (line, self.proc.stderr.read()))
        self.url = line.split(" ", 1)[1]
        hostport = self.url[len("http://"):].rstrip("/")
        self.host, self.port = hostport.rsplit(":", 1)[0], int(hostport.rsplit(":", 1)[1])

    def stop(self):
        """SIGTERM, as a service manager would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def get(self, path, method="GET", headers=None):
        """(status, headers, body bytes) without raising on 4xx/5xx."""
        req = urllib.request.Request(self.url.rstrip("/") + path, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def json(self, path):
        status, _, body = self.get(path)
        if status != 200:
            raise AssertionError("%s -> %d %s" % (path, status, body[:200]))
        return json.loads(body)
