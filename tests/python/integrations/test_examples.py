"""examples/python/hf_trainer.py and lightning_train.py from the command line:
two ranks under a byte budget (real OOMs on both), against the same trainer
without oomguard (--plain, two ranks), compared through --dump-params and
--json, and bad flags refused."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import oomguard.budget

from conftest import REPO, subprocess_env

pytest.importorskip("transformers")
pytest.importorskip("lightning")

EXAMPLES = {"hf_trainer": ("hf_trainer.py", "3"), "lightning_train": ("lightning_train.py", "2")}


def _run(script: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "examples" / "python" / script), *args], capture_output=True,
                          text=True, timeout=timeout, env=subprocess_env(OMP_NUM_THREADS="1"))


@pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_two_ranks_under_a_budget_equal_the_plain_trainer(name, tmp_path):
    script, budget = EXAMPLES[name]
    runs = {}
    for mode, extra in (("plain", ["--plain"]), ("guarded", ["--budget-mib", budget])):
        dump = tmp_path / f"{mode}.f64"
        proc = _run(script, "--steps", "4", "--ranks", "2", "--json", "--dump-params", str(dump), *extra)
        assert proc.returncode == 0, f"{mode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        runs[mode] = (json.loads(proc.stdout.strip().splitlines()[-1]), np.fromfile(dump, dtype="<f8"))
    (plain, p), (guarded, g) = runs["plain"], runs["guarded"]
    assert guarded["world_size"] == plain["world_size"] == 2 and guarded["identical"] and plain["identical"]
    assert guarded["steps"] == plain["steps"] == 4
    assert guarded["ooms"] >= 2 and guarded["final_micro_batch"] is not None
    assert p.size == g.size and np.abs(g - p).max() / np.abs(p).max() <= 1e-10


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_bad_flags_are_refused(name):
    script, _ = EXAMPLES[name]
    for args, words in ((["--ranks", "0"], "--ranks"), (["--plain", "--budget-mib", "1"], "--plain"),
                        (["--faults", "boom@step=1"], "unknown kind")):
        proc = _run(script, *args, timeout=120)
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr[-2000:])
