"""h5py and h5dump read a shard written by the SDK (through the zstd plugin).

Usage: /usr/bin/python3 h5py_read_test.py MLP_TRAIN PLUGIN_DIR
Runs mlp_train with a checkpoint after the last step, then reads that shard
with h5py and checks the format attributes, the filter pipeline and that the
parameters equal the run's --dump-params output bit for bit.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

mlp_train, plugin_dir = sys.argv[1], sys.argv[2]
os.environ["HDF5_PLUGIN_PATH"] = plugin_dir
import h5py  # noqa: E402  (after HDF5_PLUGIN_PATH is set)

with tempfile.TemporaryDirectory() as work:
    ckpt = os.path.join(work, "ck")
    params = os.path.join(work, "params.bin")
    subprocess.run([mlp_train, "--steps", "10", "--hidden", "24", "--quiet", "--ckpt-dir", ckpt,
                    "--ckpt-every", "5", "--dump-params", params], check=True)
    shard = os.path.join(ckpt, "step-00000009", "rank-00000.h5")
    with h5py.File(shard, "r") as f:
        assert f.attrs["format"] in (b"oomguard-ckpt/2", "oomguard-ckpt/2"), f.attrs["format"]
        # A small state is always compressed (compression = auto decides only
        # for states large enough that the choice matters).
        assert f.attrs["compression"] in (b"zstd-1", "zstd-1"), f.attrs["compression"]
        assert int(f.attrs["step"]) == 9 and int(f.attrs["rank"]) == 0 and int(f.attrs["world_size"]) == 1
        w = f["model/fc2.weight"]
        assert w.shape == (24, 24) and w.dtype == np.float64, (w.shape, w.dtype)
        # The pipeline names shuffle (2) then zstd (32015).
        plist = w.id.get_create_plist()
        ids = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        assert ids == [2, 32015], ids
        assert len(w.attrs["xxh3"]) == 16
        # Format 2: one XXH3 per chunk of the tensor's bytes.
        assert w.attrs["chunk_xxh3"].dtype == np.uint64 and w.attrs["chunk_xxh3"].shape == (w.id.get_num_chunks(),)
        names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
        got = np.concatenate([f["model/" + n][()].ravel() for n in names])
    want = np.fromfile(params, dtype="<f8")
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(got, want), "shard parameters differ from the run's final parameters"
    out = subprocess.run(["h5dump", "-d", "/model/fc3.bias", shard], capture_output=True, text=True,
                         env=dict(os.environ))
    assert out.returncode == 0 and "DATA" in out.stdout, out.stdout + out.stderr
    print("ok: h5py and h5dump read", shard)
