"""The knowledge base on a PostgreSQL server from Python: a Guard records
into it, a second job (another process) starts from the prior the first one
learned, notes reach every reader, the URL's password never shows, and the
example's --kb takes the URL (or OOMGUARD_KB_URL).

The server is real: tests/kb/pg_server.sh (initdb in /tmp, a Unix socket,
stopped at the end)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO, subprocess_env

import oomguard

PG_SERVER = REPO / "tests" / "kb" / "pg_server.sh"


@pytest.fixture(scope="module")
def server():
    top = pathlib.Path(tempfile.mkdtemp(prefix="oomguard-pg-py-", dir="/tmp"))
    top.chmod(0o711)  # the server runs as nobody when the tests run as root
    pg = top / "pg"
    url = subprocess.run([str(PG_SERVER), "start", str(pg)], check=True, capture_output=True, text=True,
                         timeout=120).stdout.strip()
    try:
        yield {"url": url, "dir": top}
    finally:
        subprocess.run([str(PG_SERVER), "stop", str(pg)], capture_output=True, timeout=120)
        subprocess.run(["rm", "-rf", str(top)])


def with_password(url: str) -> str:
    # Trust authentication ignores it: it may stand in the URL, and must never come out.
    return url.replace("oomguard@", "oomguard:py-s3cret@", 1)


def test_a_guard_records_into_the_server_and_the_next_job_starts_from_its_prior(server):
    url = with_password(server["url"])
    spool = str(server["dir"] / "spool")
    kb = oomguard.KnowledgeBase(url, spool_dir=spool)
    assert "py-s3cret" not in kb.path and "***" in kb.path
    guard = oomguard.Guard(knowledge_base=kb, workload="py-pg-workload", initial_micro_batch=8)

    def micro(mb):
        if mb.size > 4:
            raise MemoryError("too big")

    report = guard.step(8, micro, reset=lambda: None)
    assert report.ooms == 1
    kb.record_clean_micro_batch("py-pg-workload", report.largest_micro)
    kb.flush()
    found = kb.query(workload="py-pg-workload")
    assert [i.id for i in found] == [report.incidents[0].id]
    assert found[0].outcome == "recovered" and found[0].pattern != ""
    kb.set_note(found[0].fingerprint, "fixed by expandable_segments", author="py")
    del guard
    del kb

    # Another process, another job: its prior comes from the server.
    code = (
        "import oomguard, json\n"
        "kb = oomguard.KnowledgeBase(read_only=True)\n"
        "print(json.dumps({'prior': kb.prior_micro_batch('py-pg-workload'), 'notes': kb.notes(), 'path': kb.path}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(OOMGUARD_KB_URL=url))
    assert proc.returncode == 0, proc.stderr
    import json
    out = json.loads(proc.stdout)
    assert out["prior"] == 4
    assert [n["text"] for n in out["notes"].values()] == ["fixed by expandable_segments"]
    assert "py-s3cret" not in proc.stdout + proc.stderr


def test_a_server_that_is_away_spools_and_the_error_hides_the_password(server, tmp_path):
    url = "postgresql://job:py-s3cret@/oomguard?host=/nonexistent-oomguard-dir"
    with pytest.raises(oomguard.OomguardError) as e:
        oomguard.KnowledgeBase(url, read_only=True)
    assert "py-s3cret" not in str(e.value) and "job:***@" in str(e.value)
    kb = oomguard.KnowledgeBase(url, spool_dir=str(tmp_path / "spool"))  # a job starts anyway
    guard = oomguard.Guard(knowledge_base=kb, workload="away", initial_micro_batch=8)
    guard.step(8, lambda mb: (_ for _ in ()).throw(MemoryError("too big")) if mb.size > 2 else None,
               reset=lambda: None)
    with pytest.raises(oomguard.OomguardError) as e:
        kb.flush()
    assert "py-s3cret" not in str(e.value)
    # The incidents wait on disk; (the clean sizes the guard noted are priors, relearned later).
    stats = kb.sink_stats
    assert stats.spooled >= 2 and stats.spool_pending == stats.spooled, (stats.spooled, stats.spool_pending)
    assert "py-s3cret" not in stats.last_error
    assert any(p.name.startswith("spool-") and p.stat().st_size > 0 for p in (tmp_path / "spool").iterdir())
    del guard


def test_no_path_and_no_url_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("OOMGUARD_KB_URL", raising=False)
    with pytest.raises(ValueError, match="OOMGUARD_KB_URL"):
        oomguard.KnowledgeBase()
