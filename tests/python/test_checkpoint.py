"""Checkpoints of torch state through the C++ checkpointer, read back by h5py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

import oomguard
import oomguard.torch as ogt
from conftest import HDF5_PLUGINS, run_python, subprocess_env


def _model():
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    return m.double()


def test_state_dict_round_trips_and_h5py_reads_the_shard(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    opt.step()  # optimizer state exists
    ckpt = oomguard.Checkpointer(str(tmp_path), fsync=False)
    ogt.register_state(ckpt, model=model, optimizer=opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    torch.manual_seed(1234)
    expected_draw = torch.rand(3)
    torch.manual_seed(1234)
    ckpt.save_async(7)
    ckpt.wait()

    # Scramble everything, in place (registered by address).
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_() if t.dtype != torch.int64 else t.fill_(99)
    opt.state.clear()
    torch.manual_seed(999)
    random.random()

    assert ckpt.load_latest() == 7
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected_draw), "RNG state was not restored"

    shard = tmp_path / "step-00000007" / "rank-00000.h5"
    manifest = json.loads((tmp_path / "step-00000007" / "MANIFEST.json").read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    oomguard.verify_checkpoint(str(tmp_path), 7, 1)

    # h5py, in a fresh process: HDF5 reads HDF5_PLUGIN_PATH when it starts.
    script = f"""
import json, sys, h5py, numpy as np
def text(v):
    return v.decode() if isinstance(v, bytes) else str(v)
out = {{}}
with h5py.File({str(shard)!r}, "r") as f:
    out["format"] = text(f.attrs["format"])
    for name in ("0.weight", "0.bias", "1.running_mean", "2.weight"):
        d = f["model"][name]
        out[name] = {{"dtype": text(d.attrs["dtype"]), "values": np.asarray(d[()]).astype("<f8").ravel().tolist()}}
json.dump(out, sys.stdout)
"""
    proc = run_python(["-c", script], HDF5_PLUGIN_PATH=str(HDF5_PLUGINS))
    read = json.loads(proc.stdout)
    assert read["format"] == "oomguard-ckpt/2"
    for name in ("0.weight", "0.bias", "1.running_mean", "2.weight"):
        assert read[name]["dtype"] == "float64"
        assert read[name]["values"] == saved[name].reshape(-1).tolist(), name


def test_numpy_arrays_are_registered_without_copy(tmp_path):
    np = pytest.importorskip("numpy")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    ckpt = oomguard.Checkpointer(str(tmp_path), fsync=False)
    ckpt.add_tensor("data/a", a)
    ckpt.save_async(0)
    ckpt.wait()
    a[:] = -1
    assert ckpt.load_latest() == 0
    assert a.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
    with pytest.raises(ValueError, match="contiguous"):
        oomguard.Checkpointer(str(tmp_path / "other"), fsync=False).add_tensor("data/t", torch.zeros(4, 4).t())


def test_registration_after_the_first_use_is_refused(tmp_path):
    # A tensor added after a save would be missing from that checkpoint and make
    # every later load of it fail: refused at once, naming the path.
    ckpt = oomguard.Checkpointer(str(tmp_path), fsync=False)
    ckpt.add_tensor("data/a", torch.zeros(3))
    ckpt.save_async(0)
    with pytest.raises(oomguard.FailedPreconditionError, match="/data/b registered after"):
        ckpt.add_tensor("data/b", torch.zeros(3))
    with pytest.raises(oomguard.FailedPreconditionError, match="/obj registered after"):
        ckpt.add_object("obj", lambda: b"", lambda data: None)
    ckpt.wait()
    assert ckpt.load_latest() == 0


def test_missing_and_corrupt_checkpoints(tmp_path):
    x = torch.arange(4, dtype=torch.float64)
    ckpt = oomguard.Checkpointer(str(tmp_path), fsync=False)
    ckpt.add_tensor("x", x)
    assert ckpt.load_latest() is None
    with pytest.raises(FileNotFoundError):
        ckpt.native.load_latest()
    ckpt.save_async(0)
    ckpt.wait()
    shard = tmp_path / "step-00000000" / "rank-00000.h5"
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(oomguard.CorruptCheckpointError) as info:
        ckpt.load_latest()
    assert isinstance(info.value, OSError) and info.value.code == "DATA_LOSS"


def test_parallel_staging_of_a_large_tensor(tmp_path):
    # 24 MiB: large enough for the staging copy to be split over threads.
    t = torch.arange(6 << 20, dtype=torch.float32)
    ckpt = oomguard.Checkpointer(str(tmp_path), fsync=False, stage_threads=2)
    ckpt.add_tensor("model/big", t)
    ckpt.save_async(0)
    t.mul_(-1)  # training goes on
    ckpt.wait()
    assert ckpt.load_latest() == 0
    assert torch.equal(t, torch.arange(6 << 20, dtype=torch.float32))
    with pytest.raises(Exception, match="stage_threads"):
        oomguard.Checkpointer(str(tmp_path / "bad"), stage_threads=-1)


def test_compression_choice_is_an_option_and_recorded(tmp_path):
    np = pytest.importorskip("numpy")
    for mode, want in (("none", "none"), ("zstd", "zstd-2"), ("auto", "zstd-2")):
        a = np.linspace(-1, 1, 4096, dtype=np.float32)
        ckpt = oomguard.Checkpointer(str(tmp_path / mode), fsync=False, compression=mode, compression_level=2)
        ckpt.add_tensor("model/a", a)
        ckpt.save_async(1)
        ckpt.wait()
        assert ckpt.stats.last_compression == want, mode
        with open(tmp_path / mode / "step-00000001" / "MANIFEST.json") as f:
            shard = json.load(f)["shards"][0]
        assert shard["compression"] == want
        # Only auto explains itself (a small state is always compressed).
        assert ("auto" in shard) == (mode == "auto"), shard
        a[:] = 0
        assert ckpt.load_latest() == 1
        assert np.array_equal(a, np.linspace(-1, 1, 4096, dtype=np.float32)), mode
    with pytest.raises(ValueError):
        oomguard.Checkpointer(str(tmp_path / "bad"), compression="gzip")


def test_a_second_process_cannot_train_into_the_same_directory(tmp_path):
    # The first process holds the directory (as rank 0) until told to stop.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, oomguard; c = oomguard.Checkpointer(sys.argv[1]); print('held', flush=True); "
         "sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(oomguard.FailedPreconditionError, match=rf"in use by another process \(pid {holder.pid}\)"):
            oomguard.Checkpointer(str(tmp_path))
        # Another rank of the same job locks its own file; this process may open
        # a second checkpointer of a rank it already holds.
        other = oomguard.Checkpointer(str(tmp_path), rank=1, world_size=2)
        again = oomguard.Checkpointer(str(tmp_path), rank=1, world_size=2)
        del other, again
    finally:
        holder.kill()
        holder.wait()
    # A killed holder leaves nothing locked.
    oomguard.Checkpointer(str(tmp_path)).save_async(0)
