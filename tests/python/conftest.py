"""Shared set-up of the Python tests (run by ctest through the project's
interpreter, scripts/python, as `-m pytest`).

ctest passes the build's package directory in PYTHONPATH and the build tree in
OOMGUARD_BUILD_DIR; run by hand:

    PYTHONPATH=build/python OOMGUARD_BUILD_DIR=build scripts/python -m pytest tests/python
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_DIR = pathlib.Path(os.environ.get("OOMGUARD_BUILD_DIR", REPO / "build"))
PYTHON_DIR = BUILD_DIR / "python"
if str(PYTHON_DIR) not in sys.path and not os.environ.get("OOMGUARD_TEST_INSTALLED"):
    sys.path.insert(0, str(PYTHON_DIR))
EXAMPLE = REPO / "examples" / "python" / "train_torch.py"
HDF5_PLUGINS = BUILD_DIR / "lib" / "hdf5-plugins"


def subprocess_env(**extra: str) -> dict:
    """The environment for child Python processes: this package first, no injected faults."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("OOMGUARD_FAULTS", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # A child killed by a fatal signal (SIGABRT from a C++ terminate, SIGSEGV) prints every thread's Python
    # stack: the failure message then says where it died, not only its exit code.
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra)
    return env


def run_python(args, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Runs this interpreter with args; fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(**env))
    if proc.returncode != 0:
        pytest.fail(f"{args} exited with {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def start_ranks(argvs, merge_stderr: bool = False, **env: str) -> list:
    """Starts one child of this interpreter per argv (the ranks of one job);
    merge_stderr: each rank's stderr goes into its stdout (one log)."""
    return [subprocess.Popen([sys.executable, *map(str, argv)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                             text=True, env=subprocess_env(**env)) for argv in argvs]


def wait_ranks(procs, timeout: float = 120) -> list:
    """Waits for every rank; on a timeout kills them all and fails the test (a
    collective hung), on a non-zero exit fails with that rank's stderr (its
    log, if merged).
    Returns [(stdout, stderr)] in rank order."""
    outputs = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {rank} did not finish within {timeout} s: a collective hung")
        if p.returncode != 0:
            for q in procs:
                q.kill()
            log = err if err is not None else out
            # The log's last lines (where a crash says why) first: a long message is cut at its end.
            pytest.fail(f"rank {rank} exited with {p.returncode}; the end of its log:\n{log[-1500:]}\n"
                        f"--- the 4000 characters before:\n{log[-5500:-1500]}")
        outputs.append((out, err))
    return outputs


@pytest.fixture(autouse=True)
def _no_fault_rules():
    import oomguard

    oomguard.clear_fault_rules()
    yield
    oomguard.clear_fault_rules()
