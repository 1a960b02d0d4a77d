"""One rank of the FSDP2 tests (test_fsdp.py): the project's small GPT
(examples/python/train_gpt.py) sharded with fully_shard per block and on the
model, trained over gloo through TrainStep for each plan of a list, in one
process group.

    fsdp_worker.py RANK WORLD INIT_FILE OUT_DIR PLANS_JSON

A plan: {"name", "steps", "micro" (initial micro-batch, 0: whole), "sync"
("every"/"last"), "faults" (OOMGUARD_FAULTS rules), "units" ([[rank, step,
unit, phase, nth]...]: a torch.OutOfMemoryError raised on that rank when unit
`unit` (0..layers-1 the blocks, "root" the rest) runs its `nth` forward or
backward ("forward"/"backward") of that step), "budget" ([rank, bytes]: the
oomguard.budget allocator on that rank), "ckpt" (checkpoint every N steps, 0
none), "plain" (true: the unconstrained FSDP run, no guard), "agreement"
("data"/"check"), "at" and "replay_oom" (PositionFaults), "reshard_at" (step:
set_reshard_after_forward(False) before it), "corrupt_at" ([step, position]:
the recorded schedule made wrong there), "prefetch" (true: explicit forward and
backward prefetching between the blocks), "alone" (each rank writes
<name>.rank<r>.json and exits: for a plan after which the ranks are out of
step)}. Rank 0 writes
OUT_DIR/<name>.f64 (the full parameters) and OUT_DIR/<name>.json.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
import train_gpt  # noqa: E402  (the project's small GPT)

import oomguard  # noqa: E402
import oomguard.budget  # noqa: E402
import oomguard.torch as ogt  # noqa: E402

GLOBAL_BATCH, CONTEXT, VOCAB, WIDTH, LAYERS, HEADS = 16, 8, 31, 16, 2, 2
DEADLINE_MS = 20000


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = train_gpt.TinyGPT(VOCAB, WIDTH, LAYERS, HEADS, CONTEXT).double()
    train_gpt.shard_per_block(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95))
    return model, optimizer


class UnitFaults:
    """Injected OOMs at a unit's forward (a forward pre-hook) or backward (a
    hook on the unit's output gradient), counted per step."""

    def __init__(self, model, rank: int, rules) -> None:
        self.rules = [list(r) + [False] for r in rules if r[0] == rank]
        self.step = -1
        self.seen = {}
        units = {str(i): b for i, b in enumerate(model.blocks)}
        units["root"] = model
        for name, unit in units.items():
            unit.register_forward_pre_hook(lambda m, args, name=name: self.hit(name, "forward"))
            unit.register_forward_hook(lambda m, args, out, name=name: self._on_output(name, out))

    def wrap_allocations(self, model) -> None:
        """OOMs inside FSDP's own buffer allocation of a unit's all-gather or
        reduce-scatter ("all_gather"/"reduce_scatter" rules): after the last
        check, before the collective."""
        units = {str(i): b for i, b in enumerate(model.blocks)}
        units["root"] = model
        for name, unit in units.items():
            group = unit._get_fsdp_state()._fsdp_param_group
            for attr, phase in (("_all_gather_comm", "all_gather"), ("_reduce_scatter_comm", "reduce_scatter")):
                comm = getattr(group, attr)
                inner = comm.allocate

                def allocate(*a, _inner=inner, _name=name, _phase=phase, **k):
                    self.hit(_name, _phase)
                    return _inner(*a, **k)
                comm.allocate = allocate

    def _on_output(self, name, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, name=name: self.hit(name, "backward"))

    def begin(self, step: int) -> None:
        if step != self.step:
            self.step, self.seen = step, {}

    def hit(self, unit: str, phase: str) -> None:
        key = (unit, phase)
        nth = self.seen.get(key, 0)
        self.seen[key] = nth + 1
        for r in self.rules:
            if not r[5] and r[1] == self.step and str(r[2]) == unit and r[3] == phase and r[4] == nth:
                r[5] = True
                raise torch.OutOfMemoryError(f"injected at unit {unit} {phase} #{nth} of step {self.step}")


def run_plain(plan, rank, world):
    """The unconstrained FSDP run: each rank's whole share in one forward, the
    loss weighed by the rank's share of the global batch's valid tokens."""
    model, optimizer = build()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train_gpt.warmup_cosine(2, plan["steps"]))
    lo, hi = rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world
    for step in range(plan["steps"]):
        tokens, labels = train_gpt.make_batch(0, step, GLOBAL_BATCH, CONTEXT, VOCAB)
        units = torch.tensor([float((labels[lo:hi] != -1).sum())], dtype=torch.float64)
        total = units.clone()
        dist.all_reduce(total)
        optimizer.zero_grad(set_to_none=True)
        loss = train_gpt.token_loss(model(tokens[lo:hi]), labels[lo:hi])
        (loss * (world * units.item() / total.item())).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return model, {"ooms": 0}


class PositionFaults:
    """Injected OOMs at a position of the FSDP collectives of a micro-batch
    (the agreement's fault hook): [rank, step, micro, where, position] with
    where "before" (this rank fails before entering collective `position` of
    the step's `micro`-th micro-batch call, counting redone ones) or "after"
    (after it completed), and optionally "error" (a ValueError, not an OOM);
    "replay" rules [rank, step] make the replay's allocation fail (both
    attempts)."""

    def __init__(self, agreement, rank: int, rules, replay_rules) -> None:
        self.rules = [list(r) + [False] for r in rules if r[0] == rank]
        self.replay = [list(r) + [False] for r in replay_rules if r[0] == rank]
        self.step, self.micro = -1, -1
        inner = agreement.run_micro

        def run_micro(*a, **k):
            self.micro += 1
            return inner(*a, **k)
        agreement.run_micro = run_micro
        agreement.fault_hook = self.hit

    def begin(self, step: int) -> None:
        if step != self.step:
            self.step, self.micro = step, -1

    def hit(self, where: str, pos: int) -> None:
        if where == "replay":
            for r in self.replay:
                if r[1] == self.step and (not r[2] or pos == 1):
                    r[2] = True
                    raise torch.OutOfMemoryError(f"injected in the replay's allocation (attempt {pos})")
            return
        for r in self.rules:
            if not r[-1] and r[1] == self.step and r[2] == self.micro and r[3] == where and r[4] == pos:
                r[-1] = True
                text = f"injected {where} FSDP collective {pos} of micro-batch call {self.micro} of step {self.step}"
                if len(r) > 6 and r[5] == "error":
                    raise ValueError(text)
                raise torch.OutOfMemoryError(text)


def run_guarded(plan, rank, world, out_dir):
    model, optimizer = build()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, train_gpt.warmup_cosine(2, plan["steps"]))
    ckpt = None
    if plan.get("ckpt"):
        ckpt = oomguard.Checkpointer(str(pathlib.Path(out_dir) / f"ckpt-{plan['name']}"), every_steps=plan["ckpt"])
        ogt.register_state(ckpt, model=model, optimizer=optimizer, scheduler=scheduler)
    guard = oomguard.Guard(initial_micro_batch=plan.get("micro", 0), grow_after=plan.get("grow_after", 2),
                           recovery=ckpt, coordinator=ogt.TorchDistributedCoordinator(),
                           vote_deadline_ms=DEADLINE_MS, **ogt.fsdp.GUARD_OPTIONS)
    step_fn = ogt.TrainStep(model, optimizer, train_gpt.token_loss, guard=guard, loss_units=train_gpt.valid_tokens,
                            scheduler=scheduler, clip_grad_norm=1.0, fsdp_sync=plan.get("sync", "every"),
                            fsdp_agreement=plan.get("agreement", "data"))
    if plan.get("prefetch"):
        # FSDP2's explicit prefetching: each block's all-gather issued from the one before it (forward)
        # or after it (backward), so collectives run in another order than the modules.
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
        model.set_modules_to_forward_prefetch(blocks[:1])
    faults = UnitFaults(model, rank, plan.get("units", []))
    faults.wrap_allocations(model)
    positions = PositionFaults(step_fn._fsdp, rank, plan.get("at", []), plan.get("replay_oom", []))
    lo, hi = rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world
    oomguard.set_fault_rules(plan.get("faults", ""))
    budget = plan.get("budget")
    if budget and budget[0] == rank:
        oomguard.budget.install(int(budget[1]))
    rollbacks, t0 = 0, time.monotonic()
    try:
        while guard.next_step < plan["steps"]:
            step = guard.next_step
            faults.begin(step)
            positions.begin(step)
            if plan.get("reshard_at") == step:
                # A new collective sequence (the root and blocks keep their parameters after forward): the
                # schedule recorded so far no longer holds.
                model.set_reshard_after_forward(False)
            if plan.get("corrupt_at", [None])[0] == step and step_fn._fsdp.schedules:
                # A schedule that differs from what FSDP runs at one position: every rank leaves data mode there.
                for key, sched in step_fn._fsdp.schedules.items():
                    kind, unit, numel, dtype = sched[plan["corrupt_at"][1]]
                    sched[plan["corrupt_at"][1]] = (kind, unit, numel + 1, dtype)
            tokens, labels = train_gpt.make_batch(0, step, GLOBAL_BATCH, CONTEXT, VOCAB)
            try:
                step_fn(tokens[lo:hi], labels[lo:hi])
            except oomguard.RolledBackError:
                rollbacks += 1
    finally:
        peak = oomguard.budget.peak() if budget and budget[0] == rank else 0
        if budget and budget[0] == rank:
            oomguard.budget.uninstall()
        oomguard.clear_fault_rules()
    guard.finish()
    agreement = step_fn._fsdp
    return model, {"ooms": guard.total_ooms, "rollbacks": rollbacks, "checks": agreement.checks,
                   "collectives": agreement.collectives, "abandoned": agreement.abandoned,
                   "replays": agreement.replays, "fallbacks": agreement.fallbacks,
                   "data_mode": bool(agreement.schedules),
                   "position_faults": sum(r[-1] for r in positions.rules),
                   "seconds": round(time.monotonic() - t0, 3), "unit_faults": sum(r[5] for r in faults.rules), "peak": peak}


def main() -> int:
    rank, world, init, out_dir, plans_path = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                              sys.argv[5])
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(milliseconds=DEADLINE_MS * 2))
    for plan in json.loads(pathlib.Path(plans_path).read_text()):
        started = time.monotonic()
        try:
            if plan.get("plain"):
                model, summary = run_plain(plan, rank, world)
            else:
                model, summary = run_guarded(plan, rank, world, out_dir)
            summary["error"] = None
        except Exception as e:  # noqa: BLE001 - reported per plan; every rank stopped at the same step
            model, summary = None, {"error": f"{type(e).__name__}: {e}"}
        if plan.get("alone"):
            # A plan that stops every rank with the process group out of step (a replay that could not
            # run): each rank writes its own summary and the process ends without another collective.
            summary["seconds_total"] = round(time.monotonic() - started, 3)
            pathlib.Path(out_dir, f"{plan['name']}.rank{rank}.json").write_text(json.dumps(summary))
            sys.stdout.flush()
            # "linger": stay alive that long (from the plan's start), so that the other ranks must stop
            # by their deadline, not because this process left.
            time.sleep(max(0.0, plan.get("linger", 0) - (time.monotonic() - started)))
            os._exit(0)
        # Every rank's summary; the parameters gathered whole (a collective on every rank).
        gathered = [None] * world
        dist.all_gather_object(gathered, summary)
        ok = all(s["error"] is None for s in gathered)
        params = ogt.flat_parameters(model) if ok else None
        if rank == 0:
            if params is not None:
                params.numpy().astype("<f8").tofile(os.path.join(out_dir, f"{plan['name']}.f64"))
            pathlib.Path(out_dir, f"{plan['name']}.json").write_text(json.dumps(gathered))
    # The last plan's model (and those of plans that raised, held in reference cycles with FSDP's state)
    # freed now, while every rank's process group is alive, rather than by the interpreter's teardown.
    del model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    # FSDP2 keeps the process group referenced after destroy_process_group (gloo's threads still run
    # here), so the interpreter's teardown would tear gloo's connections down while the peer process may
    # be closing its own. One CI run's rank 1 aborted (SIGABRT) after every result was written, most
    # likely there (a gloo exception on the teardown path ends the process).
    # Every result is written by now: leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
