"""The step protocol's collectives over torch.distributed (gloo, two
processes): a small host sync rides in the vote (no all-reduce), a larger one
is summed apart; both give every rank the global batch's mean, and an OOM at
the sync site costs one more vote, not a sum (issue 29)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import subprocess_env

WORKER = pathlib.Path(__file__).with_name("vote_sum_worker.py")


@pytest.mark.parametrize("words,sums", [(1, 0), (9, 3)])
def test_small_syncs_ride_in_the_vote_over_gloo(tmp_path, words, sums):
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(tmp_path / "init"), str(words)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for rank in (0, 1)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the ranks did not finish: a collective hung")
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        # 3 steps of a vote and an agreement, and the redo's extra vote.
        assert r["allgathers"] == 7 and r["sums"] == sums, r
        assert r["redone"] == [0, 1, 0], r
        assert r["applied"] == [[0.25 * 1.0 + 0.75 * 2.0] * words] * 3, r
