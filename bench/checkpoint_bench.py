"""Peers of the checkpoint benchmark: torch.save/torch.load and h5py + gzip on
the same bytes that checkpoint_bench wrote to raw.bin (float32 matrices of
DIM x DIM, each followed by a DIM gain vector). Prints one JSON object.

Usage: /usr/bin/python3 checkpoint_bench.py DIR MIB
"""
import json
import os
import statistics
import sys
import time

import numpy as np

work, mib = sys.argv[1], int(sys.argv[2])
dim = 4096 if mib >= 256 else 1024
raw = np.fromfile(os.path.join(work, "raw.bin"), dtype="<f4")
state, off, i = {}, 0, 0
while off < raw.size:
    state[f"model.layers.{i}.weight"] = raw[off:off + dim * dim].reshape(dim, dim)
    off += dim * dim
    state[f"model.layers.{i}.norm"] = raw[off:off + dim]
    off += dim
    i += 1
nbytes = raw.nbytes
REPEATS = 3  # torch.save/load: median of three (h5py+gzip is slow enough to run once)
out = {"bytes": nbytes}


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


try:
    import torch
    tstate = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    path = os.path.join(work, "state.pt")
    saves, loads = [], []
    for _ in range(REPEATS):  # a new file each time, like a checkpoint
        t0 = time.perf_counter()
        torch.save(tstate, path)
        fsync_file(path)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        loaded = torch.load(path)
        loads.append(time.perf_counter() - t0)
        out["torch_file_bytes"] = os.path.getsize(path)
        assert all(torch.equal(loaded[k], tstate[k]) for k in tstate)
        del loaded
        os.remove(path)
    out["torch_save_s"] = statistics.median(saves)
    out["torch_load_s"] = statistics.median(loads)
except ImportError:
    out["torch"] = "not installed"

import h5py  # noqa: E402
path = os.path.join(work, "state_gzip.h5")
t0 = time.perf_counter()
with h5py.File(path, "w") as f:
    for k, v in state.items():
        chunks = (min(256, v.shape[0]),) + v.shape[1:] if v.ndim > 1 else (min(v.shape[0], 1 << 20),)
        f.create_dataset(k, data=v, chunks=chunks, shuffle=True, compression="gzip", compression_opts=1)
fsync_file(path)
out["h5py_gzip_save_s"] = time.perf_counter() - t0
t0 = time.perf_counter()
with h5py.File(path, "r") as f:
    back = {k: f[k][()] for k in f}
out["h5py_gzip_load_s"] = time.perf_counter() - t0
out["h5py_gzip_file_bytes"] = os.path.getsize(path)
assert all(np.array_equal(back[k], state[k]) for k in state)
os.remove(path)
print(json.dumps(out))
