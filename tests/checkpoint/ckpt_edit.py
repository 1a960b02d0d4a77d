"""Helpers for tests that edit checkpoints with h5py: copy a checkpoint
directory, run an edit on one shard, and fix up MANIFEST.json (size and
whole-file xxh3) the way a careless or hostile person would, so that only the
loader's own checks stand between the edit and the training run."""
import ctypes
import ctypes.util
import json
import os
import shutil

_XXH = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
_XXH.XXH3_64bits.restype = ctypes.c_uint64
_XXH.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3(data: bytes) -> str:
    """XXH3_64bits (seed 0) as 16 lowercase hex digits, as the checkpoint format stores it."""
    return "%016x" % _XXH.XXH3_64bits(data, len(data))


def fix_manifest(step_dir: str) -> None:
    """Rewrites the manifest's bytes and xxh3 of every shard to match the files as they are now."""
    path = os.path.join(step_dir, "MANIFEST.json")
    with open(path) as f:
        m = json.load(f)
    for s in m["shards"]:
        with open(os.path.join(step_dir, s["file"]), "rb") as f:
            data = f.read()
        s["bytes"] = len(data)
        s["xxh3"] = xxh3(data)
    with open(path, "w") as f:
        json.dump(m, f)


def copy_checkpoints(src: str, dst: str) -> str:
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst
