#!/usr/bin/env python3
"""Checkpoints edited with h5py by someone else (issue 15, items 1, 2 and 5; issue 28, rows 2, 4, 8, 11).

Each case edits the shard of the newest checkpoint (step 9) and fixes up the
manifest's size and hash, as a careless or hostile person would. Then:
  * `oomguard ckpt verify DIR --step 9` exits 1 with a line naming the tensor
    and what is wrong (never 0, never a crash);
  * `oomguard ckpt verify DIR` (every checkpoint) exits 1 too;
  * `mlp_train --resume` skips step 9 with a warning naming the tensor and
    resumes from step 4, which it verifies;
  * nothing outside the checkpoint directory was read into the run.

Usage: hostile_ckpt_test.py OOMGUARD MLP_TRAIN HDF5_PLUGIN_DIR
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_edit  # noqa: E402

FAILS = []
SECRET = b"SECRET!!"  # 8 bytes: one float64, the size of model/fc3.bias


def check(cond, what):
    if not cond:
        FAILS.append(what)
        print("FAIL:", what)


def run(cmd, timeout=60):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, -999, "", "timed out after %d s" % timeout)


def retag(ds, dtype_name, data: bytes):
    ds.attrs["dtype"] = np.bytes_(dtype_name)
    ds.attrs["xxh3"] = np.bytes_(ckpt_edit.xxh3(data))


# ---- the edits: each takes (open shard, outside dir) and names the tensor it broke

def external_storage(f, outside):
    """model/fc3.bias reads its 8 bytes from a file outside the checkpoint."""
    del f["model/fc3.bias"]
    ds = f.create_dataset("model/fc3.bias", shape=(1,), dtype="<f8",
                          external=[(os.path.join(outside, "secret.bin"), 0, 8)])
    retag(ds, "float64", SECRET)  # a hash that matches what it would read
    return "model/fc3.bias", "external"


def external_link(f, outside):
    """model/fc3.bias is an external link to a dataset in another file."""
    other = os.path.join(outside, "other.h5")
    with h5py.File(other, "w") as o:
        ds = o.create_dataset("data", data=np.frombuffer(SECRET, dtype="<f8"))
        retag(ds, "float64", SECRET)
    del f["model/fc3.bias"]
    f["model/fc3.bias"] = h5py.ExternalLink(other, "/data")
    return "model/fc3.bias", "link"


def virtual_dataset(f, outside):
    """model/fc3.bias is a virtual dataset mapped onto another file."""
    other = os.path.join(outside, "virtual-source.h5")
    with h5py.File(other, "w") as o:
        o.create_dataset("data", data=np.frombuffer(SECRET, dtype="<f8"))
    layout = h5py.VirtualLayout(shape=(1,), dtype="<f8")
    layout[:] = h5py.VirtualSource(other, "data", shape=(1,))
    del f["model/fc3.bias"]
    ds = f.create_virtual_dataset("model/fc3.bias", layout)
    retag(ds, "float64", SECRET)
    return "model/fc3.bias", "virtual"


def soft_link(f, outside):
    """model/fc3.bias is a soft link to another dataset of the same shape."""
    data = f["model/fc3.bias"][()]
    ds = f.create_dataset("elsewhere/bias", data=data)
    retag(ds, "float64", data.tobytes())
    del f["model/fc3.bias"]
    f["model/fc3.bias"] = h5py.SoftLink("/elsewhere/bias")
    return "model/fc3.bias", "link"


def huge_object(f, outside):
    """optimizer/state declares 1 TiB that the file does not hold (a fill-value dataset)."""
    del f["optimizer/state"]
    ds = f.create_dataset("optimizer/state", shape=(1 << 40,), dtype="u1")
    retag(ds, "uint8", b"")
    return "optimizer/state", "bytes"


def overflowing_dims(f, outside):
    """optimizer/state declares dimensions whose product does not fit in 64 bits."""
    del f["optimizer/state"]
    ds = f.create_dataset("optimizer/state", shape=(1 << 40, 1 << 40), dtype="u1", chunks=(1, 1 << 20))
    retag(ds, "uint8", b"")
    return "optimizer/state", "overflow"


def deleted_tensor(f, outside):
    """model/fc3.bias is gone (item 5: verify must refuse what load refuses)."""
    del f["model/fc3.bias"]
    return "model/fc3.bias", "missing"


def deep_groups(f, outside):
    """Issue 28, row 2: groups nested 3,000 deep (HDF5's own walk took about a minute at 2,000 levels
    and overflowed the stack at 20,000). The digest stays wrong: its helper walks with HDF5 too."""
    g = f.create_group("model/deep")
    for _ in range(3000):
        g = g.create_group("g")
    return "model/deep", "deeper"


deep_groups.hashes = False


def rank_past_int(f, outside):
    """Issue 28, row 11: root attribute rank = 2^32, once narrowed to rank 0."""
    f.attrs["rank"] = np.int64(1 << 32)
    return "rank 4294967296", "out of range"


def zero_frames(chunk: int) -> bytes:
    """A zstd frame of `chunk` zero bytes in RLE blocks: 4 bytes per 128 KiB."""
    out = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", chunk)
    done = 0
    while done < chunk:
        n = min(chunk - done, 128 << 10)
        done += n
        out += struct.pack("<I", (n << 3) | (1 << 1) | (done == chunk))[:3] + b"\0"
    return out


def declared_amplification(f, outside):
    """Issue 28, row 8: optimizer/state declares 1 GiB in about 32 KiB of zstd RLE frames, within
    what zstd can expand; the digest stays wrong. Refused before anything of that size is allocated."""
    del f["optimizer/state"]
    chunk, chunks = 256 << 20, 4
    ds = f.create_dataset("optimizer/state", shape=(chunk * chunks,), dtype="u1", chunks=(chunk,),
                          compression=32015, compression_opts=(1,), shuffle=True, allow_unknown_filter=True)
    frame = zero_frames(chunk)
    for i in range(chunks):
        ds.id.write_direct_chunk((i * chunk,), frame)
    retag(ds, "uint8", b"")
    ds.attrs["chunk_xxh3"] = np.ones(chunks, dtype="<u8")
    inventory = json.loads(f.attrs["tensors"])
    for t in inventory:
        if t["path"] == "optimizer/state":
            t["shape"] = [chunk * chunks]
    f.attrs["tensors"] = np.bytes_(json.dumps(inventory))
    return "digest", "differs"


declared_amplification.hashes = False

CASES = [external_storage, external_link, virtual_dataset, soft_link, huge_object, overflowing_dims,
         deleted_tensor, deep_groups, rank_past_int, declared_amplification]


def non_utf8_json(og, base, tmp):
    """Issue 28, row 4: `ckpt inspect --json` of a shard with a dataset name and a dtype attribute
    holding byte 0xFF, and `ckpt list --json` with a manifest error cut inside a UTF-8 character,
    print JSON (the bytes replaced) instead of aborting."""
    d = ckpt_edit.copy_checkpoints(base, os.path.join(tmp, "non_utf8"))
    shard = os.path.join(d, "step-00000009", "rank-00000.h5")
    with h5py.File(shard, "r+") as f:
        f.create_dataset(b"model/\xffname", data=np.zeros(3))
        f["model/fc3.bias"].attrs["dtype"] = np.bytes_(b"float\xff")
    r = run([og, "ckpt", "inspect", shard, "--json"])
    check(r.returncode == 0, "inspect --json of names with 0xFF exits 0 (got %d): %s" % (r.returncode, r.stderr))
    try:
        paths = {t["path"]: t["dtype"] for t in json.loads(r.stdout)["tensors"]}
    except ValueError:
        paths = {}
    check("/model/\ufffdname" in paths and paths.get("/model/fc3.bias") == "float\ufffd",
          "inspect --json shows the bytes replaced: %s" % r.stdout[:400])
    manifest = os.path.join(d, "step-00000004", "MANIFEST.json")
    with open(manifest) as f:
        m = json.load(f)
    m["format"] = "x" * 63 + "\u00e9"  # the error quotes 64 bytes: the cut falls inside the e-acute
    with open(manifest, "w", encoding="utf-8") as f:
        json.dump(m, f, ensure_ascii=False)
    r = run([og, "ckpt", "list", d, "--json"])
    check(r.returncode == 0, "list --json with a cut message exits 0 (got %d): %s" % (r.returncode, r.stderr))
    try:
        problems = {c["step"]: c["problem"] for c in json.loads(r.stdout)}
    except ValueError:
        problems = {}
    check("\ufffd" in problems.get(4, ""), "list --json reports the cut message, replaced: %s" % r.stdout[:400])


def main():
    og, mlp, plugins = sys.argv[1:4]
    os.environ["HDF5_PLUGIN_PATH"] = plugins
    tmp = tempfile.mkdtemp(prefix="oomguard-hostile-")
    try:
        run_cases(og, mlp, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if FAILS:
        print("%d failure(s)" % len(FAILS))
        sys.exit(1)
    print("hostile checkpoints: %d cases refused by verify and resume; JSON of non-UTF-8 names" % len(CASES))


def run_cases(og, mlp, tmp):
    base = os.path.join(tmp, "base")
    train = [mlp, "--steps", "10", "--hidden", "16", "--ckpt-every", "5", "--keep", "0", "--quiet"]
    r = run(train + ["--ckpt-dir", base])
    check(r.returncode == 0, "mlp_train writes the base checkpoints: %s" % r.stderr)
    check(run([og, "ckpt", "verify", base]).returncode == 0, "the base checkpoints verify")
    # The fix-up below recomputes digests the way the writer does: checked on
    # an untouched shard, so that refusals below come from the edits alone.
    with open(os.path.join(base, "step-00000009", "MANIFEST.json")) as f:
        pristine = json.load(f)["shards"][0]
    got = ckpt_edit.shard_digest(os.path.join(base, "step-00000009", pristine["file"]))
    check(got == pristine["digest"], "ckpt_edit.shard_digest matches the writer's: %s vs %s" % (got, pristine["digest"]))
    for case in CASES:
        name = case.__name__
        outside = os.path.join(tmp, name + "-outside")
        os.makedirs(outside)
        with open(os.path.join(outside, "secret.bin"), "wb") as s:
            s.write(SECRET)
        d = ckpt_edit.copy_checkpoints(base, os.path.join(tmp, name))
        step9 = os.path.join(d, "step-00000009")
        with h5py.File(os.path.join(step9, "rank-00000.h5"), "r+") as f:
            tensor, why = case(f, outside)
        ckpt_edit.fix_manifest(step9, hashes=getattr(case, "hashes", True))

        r = run([og, "ckpt", "verify", d, "--step", "9"])
        out = r.stdout + r.stderr
        check(r.returncode == 1, "%s: verify --step 9 exits 1 (got %d): %s" % (name, r.returncode, out.strip()))
        check(tensor in out and why in out.lower(),
              "%s: verify names %s and says %r: %s" % (name, tensor, why, out.strip()))
        r = run([og, "ckpt", "verify", d, "--json"])
        check(r.returncode == 1, "%s: verify of every checkpoint exits 1 (got %d)" % (name, r.returncode))
        try:
            res = {c["step"]: c["ok"] for c in json.loads(r.stdout)["checkpoints"]}
        except ValueError:
            res = {}
        check(res == {4: True, 9: False}, "%s: verify --json: step 4 ok, step 9 bad: %s" % (name, r.stdout.strip()))

        r = run([mlp, "--steps", "12", "--hidden", "16", "--ckpt-every", "5", "--keep", "0", "--ckpt-dir", d,
                 "--resume", "--json"])
        check(r.returncode == 0, "%s: resume exits 0 (got %d): %s" % (name, r.returncode, r.stderr.strip()[-400:]))
        try:
            summary = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            summary = {}
        check(summary.get("resumed_from_step") == 4,
              "%s: resume skips step 9 and takes step 4: %s" % (name, r.stdout.strip()[-300:]))
        check("skipping checkpoint step 9" in r.stderr and tensor in r.stderr,
              "%s: resume warns, naming %s: %s" % (name, tensor, r.stderr.strip()[-400:]))
    non_utf8_json(og, base, tmp)


if __name__ == "__main__":
    main()
