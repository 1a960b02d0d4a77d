"""FSDP2 (torch.distributed.fsdp.fully_shard) on the CPU over gloo, two
processes, without the guard: what docs/distributed.md states about the pinned
torch. It runs on the CPU (so an FSDP mode's CPU tests need no FSDP1
fallback), and an OOM on one rank inside a unit's forward leaves the other
rank inside that unit's all-gather until the process group's timeout: the
failure an FSDP mode of the guard has to prevent (issue 29)."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

TIMEOUT_S = 4


def _rank(rank: int, init: str, fail_rank: int, out_dir: str) -> None:
    def put(result) -> None:
        # A file, not a multiprocessing.Queue: os._exit below would drop what
        # a queue's feeder thread had not sent yet.
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)

    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=TIMEOUT_S))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).double()
        fsdp.fully_shard(model[0])
        fsdp.fully_shard(model[2])
        fsdp.fully_shard(model)
        if rank == fail_rank:
            def oom(module, args):
                raise torch.OutOfMemoryError("injected before the second unit's forward")
            model[2].register_forward_pre_hook(oom)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        t0 = time.monotonic()
        try:
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            put((rank, "ok", f"{loss.item():.12f}", time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 - reported to the test
            put((rank, type(e).__name__, str(e).splitlines()[0] if str(e) else "", time.monotonic() - t0))
            if rank == fail_rank:
                time.sleep(TIMEOUT_S + 4)  # stay alive, as a rank recovering locally would
    except Exception:  # noqa: BLE001
        put((rank, "setup", traceback.format_exc(), 0.0))
    os._exit(0)


def _run(tmp_path, fail_rank: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    init = str(tmp_path / "init")
    procs = [ctx.Process(target=_rank, args=(r, init, fail_rank, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    results = {}
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} reported nothing (it hung or died)"
        _, what, text, seconds = json.loads(path.read_text())
        results[r] = (what, text, seconds)
    return results


def test_fully_shard_runs_a_step_on_the_cpu_over_gloo(tmp_path):
    results = _run(tmp_path, fail_rank=-1)
    assert results[0][0] == "ok" and results[1][0] == "ok", results
    assert float(results[0][1]) > 0 and float(results[1][1]) > 0


def test_an_oom_on_one_rank_leaves_the_other_in_the_units_all_gather_until_the_timeout(tmp_path):
    results = _run(tmp_path, fail_rank=1)
    assert results[1][0] == "OutOfMemoryError", results
    what, text, seconds = results[0]
    assert what == "RuntimeError" and "Timed out" in text, results
    assert seconds >= TIMEOUT_S * 0.9, results  # it waited for the peer, not for an error from it
