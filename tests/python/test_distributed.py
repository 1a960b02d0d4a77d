"""Two processes with torch.distributed (gloo): OOMs on one rank only, and the
ranks still end in agreement, with the parameters of a single-process run."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import oomguard
import oomguard.budget
from conftest import run_python, start_ranks, subprocess_env, wait_ranks

WORKER = pathlib.Path(__file__).with_name("dist_worker.py")

pytestmark = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")


def test_ooms_on_one_rank_only_end_in_agreement(tmp_path):
    init = tmp_path / "init"
    # Only rank 1 runs out of memory.
    procs = start_ranks([WORKER, rank, 2, init, tmp_path / f"rank{rank}", budget_mib]
                        for rank, budget_mib in ((0, 0), (1, 2)))
    outputs = [err for _, err in wait_ranks(procs)]
    run_python([WORKER, 0, 1, "unused", tmp_path / "reference", 0])

    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["engine"] == r1["engine"] == "torch.distributed"
    assert r0["ooms"] == 0 and r1["ooms"] >= 1, outputs[1][-2000:]
    assert r1["micro_limit"] < 256 == r0["micro_limit"]
    assert r0["steps"] == r1["steps"] == 5
    # Every rank's memory figures were gathered onto rank 1's incidents.
    assert r1["incidents_with_ranks"] >= 1
    p0, p1, ref = (np.fromfile(tmp_path / f"{n}.f64", dtype="<f8") for n in ("rank0", "rank1", "reference"))
    assert np.array_equal(p0, p1), "ranks disagree"
    rel = np.max(np.abs(p0 - ref)) / np.max(np.abs(ref))
    assert rel <= 1e-10, rel


def test_a_silent_peer_fails_the_vote_at_the_guards_deadline(tmp_path):
    """gloo's own timeout is 60 s here; the guard's deadline is 1.5 s, kept by
    polling the collective's completion."""
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), "2", str(init), str(tmp_path / f"rank{rank}"),
                               "0", "silent"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=subprocess_env())
             for rank in (0, 1)]
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the deadline did not fire")
        codes.append(p.returncode)
    assert codes == [oomguard.EXIT_COORDINATION_TIMEOUT, 0]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["error"] and r0["error"].startswith("CoordinationTimeoutError"), r0
    assert "did not complete within 1.500 s" in r0["error"]
    assert 1.4 <= r0["seconds"] < 10, r0
