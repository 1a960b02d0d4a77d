"""Peers of the checkpoint benchmark: torch.save/torch.load and h5py + gzip on
the same bytes that checkpoint_bench wrote to raw.bin (float32 matrices of
DIM x DIM, each followed by a DIM gain vector). torch.save/torch.load run in
alternation with oomguard's own save/load of the same arrays (through the
Python bindings, when PYTHONPATH finds them), so both sides of that
comparison see the same machine state. Prints one JSON object.

Usage: scripts/python checkpoint_bench.py DIR MIB
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
PAIRS = 8  # torch vs oomguard, alternating; h5py+gzip is slow enough to run once
out = {"bytes": nbytes, "pairs": PAIRS}


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


try:
    import torch
except ImportError:
    torch = None
    out["torch"] = "not installed"
try:
    import oomguard
except ImportError:
    oomguard = None
    out["oomguard"] = "bindings not on PYTHONPATH"

if torch is not None:
    tstate = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    path = os.path.join(work, "state.pt")
    ours = None
    if oomguard is not None:
        ours = oomguard.Checkpointer(os.path.join(work, "py-ckpt"), keep=1)
        for k, v in state.items():
            ours.add_tensor(k.replace(".", "/", 1), v)
    step = [0]

    def torch_save():
        torch.save(tstate, path)  # a new file each time, like a checkpoint
        fsync_file(path)

    def our_save():
        ours.save_async(step[0])
        ours.wait()
        step[0] += 1
        out.setdefault("our_compression", []).append(ours.stats.last_compression)

    def settle():
        # Untimed: the checkpoint retention dropped is deleted in the
        # background; the next timed operation must not share the disk with
        # it (torch.save's old file is removed untimed too, below).
        ckdir = os.path.join(work, "py-ckpt")
        deadline = time.monotonic() + 60
        while any(n.startswith(".removing-") for n in os.listdir(ckdir)):
            if time.monotonic() > deadline:
                sys.exit("checkpoint_bench: the checkpoint retention dropped is still not deleted after 60 s")
            time.sleep(0.002)

    times = {"torch_save": [], "torch_load": [], "our_save": [], "our_load": []}
    for p in range(PAIRS):
        pair = [("torch_save", torch_save), ("our_save", our_save)] if ours else [("torch_save", torch_save)]
        for name, fn in (pair if p % 2 == 0 else pair[::-1]):
            times[name].append(timed(fn))
            if ours:
                settle()
        loaded = {}
        tl = [("torch_load", lambda: loaded.update(torch.load(path)))]
        if ours:
            tl.append(("our_load", ours.load_latest))
        for name, fn in (tl if p % 2 == 0 else tl[::-1]):
            times[name].append(timed(fn))
        assert all(torch.equal(loaded[k], tstate[k]) for k in tstate)
        out["torch_file_bytes"] = os.path.getsize(path)
        loaded.clear()
        os.remove(path)
    for name, t in times.items():
        if t:
            out[name + "_s"] = statistics.median(t)
            out[name + "_range_s"] = [min(t), max(t)]

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
