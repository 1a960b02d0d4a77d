"""oomguard.torch in a real training loop (issue 13): token-weighted losses,
schedulers, scalers and clipping, dict batches, DataLoaders across rollbacks,
one host sync per step, device figures on incidents and the global loss.

Several ranks run as threads of this process (oomguard.make_thread_group): the
guard's collectives are the same as over torch.distributed, at no start-up cost.
"""

from __future__ import annotations

import collections
import threading

import pytest
import torch

import oomguard
import oomguard.budget
import oomguard.torch as ogt

VOCAB, WIDTH, SEQ = 13, 8, 7


# ---- shared pieces ----

class _TokenModel(torch.nn.Module):
    """Embedding -> tanh -> a causal running mean -> logits: enough to make the
    loss depend on every earlier token, small enough for float64 checks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(x)))
        h = h.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        return self.out(h)


# Ranks run as threads: seeding and drawing the initial parameters must not
# interleave with another thread's, or the ranks would start from different models.
_INIT = threading.Lock()


def _token_model() -> torch.nn.Module:
    with _INIT:
        torch.manual_seed(5)
        return _TokenModel().double()


def _token_batches(steps: int, batch: int):
    """Variable-length sequences padded with label -1: valid tokens per sample
    range from 0 to SEQ, so a mean over samples and one over tokens differ."""
    g = torch.Generator().manual_seed(17)
    x = torch.randint(0, VOCAB, (steps, batch, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (steps, batch, SEQ), generator=g)
    lengths = torch.randint(0, SEQ + 1, (steps, batch), generator=g)
    lengths[:, 0] = SEQ  # no batch without a valid token
    y[torch.arange(SEQ).view(1, 1, -1) >= lengths.unsqueeze(-1)] = -1
    return x, y


def _token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-1)


def _valid_tokens(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (y != -1).sum()


def _warmup_cosine(optimizer, steps: int, warmup: int = 2):
    import math

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _plain_token_run(steps: int, x, y, clip: float = 0.5):
    """The reference: the whole global batch in one forward, no guard."""
    model = _token_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = _warmup_cosine(opt, steps)
    losses = []
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _token_loss(model(x[k]), y[k])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return ogt.flat_parameters(model), sched.state_dict(), losses


def _run_ranks(world: int, body):
    """Runs body(rank, coordinator) on `world` threads (one guard each); returns their results."""
    coordinators = oomguard.make_thread_group(world) if world > 1 else [None]
    results, errors = [None] * world, []

    def run(rank):
        try:
            results[rank] = body(rank, coordinators[rank])
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def _guarded_token_run(world: int, steps: int, x, y, *, limit: int, units: bool = True, clip: float = 0.5):
    """Rank r of `world` takes its contiguous share of each global batch."""
    batch = x.shape[1]

    def body(rank, coordinator):
        model = _token_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        sched = _warmup_cosine(opt, steps)
        guard = oomguard.Guard(coordinator=coordinator, initial_micro_batch=limit, grow_after=0,
                               vote_deadline_ms=30000)
        step = ogt.TrainStep(model, opt, _token_loss, guard=guard, scheduler=sched, clip_grad_norm=clip,
                             loss_units=_valid_tokens if units else None)
        lo, hi = rank * batch // world, (rank + 1) * batch // world
        losses = []
        while guard.next_step < steps:
            k = guard.next_step
            losses.append(step(x[k, lo:hi], y[k, lo:hi]))
        return ogt.flat_parameters(model), sched.state_dict(), losses, guard.total_ooms

    return _run_ranks(world, body)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---- 1. padded token losses ----

@pytest.mark.parametrize("world", [1, 2])
def test_token_weighted_losses_equal_the_whole_batch_run(world):
    steps, batch = 4, 16
    x, y = _token_batches(steps, batch)
    ref, ref_sched, ref_losses = _plain_token_run(steps, x, y)
    # OOMs at three sites, each on a named rank (a rule without one fires on
    # whichever thread gets there first): micro-batches shrink to 2 samples,
    # and some of them hold no valid token at all.
    oomguard.set_fault_rules(f"oom@step=1,rank={world - 1},site=commit;oom@step=2,rank=0,site=backward;"
                             "oom@step=3,rank=0,site=forward,micro=1")
    results = _guarded_token_run(world, steps, x, y, limit=batch)
    assert sum(r[3] for r in results) == 3, "the injected OOMs did not fire"  # each rule fires once
    for params, sched, losses, _ in results:
        assert _rel(params, ref) <= 1e-10
        assert sched["last_epoch"] == ref_sched["last_epoch"] == steps
        assert sched["_last_lr"] == pytest.approx(ref_sched["_last_lr"], rel=1e-12)
        assert losses == pytest.approx(ref_losses, rel=1e-10)


def test_without_loss_units_a_split_padded_batch_drifts():
    """What loss_units fixes: weighing micro-batches by samples is exact only
    when every sample has as many valid tokens."""
    steps, batch = 3, 12
    x, y = _token_batches(steps, batch)
    ref, _, _ = _plain_token_run(steps, x, y)
    (params, _, _, _), = _guarded_token_run(1, steps, x, y, limit=3, units=False)
    assert _rel(params, ref) > 1e-4


def test_loss_units_counts_are_checked():
    model = _token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _token_batches(1, 4)
    mean = ogt.TrainStep(model, opt, _token_loss, loss_units=lambda x, y: (y != -1).double().mean())
    with pytest.raises(ValueError, match="whole numbers"):
        mean(x[0], y[0])
    not_a_sum = ogt.TrainStep(model, opt, _token_loss, loss_units=lambda x, y: (y != -1).sum() + 1)
    with pytest.raises(ValueError, match="must count units"):
        not_a_sum(x[0], y[0])
    per_sample = ogt.TrainStep(model, opt, _token_loss, loss_units=lambda x, y: (y != -1).sum(1))
    per_sample(x[0], y[0])
    assert per_sample.last_report.global_units == int((y[0] != -1).sum())
    wrong_shape = ogt.TrainStep(model, opt, _token_loss, loss_units=lambda x, y: y != -1)
    with pytest.raises(ValueError, match="loss_units returned shape"):
        wrong_shape(x[0], y[0])


# ---- 2. oomguard.budget and oneDNN ----

@pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_budget_hands_onednn_the_pointers_it_expects(dtype):
    """GELU, conv2d and LayerNorm with their backward run through oneDNN on CPU
    for float32 and bfloat16, which allocates with Allocator::raw_allocate."""
    base = oomguard.budget.allocated()
    with oomguard.budget.limit(256 << 20):
        x = torch.randn(8, 256, dtype=dtype, requires_grad=True)
        torch.nn.functional.gelu(x).sum().backward()
        img = torch.randn(2, 3, 16, 16, dtype=dtype, requires_grad=True)
        w = torch.randn(4, 3, 3, 3, dtype=dtype, requires_grad=True)
        torch.nn.functional.conv2d(img, w).sum().backward()
        ln = torch.nn.LayerNorm(256).to(dtype)
        ln(x).sum().backward()
        assert oomguard.budget.allocated() > base
        assert x.grad is not None and img.grad is not None and w.grad is not None
        del x, img, w, ln
    assert oomguard.budget.allocated() == base, "a block was not given back"
    assert oomguard.budget.live_blocks() == 0


@pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")
def test_budget_blocks_outlive_the_budget():
    with oomguard.budget.limit(1 << 20):
        t = torch.zeros(1000)
    assert oomguard.budget.live_blocks() == 1 and oomguard.budget.allocated() == 4000
    t.resize_(100_000)  # reallocates through the storage's allocator: ours, no longer installed
    assert oomguard.budget.allocated() == 400_000
    del t
    assert oomguard.budget.allocated() == 0 and oomguard.budget.live_blocks() == 0


# ---- 3. checkpointer rank and world size ----

def test_checkpointer_and_guard_must_agree_on_the_rank(tmp_path):
    coordinators = oomguard.make_thread_group(2)
    ckpt = oomguard.Checkpointer(str(tmp_path / "a"))  # no process group: rank 0 of 1
    assert (ckpt.rank, ckpt.world_size) == (0, 1)
    with pytest.raises(ValueError, match="rank 0 of 1.*rank 1 of 2"):
        oomguard.Guard(coordinator=coordinators[1], recovery=ckpt)
    right = oomguard.Checkpointer(str(tmp_path / "b"), rank=1, world_size=2)
    oomguard.Guard(coordinator=coordinators[1], recovery=right)


def test_checkpointer_takes_rank_and_world_from_torch_distributed(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ckpt = oomguard.Checkpointer(str(tmp_path / "ckpt"))
        assert (ckpt.rank, ckpt.world_size) == (0, 1)
        with pytest.raises(ValueError, match="rank 0"):
            oomguard.Checkpointer(str(tmp_path / "bad"), rank=1)
        with pytest.raises(ValueError, match="world of 1"):
            oomguard.Checkpointer(str(tmp_path / "bad"), world_size=2)
    finally:
        dist.destroy_process_group()


# ---- 4. scheduler, scaler, clipping, hooks; all of it rolled back ----

def _mlp():
    with _INIT:
        torch.manual_seed(7)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def _regression(steps, batch=16):
    g = torch.Generator().manual_seed(11)
    return (torch.randn(steps, batch, 8, generator=g, dtype=torch.float64),
            torch.randn(steps, batch, 1, generator=g, dtype=torch.float64))


class _LossScaler:
    """Dynamic loss scaling with GradScaler's interface (scale, unscale_, step,
    update, get_scale, state_dict): torch 1.13's GradScaler is disabled on CPU."""

    def __init__(self, scale=1024.0, growth_interval=2):
        self._scale = scale
        self._interval = growth_interval
        self._good = 0
        self._found_inf = None

    def scale(self, loss):
        return loss * self._scale

    def unscale_(self, optimizer):
        assert self._found_inf is None, "unscale_ twice before update"
        self._found_inf = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self._scale)
                    self._found_inf |= not bool(torch.isfinite(p.grad).all())

    def step(self, optimizer):
        if not self._found_inf:
            optimizer.step()

    def update(self):
        if self._found_inf:
            self._scale /= 2
            self._good = 0
        else:
            self._good += 1
            if self._good == self._interval:
                self._scale *= 2
                self._good = 0
        self._found_inf = None

    def get_scale(self):
        return self._scale

    def state_dict(self):
        return {"scale": self._scale, "good": self._good}

    def load_state_dict(self, state):
        self._scale, self._good = state["scale"], state["good"]


class _SGDFailingOnce(torch.optim.SGD):
    """SGD whose `fail_at`-th step runs out of memory: inside scaler.step, after unscale_."""

    def __init__(self, params, fail_at=0, **kw):
        super().__init__(params, **kw)
        self.fail_at, self.calls = fail_at, 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise MemoryError("optimizer state does not fit")
        return super().step(closure)


def _scaled_run(steps, xs, ys, *, ckpt_dir=None, faults=None, bad_step=-1, fail_at=0, scaler=None):
    model = _mlp()
    opt = _SGDFailingOnce(model.parameters(), fail_at=fail_at, lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = _LossScaler() if scaler is None else scaler
    counter = {"seen": 0}

    class Counter:  # an extra stateful object, restored with the rest
        def state_dict(self):
            return dict(counter)

        def load_state_dict(self, state):
            counter.update(state)

    ckpt = None
    if ckpt_dir is not None:
        ckpt = oomguard.Checkpointer(str(ckpt_dir), every_steps=2, fsync=False)
        ogt.register_state(ckpt, model=model, optimizer=opt, scheduler=sched, scaler=scaler, counter=Counter())
    guard = oomguard.Guard(recovery=ckpt, initial_micro_batch=4)
    hooks = []
    step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard, scheduler=sched, scaler=scaler,
                         clip_grad_norm=1.0, before_apply=lambda: hooks.append("before"),
                         after_apply=lambda: counter.__setitem__("seen", counter["seen"] + 1))
    if faults:
        oomguard.set_fault_rules(faults)
    rollbacks, skipped = 0, []
    while guard.next_step < steps:
        k = guard.next_step
        x = xs[k].clone()
        if k == bad_step:
            x[0, 0] = float("inf")  # an overflow: the scaler skips, the guard commits the step
        try:
            step(x, ys[k])
        except oomguard.RolledBackError:
            rollbacks += 1
            continue
        if step.skipped:
            skipped.append(k)
    oomguard.clear_fault_rules()
    if ckpt is not None:
        ckpt.wait()
    return ogt.flat_parameters(model), sched.state_dict(), scaler.state_dict(), counter["seen"], rollbacks, skipped


def test_scheduler_scaler_and_extra_state_roll_back_with_the_weights(tmp_path):
    steps = 7
    xs, ys = _regression(steps)
    ref = _scaled_run(steps, xs, ys, bad_step=4)
    assert ref[5] == [4] and ref[4] == 0, "the overflow at step 4 was skipped, nothing rolled back"
    assert ref[1]["last_epoch"] == steps - 1, "the skipped step did not step the scheduler"
    # OOMs inside the optimizer step (parameters half updated): rolled back to a checkpoint.
    got = _scaled_run(steps, xs, ys, ckpt_dir=tmp_path / "ckpt", bad_step=4,
                      faults="oom@step=3,site=optimizer;oom@step=5,site=apply")
    assert got[4] == 2, "two rollbacks"
    # An OOM inside the optimizer step itself, after the scaler unscaled the
    # gradients: the redone step unscales again.
    failed = _scaled_run(steps, xs, ys, ckpt_dir=tmp_path / "ckpt2", bad_step=4, fail_at=2)
    assert failed[4] == 1
    assert _rel(failed[0], ref[0]) <= 1e-12 and failed[1] == ref[1] and failed[2] == ref[2]
    assert _rel(got[0], ref[0]) <= 1e-12
    assert got[1] == ref[1], "scheduler state"
    assert got[2] == ref[2], "scaler state"
    assert got[3] == ref[3] == steps, "the extra object was restored too"
    assert 4 in got[5]


@pytest.mark.skipif(not hasattr(getattr(torch, "amp", None), "GradScaler"),
                    reason="torch.amp.GradScaler (CPU loss scaling) needs torch >= 2.3")
def test_torchs_own_grad_scaler_skips_an_overflow(tmp_path):
    steps = 4
    xs, ys = _regression(steps)
    xs, ys = xs.float(), ys.float()

    def run(ckpt_dir):
        model = _mlp().float()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        ckpt = oomguard.Checkpointer(str(ckpt_dir), every_steps=1, fsync=False)
        ogt.register_state(ckpt, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
        guard = oomguard.Guard(recovery=ckpt, initial_micro_batch=4)
        step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard, scheduler=sched,
                             scaler=scaler)
        skipped = []
        while guard.next_step < steps:
            k = guard.next_step
            x = xs[k].clone()
            if k == 1:
                x[0, 0] = float("inf")
            try:
                step(x, ys[k])
            except oomguard.RolledBackError:
                continue
            skipped.append(step.skipped)
        return ogt.flat_parameters(model), sched.last_epoch, skipped

    params, last_epoch, skipped = run(tmp_path / "a")
    assert skipped == [False, True, False, False]
    assert last_epoch == steps - 1
    oomguard.set_fault_rules("oom@step=2,site=apply")
    again, _, _ = run(tmp_path / "b")
    assert torch.equal(again, params)


def test_gradients_are_clipped_after_the_sum_and_hooks_run_around_the_step():
    xs, ys = _regression(1)
    seen = []

    def body(rank, coordinator):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = oomguard.Guard(coordinator=coordinator, initial_micro_batch=3, vote_deadline_ms=30000)

        def before():
            seen.append((rank, float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))))

        step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard, clip_grad_norm=0.01,
                             before_apply=before)
        step(xs[0, rank * 8:(rank + 1) * 8], ys[0, rank * 8:(rank + 1) * 8])
        return ogt.flat_parameters(model)

    p0, p1 = _run_ranks(2, body)
    assert torch.equal(p0, p1)
    # The plain run: whole batch, clip to 0.01, SGD.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
    opt.step()
    assert _rel(p0, ogt.flat_parameters(model)) <= 1e-12
    # before_apply saw the summed (global) gradient on both ranks, not its own half.
    assert sorted(r for r, _ in seen) == [0, 1]
    assert all(n == pytest.approx(norm, rel=1e-12) for _, n in seen)


def test_an_unregistered_scheduler_is_refused(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    ckpt = oomguard.Checkpointer(str(tmp_path))
    ogt.register_state(ckpt, model=model, optimizer=opt)
    guard = oomguard.Guard(recovery=ckpt)
    with pytest.raises(ValueError, match="scheduler is not registered"):
        ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard, scheduler=sched)
    with pytest.raises(TypeError, match="has no state_dict"):
        ogt.register_state(ckpt, sampler=object())
    with pytest.raises(ValueError, match="clip_grad_norm"):
        ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, clip_grad_norm=-1)
    with pytest.raises(TypeError, match="not a GradScaler"):
        ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, scaler=object())


# ---- 5. dict, tuple and list batches; split= ----

def test_dict_tuple_and_list_batches_split_like_tensors():
    xs, ys = _regression(1)
    Pair = collections.namedtuple("Pair", "x y")

    def run(batch, forward, samples=None, **kw):
        model = _mlp()
        step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), forward=forward,
                             initial_micro_batch=3, **kw)
        loss = step(*batch, samples=samples)
        assert step.last_report.micro_batches == 6
        return loss, ogt.flat_parameters(model)

    mse = torch.nn.functional.mse_loss
    ref = run((xs[0], ys[0]), lambda m, x, y: mse(m(x), y))
    variants = [
        (({"inputs": xs[0], "labels": ys[0], "scale": torch.tensor(1.0)},),
         lambda m, b: mse(m(b["inputs"]), b["labels"]) * b["scale"]),
        (((xs[0], ys[0]),), lambda m, b: mse(m(b[0]), b[1])),
        (([xs[0], {"y": ys[0]}],), lambda m, b: mse(m(b[0]), b[1]["y"])),
        ((Pair(xs[0], ys[0]),), lambda m, b: mse(m(b.x), b.y)),
    ]
    for batch, forward in variants:
        loss, params = run(batch, forward)
        assert loss == pytest.approx(ref[0], rel=1e-12)
        assert torch.equal(params, ref[1])

    class Records:  # a batch type split_batch does not know
        def __init__(self, rows):
            self.rows = rows

    rows = Records([(xs[0][i], ys[0][i]) for i in range(16)])

    def split(part, start, stop):
        return Records(part.rows[start:stop])

    loss, params = run((rows,), lambda m, b: mse(m(torch.stack([r[0] for r in b.rows])),
                                                 torch.stack([r[1] for r in b.rows])), samples=16, split=split)
    assert torch.equal(params, ref[1])


def test_batches_that_cannot_be_split_are_explained():
    model = _mlp()
    step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), forward=lambda m, b: m(b).sum())
    with pytest.raises(ValueError, match=r"batch\[0\]\['a'\] has 4, batch\[0\]\['b'\] has 3"):
        step({"a": torch.zeros(4, 8), "b": torch.zeros(3, 8)})
    with pytest.raises(ValueError, match="give samples="):
        step(["no", "tensor"])
    loss_fn_step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    with pytest.raises(ValueError, match="takes \\(inputs, targets\\)"):
        loss_fn_step({"x": torch.zeros(4, 8)})


# ---- 6. a DataLoader loop that survives rollbacks ----

class _Indexed(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


@pytest.mark.parametrize("workers", [0, 2])
def test_step_loader_restarts_a_data_loader_mid_epoch_after_a_rollback(tmp_path, workers):
    g = torch.Generator().manual_seed(3)
    data = _Indexed(torch.randn(40, 8, generator=g, dtype=torch.float64),
                    torch.randn(40, 1, generator=g, dtype=torch.float64))
    steps = 12  # 5 batches of 8 per epoch: the rollback at step 6 lands mid-epoch 1

    def run(ckpt_dir=None, faults=None):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ckpt = None
        if ckpt_dir is not None:
            ckpt = oomguard.Checkpointer(str(ckpt_dir), every_steps=3, fsync=False)
            ogt.register_state(ckpt, model=model, optimizer=opt)
        guard = oomguard.Guard(recovery=ckpt)
        step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard)
        sampler = ogt.StepBatchSampler(len(data), 8, seed=1)
        loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=workers)
        consumed, rollbacks = {}, []
        if faults:
            oomguard.set_fault_rules(faults)
        stream = ogt.StepLoader(loader, guard, steps=steps)
        for idx, x, y in stream:
            k = guard.next_step
            try:
                step(x, y)
                consumed[k] = idx.tolist()
            except oomguard.RolledBackError as e:
                rollbacks.append((k, e.next_step))
        oomguard.clear_fault_rules()
        return ogt.flat_parameters(model), consumed, rollbacks, stream.restarts

    ref, ref_batches, none, _ = run()
    assert none == [] and sorted(ref_batches) == list(range(steps))
    params, batches, rollbacks, restarts = run(tmp_path / "ckpt", "oom@step=7,site=optimizer")
    assert rollbacks == [(7, 6)], rollbacks
    assert restarts == 1
    assert batches == ref_batches, "each step saw the batch of its own number"
    assert _rel(params, ref) <= 1e-12
    # Epochs are permutations of the dataset.
    first_epoch = sorted(i for k in range(5) for i in ref_batches[k])
    assert first_epoch == list(range(40))


def test_step_batch_sampler_shares_a_global_batch_between_ranks():
    whole = ogt.StepBatchSampler(30, 10, seed=4)
    parts = [ogt.StepBatchSampler(30, 10, seed=4, rank=r, world_size=3) for r in range(3)]
    for k in (0, 2, 3, 7):
        assert sum((p.batch(k) for p in parts), []) == whole.batch(k)
    with pytest.raises(ValueError, match="rank 3"):
        ogt.StepBatchSampler(30, 10, rank=3, world_size=3)
    with pytest.raises(TypeError, match="batch_sampler=StepBatchSampler"):
        ogt.StepLoader(torch.utils.data.DataLoader(list(range(4))), oomguard.Guard())


# ---- 7. one host sync per step; the sum runs on the gradients themselves ----

class _MirrorCoordinator(oomguard.Coordinator):
    """Rank 0 of two whose peer does exactly what this rank does: every
    collective of the protocol runs, with no second process."""

    def __init__(self, on_vote=None):
        super().__init__()
        self.summed = []
        self.on_vote = on_vote

    def rank(self):
        return 0

    def size(self):
        return 2

    def engine(self):
        return "mirror"

    def allgather(self, mine, deadline_s):
        if self.on_vote is not None:
            self.on_vote()
        return list(mine) * 2

    def allreduce_sum(self, buffers, deadline_s):
        self.summed.append([b for b, _ in buffers])
        for b, scale in buffers:
            b *= 2 * scale

    def abort(self):
        pass


def test_one_host_sync_per_step(monkeypatch):
    model = _mlp()
    step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                         initial_micro_batch=4)
    xs, ys = _regression(1)
    syncs = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            syncs.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    loss = step(xs[0], ys[0])
    monkeypatch.undo()
    assert step.last_report.micro_batches == 4
    assert syncs == ["__float__"], syncs
    assert isinstance(loss, float)


@pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")
def test_the_sum_runs_on_the_gradients_in_place_with_nothing_allocated_after_the_vote():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).double()
    marks = {}

    def at_vote():
        marks.setdefault("vote", oomguard.budget.allocated())
        oomguard.budget.reset_peak()

    class Watched(torch.optim.SGD):
        def step(self, closure=None):
            marks["peak_before_step"] = oomguard.budget.peak()
            return super().step(closure)

    coordinator = _MirrorCoordinator(on_vote=at_vote)
    guard = oomguard.Guard(coordinator=coordinator, initial_micro_batch=4, device=None)
    step = ogt.TrainStep(model, Watched(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, guard=guard)
    xs, ys = _regression(1)
    with oomguard.budget.limit(0):  # counting only
        step(xs[0], ys[0])
    summed = coordinator.summed[0]
    params = list(model.parameters())
    assert len(summed) == len(params) + 2  # every gradient, the loss, the guard's status words
    assert all(a is p.grad for a, p in zip(summed, params)), "the gradients themselves, not a flattened copy"
    # The gradients hold 20 KiB; a flattened copy would be allocated here. (What
    # is allowed: the 0-dim scalars torch wraps around the scales.)
    grad_bytes = sum(p.numel() * 8 for p in params)
    assert grad_bytes > 16 << 10
    assert marks["peak_before_step"] - marks["vote"] < 1024, "memory was allocated between the vote and the apply"


# ---- 8. device figures on incidents ----

@pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")
def test_incidents_carry_the_budget_allocators_figures():
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1)).double()
    step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g, dtype=torch.float64)
    y = torch.randn(512, 1, generator=g, dtype=torch.float64)
    budget = 3 << 20  # the whole batch's activations (2 MiB each) do not fit, an eighth does
    with oomguard.budget.limit(budget):
        step(x, y)
    report = step.last_report
    assert report.ooms >= 1 and report.incidents
    mem = report.incidents[0].memory
    assert mem.total == budget
    assert 0 < mem.allocated <= budget and mem.free == budget - mem.allocated
    assert mem.num_ooms >= 1
    assert report.peak_allocated > 0


def test_a_python_device_feeds_the_guard(monkeypatch):
    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: unraisable.append(str(u.exc_value)))

    class Device(oomguard.Device):
        def __init__(self):
            super().__init__()
            self.released = 0

        def name(self):
            return "test:0"

        def stats(self):
            s = oomguard.MemoryStats()
            s.total, s.allocated, s.reserved, s.free = 1000, 600, 800, 200
            return s

        def release_caches(self):
            self.released += 1

        def reset_peak(self):
            raise RuntimeError("reported, never thrown into the guard")

    device = Device()
    guard = oomguard.Guard(device=device, initial_micro_batch=4)

    def micro(mb):
        if mb.size == 4:
            raise MemoryError("too big")

    report = guard.step(4, micro, reset=lambda: None)
    assert report.ooms == 1 and device.released == 1
    assert "reported, never thrown into the guard" in unraisable
    mem = report.incidents[0].memory
    assert (mem.total, mem.allocated, mem.reserved, mem.free) == (1000, 600, 800, 200)
    with pytest.raises(ValueError, match="device must be"):
        oomguard.Guard(device="cuda")
    assert isinstance(oomguard.Guard().device, ogt.TorchDevice), "torch is imported: the default follows it"


# ---- 9. the returned loss is the global batch's ----

def test_every_rank_returns_the_global_batchs_loss():
    steps, batch = 2, 8
    x, y = _token_batches(steps, batch)
    # Rank 1's samples hold many more valid tokens than rank 0's.
    y[:, :4, 2:] = -1
    _, _, ref_losses = _plain_token_run(steps, x, y)
    (_, _, l0, _), (_, _, l1, _) = _guarded_token_run(2, steps, x, y, limit=2)
    assert l0 == l1
    assert l0 == pytest.approx(ref_losses, rel=1e-12)
