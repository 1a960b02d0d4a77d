"""oomguard.Checkpointer: sharded asynchronous checkpoints through the C++ core.

Tensors and NumPy arrays are registered by address, without a copy: the
checkpointer reads them while a save is staged and writes into them on
restore, so they must keep their storage. Objects (optimizer state, RNG
state, data position) are registered with ``save() -> bytes`` and
``load(bytes)`` functions.

Registration may also be deferred (``defer``): ``oomguard.torch.register_state``
registers a model's tensors only when the checkpointer is first used (the
first save, load, restore or guarded step), so a model moved or converted
after ``register_state`` (``.to(device)``, ``.double()``) is checkpointed as
it trains; tensors replaced after that first use are refused loudly.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Tuple

from . import _oomguard as _C
from .errors import CheckpointNotFoundError, FailedPreconditionError

_NUMPY_DTYPES = {
    "float16": "float16", "float32": "float32", "float64": "float64",
    "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "bool": "bool",
}
_TORCH_DTYPES = {
    "torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32",
    "torch.float64": "float64", "torch.int8": "int8", "torch.int16": "int16",
    "torch.int32": "int32", "torch.int64": "int64", "torch.uint8": "uint8", "torch.bool": "bool",
}


def _describe(value: Any):
    """(dtype name, shape, data pointer, location) of a torch tensor or NumPy array."""
    if hasattr(value, "data_ptr") and hasattr(value, "is_contiguous"):  # torch.Tensor
        if not value.is_contiguous():
            raise ValueError("checkpointed tensors must be contiguous (registered by address)")
        dtype = _TORCH_DTYPES.get(str(value.dtype))
        if dtype is None:
            raise ValueError(f"unsupported tensor dtype {value.dtype}")
        location = "cuda" if value.device.type == "cuda" else "host"
        if value.device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported tensor device {value.device}")
        return dtype, list(value.shape), value.data_ptr(), location
    interface = getattr(value, "__array_interface__", None)
    if interface is not None:  # NumPy
        if not value.flags["C_CONTIGUOUS"] or not value.flags["WRITEABLE"]:
            raise ValueError("checkpointed arrays must be C-contiguous and writeable")
        dtype = _NUMPY_DTYPES.get(value.dtype.name)
        if dtype is None:
            raise ValueError(f"unsupported array dtype {value.dtype}")
        return dtype, list(value.shape), interface["data"][0], "host"
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def _torch_distributed_world() -> Tuple[Optional[int], Optional[int]]:
    """(rank, world size) of torch.distributed's default group, or (None, None)
    when torch is not imported or no process group is initialised. Looked up in
    sys.modules: ``import oomguard`` never imports torch."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None, None
    return dist.get_rank(), dist.get_world_size()


def _torch_current_streams() -> list:
    """torch's current CUDA stream, when torch is in use with CUDA (else none:
    the copies then wait for the default stream)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [torch.cuda.current_stream().cuda_stream]


class Checkpointer:
    """Sharded checkpoints in format oomguard-ckpt/2 (HDF5; shuffle + zstd when it pays).

    Give it to ``Guard(recovery=...)``: the guard then saves every
    ``every_steps`` steps (and after an OOM was recovered), restores the
    in-memory snapshot when an OOM hits the optimizer step, and rolls every
    rank back to the newest complete checkpoint when splitting is not enough.

    ``rank`` and ``world_size`` default to torch.distributed's when a process
    group is initialised (else 0 and 1), so that every process writes its own
    shard; values that contradict the process group raise ValueError, and a
    Guard whose coordinator disagrees with them refuses the Checkpointer.

    Thread-safety: registration, save, load and restore from one thread.
    """

    def __init__(
        self,
        dir: str,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        every_steps: int = 0,
        save_after_recovery: bool = True,
        keep: int = 3,
        compression: str = "auto",
        compression_level: int = 1,
        chunk_bytes: int = 1 << 20,
        threads: int = 0,
        stage_threads: int = 0,
        staging_budget_bytes: int = 0,
        keep_snapshot: bool = True,
        manifest_commit: str = "auto",
        fsync: bool = True,
        verify_file_checksum: bool = True,
    ) -> None:
        dist_rank, dist_world = _torch_distributed_world()
        if dist_rank is not None:
            if rank is not None and rank != dist_rank:
                raise ValueError(f"Checkpointer(rank={rank}) in the process of torch.distributed rank {dist_rank}: "
                                 "two processes would write the same shard (leave rank unset)")
            if world_size is not None and world_size != dist_world:
                raise ValueError(f"Checkpointer(world_size={world_size}) with a torch.distributed world of "
                                 f"{dist_world} ranks (leave world_size unset)")
            rank, world_size = dist_rank, dist_world
        rank = 0 if rank is None else rank
        world_size = 1 if world_size is None else world_size
        o = _C.CheckpointOptions()
        o.dir = str(dir)
        o.rank = rank
        o.world_size = world_size
        o.every_steps = every_steps
        o.save_after_recovery = save_after_recovery
        o.keep = keep
        o.compression = compression
        o.compression_level = compression_level
        o.chunk_bytes = chunk_bytes
        o.threads = threads
        o.stage_threads = stage_threads
        o.staging_budget_bytes = staging_budget_bytes
        o.keep_snapshot = keep_snapshot
        # "auto": one rank commits its own manifests; with several, rank 0
        # commits once every shard is durable (the guard's vote says when).
        o.manifest_commit = manifest_commit
        o.fsync = fsync
        o.verify_file_checksum = verify_file_checksum
        # CUDA tensors are copied after the work torch queued on its current
        # stream, which is not always the default one.
        o.cuda_streams = _torch_current_streams
        self.native = _C.Checkpointer(o)
        self.registered: dict = {}  # path -> what register_state put there (tensor, optimizer, ...)
        self._deferred: List[Callable[[], None]] = []  # registrations run at the first use
        self._checks: List[Callable[[], None]] = []    # run before every later use
        self._bound = False

    @property
    def rank(self) -> int:
        return self.native.options.rank

    @property
    def world_size(self) -> int:
        return self.native.options.world_size

    def _before_registration(self, path: str) -> None:
        if self._bound:
            raise FailedPreconditionError(
                f"Checkpointer: /{path} registered after the checkpointer was first used (a save, load, restore "
                "or guarded step): register all state before, or checkpoints would not hold it")

    def add_tensor(self, path: str, value: Any) -> None:
        """Registers a contiguous tensor or array at ``/<path>`` by address (no copy)."""
        self._before_registration(path)
        dtype, shape, ptr, location = _describe(value)
        self.native.add_tensor(path, dtype, shape, ptr, value, location)

    def add_object(self, path: str, save: Callable[[], bytes], load: Callable[[bytes], Any]) -> None:
        """Registers a stateful object stored as bytes at ``/<path>``."""
        self._before_registration(path)
        self.native.add_object(path, save, load)

    def defer(self, register: Callable[[], None], check: Optional[Callable[[], None]] = None) -> None:
        """Runs ``register()`` (which calls add_tensor/add_object) at the first use
        of the checkpointer instead of now, and ``check()`` before every use
        after that (it raises when what was registered no longer holds)."""
        self._before_registration("(deferred)")
        self._deferred.append(register)
        if check is not None:
            self._checks.append(check)

    def prepare(self) -> None:
        """Registers deferred state (once), or checks it (every later call).
        Every save, load and restore calls it, and so does a Guard before each
        step; call it yourself only before using ``native`` directly."""
        if not self._bound:
            deferred, self._deferred = self._deferred, []
            for register in deferred:
                register()
            self._bound = True
            return
        for check in self._checks:
            check()

    def save_async(self, step: int) -> None:
        """Stages the registered state as ``step``; compression and writing continue in the background."""
        self.prepare()
        self.native.save_async(step)

    def wait(self) -> None:
        """Waits until every started save is durable; raises the first background error."""
        self.native.wait()

    def load_latest(self) -> Optional[int]:
        """Loads the newest checkpoint that verifies and returns its step; None when there is none.

        Raises CorruptCheckpointError when checkpoints exist but none verifies.
        """
        self.prepare()
        try:
            return self.native.load_latest()
        except CheckpointNotFoundError:
            return None

    def load(self, step: int) -> int:
        self.prepare()
        return self.native.load(step)

    def restore(self, step: int) -> None:
        """Restores exactly ``step``: from the in-memory snapshot when it holds it, else from
        disk. Raises (CorruptCheckpointError, CheckpointNotFoundError) rather than restore another step."""
        self.prepare()
        self.native.restore(step)

    def snapshot(self, step: int) -> None:
        """Keeps a copy of the registered state in memory as ``step`` (nothing is written)."""
        self.prepare()
        self.native.snapshot(step)

    def durable_steps(self) -> List[int]:
        """Steps whose shard of this rank is durable (committed or not), ascending."""
        return self.native.durable_steps()

    def snapshot_step(self) -> Optional[int]:
        """The step of the in-memory snapshot, or None."""
        return self.native.snapshot_step()

    @property
    def stats(self) -> _C.CheckpointStats:
        return self.native.stats

    @property
    def dir(self) -> str:
        return self.native.options.dir


list_checkpoints = _C.list_checkpoints
verify_checkpoint = _C.verify_checkpoint
inspect_shard = _C.inspect_shard
