"""The step protocol's collectives over torch.distributed (gloo, two
processes): a small host sync rides in the vote (no all-reduce), a larger one
is summed apart; both give every rank the global batch's mean, and an OOM at
the sync site costs one more vote, not a sum (issue 29)."""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import start_ranks, wait_ranks

WORKER = pathlib.Path(__file__).with_name("vote_sum_worker.py")


@pytest.mark.parametrize("words,sums", [(1, 0), (9, 3)])
def test_small_syncs_ride_in_the_vote_over_gloo(tmp_path, words, sums):
    procs = start_ranks([WORKER, rank, tmp_path / "init", words] for rank in (0, 1))
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in wait_ranks(procs)]
    for r in results:
        # 3 steps of a vote and an agreement, and the redo's extra vote.
        assert r["allgathers"] == 7 and r["sums"] == sums, r
        assert r["redone"] == [0, 1, 0], r
        assert r["applied"] == [[0.25 * 1.0 + 0.75 * 2.0] * words] * 3, r
