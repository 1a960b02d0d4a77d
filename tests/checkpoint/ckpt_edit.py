"""Helpers for tests that edit checkpoints with h5py: copy a checkpoint
directory, run an edit on one shard, and fix up MANIFEST.json (size, and the
whole-file xxh3 of format 1 or the shard digest of format 2) the way a
careless or hostile person would, so that only the loader's own checks stand
between the edit and the training run."""
import ctypes
import ctypes.util
import json
import os
import shutil
import struct

import h5py

_XXH = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
_XXH.XXH3_64bits.restype = ctypes.c_uint64
_XXH.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3(data: bytes) -> str:
    """XXH3_64bits (seed 0) as 16 lowercase hex digits, as the checkpoint format stores it."""
    return "%016x" % _XXH.XXH3_64bits(data, len(data))


def shard_digest(path: str) -> str:
    """The format-2 digest of a shard as it is now (docs/checkpoints.md): the
    file cut into its stored chunks and the gaps between them, each region
    hashed, and the (offset, length, hash) records hashed in file order."""
    with open(path, "rb") as f:
        data = f.read()
    chunks = []
    with h5py.File(path, "r") as f:
        base = f.userblock_size

        def visit(_name, obj):
            if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                for i in range(obj.id.get_num_chunks()):
                    info = obj.id.get_chunk_info(i)
                    chunks.append((base + info.byte_offset, info.size))

        f.visititems(visit)
    records, at = [], 0
    for off, size in sorted(chunks):
        if off > at:
            records.append((at, off - at))
        records.append((off, size))
        at = off + size
    if at < len(data):
        records.append((at, len(data) - at))
    packed = b"".join(struct.pack("<QQQ", o, n, _XXH.XXH3_64bits(data[o:o + n], n)) for o, n in records)
    return xxh3(packed)


def fix_manifest(step_dir: str, hashes: bool = True) -> None:
    """Rewrites the manifest's size and hash of every shard to match the files as they are now
    (with hashes=False the size only: the size check passes, the digest stays wrong)."""
    path = os.path.join(step_dir, "MANIFEST.json")
    with open(path) as f:
        m = json.load(f)
    for s in m["shards"]:
        shard = os.path.join(step_dir, s["file"])
        s["bytes"] = os.path.getsize(shard)
        if not hashes:
            continue
        if m["format"] == "oomguard-ckpt/1":
            with open(shard, "rb") as f:
                s["xxh3"] = xxh3(f.read())
        else:
            s["digest"] = shard_digest(shard)
    with open(path, "w") as f:
        json.dump(m, f)


def copy_checkpoints(src: str, dst: str) -> str:
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst
