"""examples/python/train_gpt.py: a GPT-style decoder with padded token batches,
AdamW, a warmup/cosine scheduler and clipping, guarded under real OOMs (the
budgeted CPU allocator) and injected faults at every site, on one rank and on
two gloo ranks with DDP. With float64 every run ends with the parameters and
the scheduler of the plain whole-batch run, within 1e-10.

One-rank runs call the example in this process; two-rank runs start it as a
program (it forks its ranks)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

import oomguard
import oomguard.budget
from conftest import REPO, run_python

GPT = REPO / "examples" / "python" / "train_gpt.py"

pytestmark = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")

# Small enough for tens of seconds in all; the whole batch's activations (float64)
# do not fit in 6 MiB beside AdamW's state, a quarter of them do.
COMMON = ["--steps", "6", "--global-batch", "16", "--dtype", "float64", "--seed", "3"]


def _module():
    spec = importlib.util.spec_from_file_location("train_gpt", GPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


train_gpt = _module()


def _in_process(*flags) -> dict:
    return train_gpt.train(train_gpt.parse_args([*COMMON, *flags]))


@pytest.fixture(scope="module")
def plain() -> dict:
    return _in_process("--plain")


def _rel(params, ref) -> float:
    params, ref = (np.asarray(p, dtype=np.float64) for p in (params, ref))
    assert params.shape == ref.shape and params.size > 10_000
    return float(np.max(np.abs(params - ref)) / np.max(np.abs(ref)))


def _assert_equals_plain(result: dict, params, plain: dict) -> None:
    assert _rel(params, plain["params"]) <= 1e-10
    assert result["scheduler"]["last_epoch"] == plain["scheduler"]["last_epoch"] == 6
    assert result["scheduler"]["last_lr"] == pytest.approx(plain["scheduler"]["last_lr"], rel=1e-12)
    assert result["loss_last"] == pytest.approx(plain["loss_last"], rel=1e-10)


# Every site the guard fires at, at another step each (OOMs at the optimizer
# and apply sites roll back; the others split the step).
EVERY_SITE = ("oom@step=0,site=micro_batch;oom@step=1,site=forward,micro=1;oom@step=2,site=backward;"
              "oom@step=3,site=optimizer;oom@step=4,site=commit;oom@step=4,site=sync;oom@step=5,site=apply")


def test_one_rank_faults_at_every_site_and_a_budget_equal_the_plain_run(tmp_path, plain):
    got = _in_process("--budget-mib", "6", "--micro-batch", "8", "--grow-after", "1", "--ckpt-dir",
                      str(tmp_path / "ckpt"), "--ckpt-every", "2", "--faults", EVERY_SITE)
    assert got["ooms"] >= 7 and got["rollbacks"] >= 2, got  # + the budget's own
    _assert_equals_plain(got, got["params"], plain)


def test_float32_under_a_budget_runs_through_onednn():
    got = _in_process("--dtype", "float32", "--budget-mib", "3")  # GELU, LayerNorm: oneDNN on CPU
    assert got["ooms"] >= 1 and got["final_micro_batch"] < 16
    assert np.isfinite(got["loss_last"]) and got["loss_last"] < got["loss_first"]


def _two_ranks(tmp_path, name, *flags, **env) -> tuple:
    params = tmp_path / f"{name}.f64"
    proc = run_python([GPT, *COMMON, "--ranks", 2, "--json", "--dump-params", params, "--deadline-ms", 30000, *flags],
                      timeout=180, **env)
    return json.loads(proc.stdout.strip().splitlines()[-1]), np.fromfile(params, dtype="<f8"), proc.stderr


def test_two_ranks_faults_at_every_site_and_a_budget_equal_the_plain_run(tmp_path, plain):
    faults = ("oom@step=0,rank=1,site=micro_batch;oom@step=1,rank=0,site=forward;oom@step=2,rank=1,site=backward;"
              "oom@step=3,rank=0,site=optimizer;oom@step=4,rank=1,site=commit;oom@step=4,rank=0,site=sync;"
              "oom@step=5,rank=1,site=apply")
    got, params, log = _two_ranks(tmp_path, "every", "--budget-mib", "5", "--grow-after", "1", "--ckpt-dir",
                                  tmp_path / "ckpt", "--ckpt-every", "2", "--faults", faults)
    assert got["world_size"] == 2 and got["identical"], got
    assert got["ooms"] >= 7 and got["rollbacks"] == 2, log[-3000:]
    _assert_equals_plain(got, params, plain)


@pytest.mark.parametrize("site", ["commit", "sync", "apply", "optimizer"])
def test_two_ranks_with_a_default_checkpointer_recover_rank_1s_oom(tmp_path, plain, site):
    """Issue 13's acceptance run: OOMGUARD_FAULTS on rank 1 at step 2, a
    Checkpointer left at its defaults, a scheduler."""
    ckpt = tmp_path / "ckpt"
    got, params, log = _two_ranks(tmp_path, site, "--ckpt-dir", ckpt,
                                  OOMGUARD_FAULTS=f"oom@step=2,rank=1,site={site}")
    assert got["identical"], got
    assert [r["ooms"] for r in got["ranks"]] == [0, 1], log[-3000:]
    _assert_equals_plain(got, params, plain)
    # One shard per rank in every checkpoint, none written twice.
    steps = sorted(ckpt.glob("step-*"))
    for d in steps:
        assert sorted(p.name for p in d.iterdir()) == ["MANIFEST.json", "rank-00000.h5", "rank-00001.h5"], d
        assert json.loads((d / "MANIFEST.json").read_text())["world_size"] == 2
    assert "cannot create" not in log
    if site in ("commit", "sync"):  # recovered by splitting: saved after the recovery
        assert [d.name for d in steps] == ["step-00000002"] and got["last_checkpoint"] == 2
    else:  # rolled back to the initial in-memory snapshot
        assert got["rollbacks"] == 1


def test_bad_flags_name_what_is_wrong(capsys):
    for flags, message in ((["--ranks", "0"], "--ranks must be >= 1"),
                           (["--width", "30"], "--width 30 is not a multiple of --heads 4"),
                           (["--faults", "oom@step=x"], "--faults"),
                           (["--plain", "--ranks", "2"], "--plain is the reference run"),
                           (["--resume"], "--resume needs --ckpt-dir")):
        with pytest.raises(SystemExit) as e:
            train_gpt.parse_args(flags)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
