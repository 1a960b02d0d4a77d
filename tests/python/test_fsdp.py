"""FSDP2 under the guard (issue 29): the project's small GPT sharded per block
with fully_shard, 2 and 4 ranks over gloo on the CPU, under the agreement's
data mode (the flags inside FSDP's collectives) unless a plan asks for check
mode. OOMs on one rank at a unit's forward or backward (injected), at every
position of a micro-batch's collective schedule, at the guard's sites
(forward, backward, sync, apply) and from oomguard.budget end with every rank
having abandoned the same micro-batches and the parameters of the
unconstrained FSDP run (float64, 1e-10); a replay that cannot allocate stops
every rank; a run killed with SIGKILL resumes to the same result. Every run is
bounded: a hang fails the test at its timeout."""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest

import oomguard
import oomguard.budget
from conftest import start_ranks, subprocess_env, wait_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "fsdp_worker.py"
TRAIN_GPT = HERE.parents[1] / "examples" / "python" / "train_gpt.py"
UNITS = ["0", "1", "root"]
# The tests' GPT runs 8 FSDP collectives per micro-batch (reshard after forward): the forward
# all-gathers of the root and the two blocks, then in backward the blocks' all-gathers and every
# unit's reduce-scatter. Positions 0-7 of that schedule.
POSITIONS = 8


def run_plans(tmp_path, world: int, plans: list, timeout_s: float) -> dict:
    (tmp_path / "plans.json").write_text(json.dumps(plans))
    procs = start_ranks(([WORKER, r, world, tmp_path / "init", tmp_path, tmp_path / "plans.json"]
                         for r in range(world)), merge_stderr=True)
    wait_ranks(procs, timeout_s)
    results = {}
    for plan in plans:
        summaries = json.loads((tmp_path / f"{plan['name']}.json").read_text())
        params = np.fromfile(tmp_path / f"{plan['name']}.f64", dtype="<f8") \
            if (tmp_path / f"{plan['name']}.f64").exists() else None
        results[plan["name"]] = (summaries, params)
    return results


def random_plans(seed: int, world: int, count: int, steps: int) -> list:
    """Plans of one or two faults: an OOM at a unit's forward or backward, at a
    guard site (one rank), or before or after a position of a micro-batch's
    collective schedule (one rank, or two ranks at the same point), on a random
    step and micro-batch."""
    rng = random.Random(seed)
    plans = []
    for i in range(count):
        rank = rng.randrange(world)
        units, rules, at = [], [], []
        for _ in range(rng.choice([1, 2])):
            kind = rng.choice(["unit", "unit", "site", "at", "at"])
            step = rng.randrange(steps)
            if kind == "at":
                point = [step, rng.randrange(2), rng.choice(["before", "after"]), rng.randrange(POSITIONS)]
                ranks = {rank, rng.randrange(world)} if rng.random() < 0.4 else {rank}
                at += [[r] + point for r in sorted(ranks)]
            elif kind == "unit":
                units.append([rank, step, rng.choice(UNITS), rng.choice(["forward", "backward"]), rng.randrange(2)])
            else:
                site = rng.choice(["forward", "backward", "sync", "apply"])
                micro = f",micro={rng.randrange(2)}" if site in ("forward", "backward") else ""
                rules.append(f"oom@step={step},rank={rank},site={site}{micro}")
        plans.append({"name": f"random{i}", "steps": steps, "micro": 16 // world // 2, "ckpt": 2,
                      "sync": rng.choice(["every", "last"]), "units": units, "faults": ";".join(rules), "at": at})
    return plans


def check_against(results: dict, reference: str = "plain") -> None:
    ref = results[reference][1]
    assert ref is not None, results[reference][0]
    for name, (summaries, params) in results.items():
        assert all(s["error"] is None for s in summaries), (name, summaries)
        assert params is not None, name
        rel = np.max(np.abs(params - ref)) / np.max(np.abs(ref))
        assert rel <= 1e-10, (name, rel, summaries)
        if name != reference:
            # Every rank ran the same checks and FSDP collectives: the micro-batches stayed in lockstep.
            assert len({(s["checks"], s["collectives"], s["abandoned"]) for s in summaries}) == 1, (name, summaries)


@pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")
def test_two_ranks_every_unit_forward_and_backward_the_sites_and_the_budget(tmp_path):
    steps = 3
    plans = [{"name": "plain", "plain": True, "steps": steps},
             {"name": "clean", "steps": steps, "micro": 4}]
    # Each unit's forward and backward on rank 1, on the second micro-batch of step 1.
    for unit in UNITS:
        plans.append({"name": f"unit{unit}", "steps": steps, "micro": 4, "ckpt": 2,
                      "units": [[1, 1, unit, "forward", 1], [1, 2, unit, "backward", 0]]})
    # Inside FSDP's own buffer allocation, after the last check and before the collective.
    plans.append({"name": "alloc", "steps": steps, "micro": 8, "ckpt": 2,
                  "units": [[1, 0, "1", "all_gather", 1], [1, 2, "0", "reduce_scatter", 0]]})
    plans.append({"name": "sites", "steps": steps, "micro": 4, "ckpt": 2, "sync": "last",
                  "faults": "oom@step=0,rank=0,site=sync;oom@step=1,rank=1,site=apply;"
                            "oom@step=2,rank=0,site=backward,micro=1"})
    # Real allocation failures anywhere on rank 1 (FSDP's own buffers included) until the micro-batch fits.
    plans.append({"name": "budget", "steps": steps, "micro": 8, "ckpt": 2, "budget": [1, 300_000]})
    results = run_plans(tmp_path, 2, plans, timeout_s=600)
    check_against(results)
    summaries = {name: s for name, (s, _) in results.items()}
    assert all(s["abandoned"] == 0 and s["ooms"] == 0 for s in summaries["clean"])
    for unit in UNITS:
        s = summaries[f"unit{unit}"]
        assert s[1]["unit_faults"] == 2 and s[1]["ooms"] >= 2 and s[0]["abandoned"] == 2, (unit, s)
    assert summaries["alloc"][1]["unit_faults"] == 2 and summaries["alloc"][0]["abandoned"] == 2, summaries["alloc"]
    assert summaries["sites"][1]["rollbacks"] == 1, summaries["sites"]
    assert summaries["budget"][1]["ooms"] >= 1, summaries["budget"]


def test_two_ranks_data_mode_every_position(tmp_path):
    """The flags inside FSDP's collectives (data mode, the default): an OOM on rank 1 before each
    collective of a micro-batch (the rank replays that collective with its flag), after the last
    collective of a micro-batch (it replays the next micro-batch's first; on the step's last
    micro-batch it answers the step's closing check), in the first micro-batch ever run (check mode
    while the schedule is recorded), on two ranks at once, and after the schedule stopped matching
    what FSDP runs (a new reshard setting, a schedule made wrong), with explicit prefetching
    (collectives in another order than the modules): every rank abandons the same
    micro-batches and ends with the unconstrained run's parameters."""
    steps = 3
    plans = [{"name": "plain", "plain": True, "steps": steps}]
    # Step 1's second micro-batch (2 of 4 samples per rank: data mode since step 0), and step 2's first
    # (micro-batches of 2 after the halving).
    for p in range(POSITIONS // 2):
        plans.append({"name": f"before{p}", "steps": steps, "micro": 4,
                      "at": [[1, 1, 1, "before", p], [1, 2, 0, "before", p + POSITIONS // 2]]})
    plans.append({"name": "after_last", "steps": steps, "micro": 4,
                  "at": [[1, 1, 1, "after", POSITIONS - 1], [1, 2, 0, "after", POSITIONS - 1]]})
    plans.append({"name": "first", "steps": steps, "micro": 4,
                  "at": [[1, 0, 0, "before", 3], [1, 0, 1, "after", POSITIONS - 1]]})
    plans.append({"name": "both", "steps": steps, "micro": 4,
                  "at": [[0, 1, 1, "before", 5], [1, 1, 1, "before", 5], [0, 2, 0, "after", POSITIONS - 1],
                         [1, 2, 0, "after", POSITIONS - 1]]})
    plans.append({"name": "reshard", "steps": 4, "micro": 4, "reshard_at": 2,
                  "at": [[1, 2, 0, "before", 2], [1, 3, 1, "before", 4]]})
    plans.append({"name": "corrupt", "steps": steps, "micro": 4, "corrupt_at": [1, 4],
                  "at": [[1, 1, 0, "before", 6], [1, 2, 1, "before", 1]]})
    plans.append({"name": "prefetch", "steps": steps, "micro": 4, "prefetch": True,
                  "at": [[1, 1, 1, "before", 2], [1, 2, 0, "after", 4]]})
    plans.append({"name": "check_mode", "steps": steps, "micro": 4, "agreement": "check",
                  "at": [[1, 1, 1, "before", 5], [1, 2, 0, "after", POSITIONS - 1]]})
    plans.append({"name": "plain4", "plain": True, "steps": 4})
    # A non-OOM error before a collective: rank 1 replays it with its error flag, every rank leaves the
    # micro-batch and the guard's vote stops every rank (rank 1 with its own error). Last: it ends the run.
    plans.append({"name": "error", "steps": steps, "micro": 4, "at": [[1, 1, 1, "before", 4, "error"]]})
    results = run_plans(tmp_path, 2, plans, timeout_s=600)
    stopped = results.pop("error")[0]
    assert "ValueError: injected before FSDP collective 4" in stopped[1]["error"], stopped
    assert stopped[0]["error"] is not None and "ValueError" not in stopped[0]["error"], stopped
    check_against({n: r for n, r in results.items() if n != "reshard" and n != "plain4"})
    check_against({"plain4": results["plain4"], "reshard": results["reshard"]}, reference="plain4")
    s = {name: summaries for name, (summaries, _) in results.items()}
    for name in [f"before{p}" for p in range(POSITIONS // 2)] + ["after_last", "both", "reshard", "corrupt",
                                                                  "prefetch"]:
        injected = sum(r["position_faults"] for r in s[name])
        assert injected == {"both": 4}.get(name, 2), (name, s[name])
        assert s[name][0]["abandoned"] == 2, (name, s[name])
        assert all(r["data_mode"] for r in s[name]), (name, s[name])
    for p in range(POSITIONS // 2):
        # Rank 1 ran the collective it had not entered; rank 0 never ran a check inside a micro-batch.
        assert s[f"before{p}"][1]["replays"] == 2 and s[f"before{p}"][0]["replays"] == 0, s[f"before{p}"]
    # After the last collective: step 1's last micro-batch answers the closing check, step 2's first
    # replays the second micro-batch's first collective.
    assert s["after_last"][1]["replays"] == 1, s["after_last"]
    # Step 0's first micro-batch records the schedule in check mode: both faults there are answered checks.
    assert s["first"][1]["replays"] == 0 and s["first"][0]["abandoned"] == 2, s["first"]
    # Two ranks fail before the same collective: both replay it; then both after the last one.
    assert s["both"][0]["replays"] == 2 and s["both"][1]["replays"] == 2, s["both"]
    assert s["both"][0]["abandoned"] == 2, s["both"]
    assert all(r["fallbacks"] >= 1 for r in s["corrupt"]), s["corrupt"]
    assert s["prefetch"][1]["replays"] == 2 and all(r["fallbacks"] == 0 for r in s["prefetch"]), s["prefetch"]
    assert s["check_mode"][1]["replays"] == 0 and s["check_mode"][0]["abandoned"] == 2, s["check_mode"]
    # Data mode runs no check inside a micro-batch: fewer checks than check mode, same FSDP collectives.
    assert s["before0"][0]["checks"] < s["check_mode"][0]["checks"], (s["before0"], s["check_mode"])


def test_two_ranks_replay_that_does_not_fit_stops_every_rank(tmp_path):
    """The failing rank's replay cannot allocate its buffers (injected, twice): it raises
    FsdpReplayError and its guard's coordinator refuses to issue another collective on the group
    that is now out of step (the vote fails at once); the other rank stops at the agreement's
    deadline or when the failing process leaves. No rank hangs."""
    plans = [{"name": "replay_oom", "steps": 3, "micro": 4, "alone": True, "linger": 60,
              "at": [[1, 1, 1, "before", 2]], "replay_oom": [[1, 1]]}]
    (tmp_path / "plans.json").write_text(json.dumps(plans))
    procs = start_ranks(([WORKER, r, 2, tmp_path / "init", tmp_path, tmp_path / "plans.json"] for r in range(2)),
                        merge_stderr=True)
    wait_ranks(procs, 300)
    ranks = [json.loads((tmp_path / f"replay_oom.rank{r}.json").read_text()) for r in range(2)]
    assert "replay" in ranks[1]["error"], ranks
    # The failing process stays alive (linger): the other rank stops at its deadline (20 s in the
    # worker), in the collective it was waiting in, then at the vote the failing rank never joins.
    assert ranks[0]["error"] is not None and "Timeout" in ranks[0]["error"], ranks
    assert ranks[1]["seconds_total"] < 15, ranks
    assert 15 < ranks[0]["seconds_total"] < 55, ranks


def assert_positions_hit(results: dict) -> None:
    """The seeds were picked so that position faults fire, on two ranks at once in some plan."""
    fired = [[r.get("position_faults", 0) for r in summaries] for summaries, _ in results.values()]
    assert any(sum(f) for f in fired), fired
    assert any(sum(1 for x in f if x) >= 2 for f in fired), fired


def test_two_ranks_random_plans(tmp_path):
    plans = [{"name": "plain", "plain": True, "steps": 3}] + random_plans(38, 2, 5, 3)
    check_against(results := run_plans(tmp_path, 2, plans, timeout_s=600))
    assert_positions_hit(results)


def test_four_ranks_random_plans(tmp_path):
    plans = [{"name": "plain", "plain": True, "steps": 3}] + random_plans(6, 4, 3, 3)
    check_against(results := run_plans(tmp_path, 4, plans, timeout_s=600))
    assert_positions_hit(results)


def _train_gpt(tmp_path, *extra, timeout_s=300):
    args = [sys.executable, str(TRAIN_GPT), "--steps", "5", "--dtype", "float64", "--global-batch", "8",
            "--context", "8", "--width", "16", "--layers", "2", "--heads", "2", "--vocab", "31", "--json", *extra]
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=subprocess_env())
    except subprocess.TimeoutExpired:
        pytest.fail(f"train_gpt {' '.join(extra)} did not finish within {timeout_s} s")


def test_a_rank_killed_mid_step_is_resumed_to_the_plain_result(tmp_path):
    ref = _train_gpt(tmp_path, "--plain", "--dump-params", str(tmp_path / "ref.f64"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    common = ["--ranks", "2", "--parallel", "fsdp", "--micro-batch", "2", "--ckpt-dir", str(ckpt),
              "--ckpt-every", "1", "--deadline-ms", "4000"]
    killed = _train_gpt(tmp_path, *common, "--faults", "kill@step=3,rank=1,site=backward")
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert "rank 1 ended with signal 9" in killed.stderr or "ended with" in killed.stderr, killed.stderr[-3000:]
    committed = json.loads((ckpt / "MANIFEST.json").read_text()) if (ckpt / "MANIFEST.json").exists() else None
    resumed = _train_gpt(tmp_path, *common, "--resume", "--dump-params", str(tmp_path / "resumed.f64"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["identical"] and summary["world_size"] == 2, summary
    if committed is not None:
        assert "resumed from step" in resumed.stderr, resumed.stderr[-3000:]
    a, b = (np.fromfile(tmp_path / n, dtype="<f8") for n in ("ref.f64", "resumed.f64"))
    assert np.max(np.abs(a - b)) / np.max(np.abs(a)) <= 1e-10
