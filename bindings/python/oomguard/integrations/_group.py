"""What the trainer integrations share: the batches a trainer accumulates into
one optimizer step, seen as one batch that ``TrainStep`` can split, and the
redo of a step that an OOM in its optimizer step rolled back."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

from .. import errors as _errors
from ..torch.step import batch_samples, split_batch

Piece = Tuple[int, int, Any]  # (index of the trainer's batch in the group, first sample in it, the samples)


def group_sizes(group: Sequence[Any]) -> List[int]:
    """The samples of each batch of a group (ValueError: a batch holds no tensor to split)."""
    sizes = []
    for i, batch in enumerate(group):
        n = batch_samples([batch])
        if n is None:
            raise ValueError(f"batch {i} of the optimizer step holds no tensor with a dim 0 to split along")
        sizes.append(n)
    return sizes


class Group:
    """The batches of one optimizer step, in order, as one batch of
    ``sum(sizes)`` samples: ``pieces(start, stop)`` gives the pieces of the
    trainer's batches that samples ``[start, stop)`` cover, as
    ``(batch index, first sample in that batch, sliced batch)`` triples. Batches may differ in shape beyond
    dim 0 (each is padded to its own length): a piece is never concatenated
    with another, each runs through the model on its own."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = list(batches)
        self.sizes = group_sizes(self.batches)
        self.samples = sum(self.sizes)

    def pieces(self, start: int, stop: int) -> List[Piece]:
        pieces: List[Piece] = []
        offset = 0
        for i, (batch, n) in enumerate(zip(self.batches, self.sizes)):
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                whole = (lo, hi) == (offset, offset + n)
                pieces.append((i, lo - offset, batch if whole else split_batch(batch, lo - offset, hi - offset)))
            offset += n
        return pieces


def split_group(group: "Group", start: int, stop: int) -> List[Piece]:
    """``TrainStep(split=split_group)``: the step's one positional argument is
    the Group (opaque to ``batch_samples``; the step gives ``samples=``)."""
    return group.pieces(start, stop)


class StepThrough:
    """What ``TrainStep`` sees as the optimizer when the trainer owns the
    optimizer step: ``step()`` runs the trainer's own step (with its clipping,
    hooks, scaler), ``zero_grad`` the optimizer's."""

    def __init__(self, optimizer: Any, step: Callable[[], Any]) -> None:
        self._optimizer = optimizer
        self._step = step

    def step(self) -> Any:
        return self._step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)


def run_step(train_step: Any, *batch: Any, incidents: list, **kwargs: Any) -> float:
    """``train_step(*batch, **kwargs)``, redone after a rollback to its own
    start. An OOM in the optimizer step rolls the state back to the snapshot
    the guard's Checkpointer took before this step; the step is then redone
    with the same batch, which a trainer's own loop could not replay. A
    rollback to an older step (a checkpoint on disk) cannot be followed
    inside a trainer's loop: it is raised. ``incidents`` receives the
    step's incidents, those of the rolled back tries too."""
    step = train_step.guard.next_step
    while True:
        try:
            loss = train_step(*batch, **kwargs)
            incidents.extend(train_step.last_report.incidents)
            return loss
        except _errors.RolledBackError as e:
            if e.report is not None:
                incidents.extend(e.report.incidents)
            if e.next_step != step:
                raise
            train_step.guard.next_step = step


class OptimizerState:
    """The optimizer as a rollback snapshot holds it when the trainer steps
    the LR scheduler after the guarded step (after the snapshot): restoring
    the state keeps the hyperparameters the scheduler has set since
    (``lr``, momentum, ...), so that the redone step runs with this step's
    schedule and not the one before it."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        current = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        for group, hyper in zip(self.optimizer.param_groups, current):
            group.update(hyper)


def run_unguarded(guard: Any, run: Callable[[], Any], incidents: list) -> Any:
    """Runs what the guard cannot split (a trainer's evaluation loop or
    validation step, its checkpoint writer) as an evaluation of one unit
    (``Guard.evaluate``): an OOM in it is an incident in the knowledge base
    (phase ``eval``) and the guard releases the caches; it is then run once
    more, and a second OOM is raised (``oomguard.OutOfMemoryError``)."""
    for attempt in (1, 2):
        out: list = []
        try:
            report = guard.evaluate(1, lambda mb: out.append(run()))
        except _errors.OutOfMemoryError as e:
            if getattr(e, "report", None) is not None:
                incidents.extend(e.report.incidents)
            if attempt == 2:
                raise
            continue
        incidents.extend(report.incidents)
        return out[-1]
