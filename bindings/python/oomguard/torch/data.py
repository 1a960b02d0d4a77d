"""Data that follows the guard's step: a batch is a pure function of the step
number, so a rollback or a resume replays exactly the batches it must.

``StepBatchSampler`` gives ``torch.utils.data.DataLoader`` the batches of
steps ``start, start+1, ...`` (each rank its share of the global batch);
``StepLoader`` restarts the loader at the guard's step whenever it moved
(a rollback, a resume, a skipped step).
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

import torch

from .._guard import Guard
from . import distributed as _distributed

__all__ = ["StepBatchSampler", "StepLoader"]


class StepBatchSampler:
    """A batch sampler whose batch ``k`` is a pure function of ``(seed, k)``, for
    ``DataLoader(dataset, batch_sampler=StepBatchSampler(...))``.

    Batch ``k`` holds dataset indices ``[j*B, (j+1)*B)`` of epoch ``e``'s
    permutation (``e, j = divmod(k, batches_per_epoch)``; seeded with
    ``seed + e``, or in order with ``shuffle=False``); with several ranks this
    rank yields its contiguous share of it (``rank``/``world_size``, default
    torch.distributed's). Iteration starts at ``start`` (``StepLoader`` sets it
    to the guard's next step) and runs for ``steps`` batches in all, or forever.
    """

    def __init__(self, dataset_size: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, steps: Optional[int] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None) -> None:
        if dataset_size < 1 or batch_size < 1:
            raise ValueError(f"StepBatchSampler needs dataset_size >= 1 and batch_size >= 1 "
                             f"(got {dataset_size}, {batch_size})")
        if drop_last and batch_size > dataset_size:
            raise ValueError(f"batch_size {batch_size} > dataset_size {dataset_size} with drop_last: no batch")
        if rank is None and world_size is None and _distributed.world_size() > 1:
            rank, world_size = _distributed.rank(), _distributed.world_size()
        self.rank = 0 if rank is None else rank
        self.world_size = 1 if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"StepBatchSampler: rank {self.rank} is not in [0, {self.world_size})")
        if batch_size < self.world_size:
            raise ValueError(f"batch_size {batch_size} is smaller than the {self.world_size} ranks")
        if steps is not None and steps < 0:
            raise ValueError(f"StepBatchSampler(steps={steps}) must be >= 0")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.steps = steps
        self.start = 0
        full, rest = divmod(dataset_size, batch_size)
        self.batches_per_epoch = full + (1 if rest and not drop_last else 0)
        self._epoch = -1
        self._order: List[int] = []

    def global_batch(self, step: int) -> List[int]:
        """Dataset indices of step ``step``'s whole batch (every rank's)."""
        epoch, j = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(self.dataset_size, generator=g).tolist()
            else:
                self._order = list(range(self.dataset_size))
            self._epoch = epoch
        return self._order[j * self.batch_size:(j + 1) * self.batch_size]

    def batch(self, step: int) -> List[int]:
        """This rank's share of step ``step``'s batch."""
        whole = self.global_batch(step)
        n = len(whole)
        return whole[self.rank * n // self.world_size:(self.rank + 1) * n // self.world_size]

    def __iter__(self) -> Iterator[List[int]]:
        start = self.start  # read now: the DataLoader may draw batches ahead, in its own time
        stop = self.steps

        def batches() -> Iterator[List[int]]:
            k = start
            while stop is None or k < stop:
                yield self.batch(k)
                k += 1

        return batches()

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("a StepBatchSampler without steps= has no length")
        return max(0, self.steps - self.start)


class StepLoader:
    """Iterates a DataLoader at the guard's step, across rollbacks and resumes.

        sampler = ogt.StepBatchSampler(len(dataset), batch_size=64, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        for batch in ogt.StepLoader(loader, guard, steps=1000):
            try:
                train_step(*batch)
            except oomguard.RolledBackError:
                pass   # the next batch is the one of guard.next_step

    Each batch it yields is the one of ``guard.next_step``. When the guard's
    step is not the one after the batch it yielded last (a rollback, a resume,
    a step the loop skipped), the DataLoader's iterator is dropped (its workers
    stop) and a new one starts at the guard's step. Stops when ``guard.next_step``
    reaches ``steps`` (or when the sampler ends).
    """

    def __init__(self, loader: Any, guard: Guard, steps: Optional[int] = None) -> None:
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, StepBatchSampler):
            raise TypeError("StepLoader needs a DataLoader built with batch_sampler=StepBatchSampler(...), so that "
                            "it can start at any step")
        self.loader = loader
        self.sampler = sampler
        self.guard = guard
        self.steps = steps
        self.restarts = 0  # iterators started after the first (rollbacks, skipped steps)

    def __iter__(self) -> Iterator[Any]:
        it: Optional[Iterator[Any]] = None
        at = -1
        first = True
        while self.steps is None or self.guard.next_step < self.steps:
            step = self.guard.next_step
            if it is None or step != at:
                it = None  # drop the old iterator (and its prefetched batches) first
                self.sampler.start = step
                it = iter(self.loader)
                at = step
                self.restarts += 0 if first else 1
                first = False
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch
            at += 1
