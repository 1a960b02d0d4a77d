"""TrainStep(ddp_overlap=True) through examples/python/train_gpt.py --parallel
ddp-overlap: DDP's bucketed all-reduce runs inside the last micro-batch's
backward, and the step stays atomic. 2 and 4 gloo ranks (processes), the small
GPT in float64 with small buckets (several per round), OOMs on one rank at
every site the guard fires at, inside backward after k buckets were launched
(site=bucket, after=K), once the round's last bucket and status were
launched (after=last: while backward waits on the round) and in the comm
hook (hook=K), and from the budgeted allocator, in fixed and random plans: every
run ends with the parameters of the plain whole-batch run within 1e-10. An
error on one rank stops every rank at the same step; a rank killed with
SIGKILL inside the round makes its peer exit 75; both runs resume to the
plain run's parameters. Every run has a deadline: a hang fails the test."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

import oomguard
import oomguard.budget
from conftest import REPO, start_ranks, subprocess_env, wait_ranks

GPT = REPO / "examples" / "python" / "train_gpt.py"

pytestmark = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")

COMMON = ["--steps", "6", "--global-batch", "16", "--dtype", "float64", "--seed", "3"]
# 0.02 MB buckets: the GPT's gradients (float64) fill ten per round from step 1 on
# (DDP's first step runs one bucket of everything, then rebuilds them by size).
OVERLAP = ["--parallel", "ddp-overlap", "--bucket-mb", "0.02", "--deadline-ms", "30000", "--json"]
RUN_TIMEOUT_S = 240


def _module():
    spec = importlib.util.spec_from_file_location("train_gpt", GPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def plain() -> dict:
    gpt = _module()
    return gpt.train(gpt.parse_args([*COMMON, "--plain"]))


def _run(tmp_path, name, ranks, *flags, expect_ok=True):
    """train_gpt with its forked ranks in a session of their own, killed as a
    whole at the deadline (a hang fails the test and leaves no rank behind)."""
    params = tmp_path / f"{name}.f64"
    cmd = [sys.executable, str(GPT), *COMMON, *OVERLAP, "--ranks", str(ranks), "--dump-params", str(params),
           *map(str, flags)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{name}: the ranks did not finish within {RUN_TIMEOUT_S} s (a hang)\n{err[-4000:]}")
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{name}: exit {proc.returncode}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-6000:]}")
    summary = json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else None
    got = np.fromfile(params, dtype="<f8") if proc.returncode == 0 else None
    return proc.returncode, summary, got, err


def _assert_equals_plain(summary, params, plain) -> None:
    ref = np.asarray(plain["params"], dtype=np.float64)
    assert summary["identical"], summary
    assert params.shape == ref.shape
    rel = float(np.max(np.abs(params - ref)) / np.max(np.abs(ref)))
    assert rel <= 1e-10, rel
    assert summary["scheduler"]["last_epoch"] == plain["scheduler"]["last_epoch"] == 6
    assert summary["loss_last"] == pytest.approx(plain["loss_last"], rel=1e-10)


def test_two_ranks_every_site_mid_backward_and_a_budget_equal_the_plain_run(tmp_path, plain):
    faults = ("oom@step=0,rank=1,site=micro_batch;oom@step=1,rank=0,site=forward;"
              "oom@step=1,rank=1,site=bucket,after=3;oom@step=2,rank=1,site=backward;"
              "oom@step=2,rank=0,site=bucket,after=0;oom@step=3,rank=0,site=optimizer;oom@step=3,rank=1,site=vote;"
              "oom@step=4,rank=1,site=commit;oom@step=4,rank=0,site=sync;oom@step=5,rank=1,site=apply;"
              "oom@step=5,rank=0,site=bucket,after=5")
    code, got, params, log = _run(tmp_path, "every", 2, "--budget-mib", "5", "--grow-after", "1", "--ckpt-dir",
                                  tmp_path / "ckpt", "--ckpt-every", "2", "--faults", faults)
    assert got["ooms"] >= 11 and got["rollbacks"] >= 2, log[-3000:]  # the budget adds its own
    _assert_equals_plain(got, params, plain)


def test_two_ranks_ooms_past_the_status_complete_the_round_and_equal_the_plain_run(tmp_path, plain):
    """after=last: the failing rank's status already said "ok" to the others;
    it completes the round from the summed buckets, its guard counts the OOM,
    and the step goes on (with a fault mid-round on the other rank in the
    same step, and on one rank in two rounds of a step)."""
    faults = ("oom@step=1,rank=0,site=bucket,after=last;oom@step=2,rank=1,site=bucket,after=last;"
              "oom@step=2,rank=0,site=bucket,after=4;oom@step=3,rank=0,site=bucket,after=last,times=2;"
              "oom@step=3,rank=1,site=bucket,after=2;oom@step=4,rank=1,site=bucket,after=last;"
              "oom@step=4,rank=1,site=sync")
    code, got, params, log = _run(tmp_path, "late", 2, "--grow-after", "1", "--faults", faults)
    assert got["ooms"] >= 8, log[-3000:]
    _assert_equals_plain(got, params, plain)


def test_two_ranks_ooms_in_the_comm_hook_redo_the_round_and_equal_the_plain_run(tmp_path, plain):
    """hook=K: the hook sends bucket K and the rest of the round as zeros, the
    status says "redo" (also when K is the last bucket, whose status goes out
    right after it), every rank runs another round; twice in a row on one
    rank, and together with an OOM past the status on the other rank."""
    faults = ("oom@step=1,rank=1,site=bucket,hook=0;oom@step=2,rank=0,site=bucket,hook=9;"
              "oom@step=3,rank=1,site=bucket,hook=4;oom@step=3,rank=0,site=bucket,after=last;"
              "oom@step=4,rank=0,site=bucket,hook=2,times=2")
    code, got, params, log = _run(tmp_path, "hook", 2, "--grow-after", "1", "--faults", faults)
    assert got["ooms"] >= 6, log[-3000:]
    _assert_equals_plain(got, params, plain)


SITES = ("micro_batch", "forward", "backward", "bucket", "optimizer", "vote", "commit", "sync", "apply")


def _plan(seed: int, ranks: int) -> str:
    """One or two OOMs on one rank per step, at random sites (bucket: after a
    random number of launched buckets, 0 to 7, 0 at step 0, which has one; or
    after the last one and the status; or in the comm hook of bucket 0 to 9)."""
    rng = random.Random(seed)
    rules = []
    for step in range(6):
        for _ in range(rng.choice((0, 1, 1, 2))):
            site, rank = rng.choice(SITES), rng.randrange(ranks)
            where = rng.choice((f"after={rng.randrange(8) if step else 0}", "after=last",
                                f"hook={rng.randrange(10) if step else 0}"))
            extra = f",{where}" if site == "bucket" else ""
            rules.append(f"oom@step={step},rank={rank},site={site}{extra}")
    return ";".join(rules)


@pytest.mark.parametrize("ranks,seed", [(2, 11), (2, 12), (4, 21), (4, 22)])
def test_random_plans_equal_the_plain_run(tmp_path, plain, ranks, seed):
    faults = _plan(seed, ranks)
    budget = ["--budget-mib", "5"] if seed % 2 else []
    code, got, params, log = _run(tmp_path, f"plan{seed}", ranks, "--grow-after", "1", "--ckpt-dir",
                                  tmp_path / "ckpt", "--ckpt-every", "1", "--faults", faults, *budget)
    assert got["world_size"] == ranks, got
    assert got["ooms"] >= faults.count("oom@"), (faults, log[-3000:])
    _assert_equals_plain(got, params, plain)


def test_an_error_in_the_last_forward_stops_every_rank_then_resumes(tmp_path, plain):
    ckpt = tmp_path / "ckpt"
    code, _, _, log = _run(tmp_path, "error", 2, "--ckpt-dir", ckpt, "--ckpt-every", "1", "--faults",
                           "error@step=3,rank=1,site=forward", expect_ok=False)
    assert code == 1, log[-3000:]
    assert "rank 1 stopped at step 3" in log, log[-3000:]  # rank 0 names the failing rank
    code, got, params, log = _run(tmp_path, "error-resumed", 2, "--ckpt-dir", ckpt, "--ckpt-every", "1", "--resume")
    assert "resumed from step" in log
    _assert_equals_plain(got, params, plain)


def test_an_error_before_the_first_forward_after_step_0_stops_every_rank(tmp_path):
    """DDP rebuilds its buckets after its first iteration with a broadcast in
    the next forward; rank 1 fails at step 1 before any forward and goes to
    the vote (its round as zeros), so the rebuild must not wait in rank 0's
    forward: every rank stops at step 1, none hangs."""
    code, _, _, log = _run(tmp_path, "error-step1", 2, "--faults", "error@step=1,rank=1,site=micro_batch",
                           expect_ok=False)
    assert code == 1, log[-3000:]
    assert "rank 1 stopped at step 1" in log, log[-3000:]


def test_a_rank_killed_inside_the_round_ends_its_peer_with_75_then_resumes(tmp_path, plain):
    """SIGKILL on rank 1 in its last micro-batch's backward (rank 0 waits inside
    a bucket's all-reduce): rank 0 leaves with exit 75, not at a timeout of its
    own; the job resumes from the checkpoint every rank holds."""
    ckpt = tmp_path / "ckpt"
    code, _, _, log = _run(tmp_path, "kill", 2, "--ckpt-dir", ckpt, "--ckpt-every", "1", "--faults",
                           "kill@step=3,rank=1,site=backward", expect_ok=False)
    assert code != 0, log[-3000:]
    assert "rank 0 ended with exit code 75" in log or "rank 1 ended with signal 9" in log, log[-3000:]
    code, got, params, log = _run(tmp_path, "kill-resumed", 2, "--ckpt-dir", ckpt, "--ckpt-every", "1", "--resume")
    _assert_equals_plain(got, params, plain)


# Two DDP models on the same ranks, one per mode, the same data: the loss units
# of each step differ (the shares of the round before are wrong) and step 1 has
# none on any rank (its gradient is zero, and the shares of step 2 are scaled
# for a total of 1 before the status corrects them).
UNITS_WORKER = r"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import oomguard
import oomguard.torch as ogt

rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
runs = []
for overlap in (True, False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    guard = oomguard.Guard(coordinator=ogt.TorchDistributedCoordinator(), initial_micro_batch=3, grow_after=0,
                           vote_deadline_ms=30000)

    def loss_fn(out, y):
        mask = y[:, 2:]
        return (((out - y[:, :2]) ** 2) * mask).sum() / mask.sum().clamp(min=1)

    step = ogt.TrainStep(ddp, opt, loss_fn, guard=guard, loss_units=lambda x, y: y[:, 2:].sum(dim=1).long(),
                         ddp_overlap=overlap)
    runs.append((model, step))
for k in range(4):
    g = torch.Generator().manual_seed(100 * k + rank)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.cat([torch.randn(8, 2, generator=g, dtype=torch.float64),
                   (torch.rand(8, 2, generator=g) < (0.0 if k == 1 else 0.3 + 0.2 * rank + 0.1 * k)).double()], 1)
    for model, step in runs:
        step(x, y)
(a, sa), (b, _) = runs
diff = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
print(diff, sa._overlap.rescaled_rounds, sa._overlap.rounds, flush=True)
dist.destroy_process_group()
"""


def test_changing_and_zero_loss_units_give_todays_gradients(tmp_path):
    """The shares come from the round before and the status corrects them: with
    units that change every step, and a step without any, the overlap mode's
    parameters equal today's mode's (same ranks, same data)."""
    init = tmp_path / "init"
    outs = wait_ranks(start_ranks([["-c", UNITS_WORKER, r, init] for r in range(2)]), timeout=RUN_TIMEOUT_S)
    for out, _ in outs:
        diff, rescaled, rounds = out.split()
        assert float(diff) <= 1e-13, out
        assert int(rounds) == 4 and int(rescaled) >= 3, out  # the first step's shares are exact


def test_bad_options_name_what_is_wrong(capsys):
    import torch

    import oomguard.torch as ogt

    gpt = _module()
    for flags, message in ((["--faults", "oom@step=1,site=bucket,after=1"], "need --parallel ddp-overlap"),
                           (["--parallel", "ddp-overlap", "--faults", "oom@step=1,site=bucket"], "after=K"),
                           (["--parallel", "ddp-overlap", "--faults", "error@site=bucket,after=1"], "only 'oom'"),
                           (["--parallel", "ddp-overlap", "--faults", "oom@site=bucket,after=-1"], "after=last"),
                           (["--parallel", "ddp-overlap", "--faults", "oom@site=bucket,after=first"], "integers"),
                           (["--parallel", "fsdp-nope"], "invalid choice"),
                           (["--bucket-mb", "0"], "--bucket-mb > 0")):
        with pytest.raises(SystemExit):
            gpt.parse_args(flags)
        assert message in capsys.readouterr().err, flags
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="ddp_overlap=True needs a DistributedDataParallel model"):
        ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      ddp_overlap=True)
