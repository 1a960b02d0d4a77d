"""The traps a new user fell into with a loop of their own (issue 23), each
pinned by a test that failed before: state registered before the model was
converted, evaluation without protection, the micro-batch pinned low after
one OOM, and models under torch.compile."""

from __future__ import annotations

import threading

import pytest
import torch

import oomguard
import oomguard.budget
import oomguard.torch as ogt

needs_budget = pytest.mark.skipif(not oomguard.budget.available(), reason="built without oomguard._budget")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(4)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _batches(steps: int, n: int = 16):
    g = torch.Generator().manual_seed(9)
    return (torch.randn(steps, n, 6, generator=g, dtype=torch.float64),
            torch.randn(steps, n, 1, generator=g, dtype=torch.float64))


def _plain(steps: int, compiled: bool = False) -> torch.Tensor:
    model = _mlp().double()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    xs, ys = _batches(steps)
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(run(xs[k]), ys[k]).backward()
        opt.step()
    return ogt.flat_parameters(model)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---- 1. register_state before model.double() / .to() ----

def test_state_registered_before_the_model_was_converted_is_checkpointed_as_trained(tmp_path):
    steps = 6
    reference = _plain(steps)
    model = _mlp()  # float32 here
    ckpt = oomguard.Checkpointer(str(tmp_path / "ckpt"), every_steps=1, fsync=False)
    ogt.register_state(ckpt, model=model)
    model.double()  # after registration: the tensors the checkpoint must hold are these
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ogt.register_state(ckpt, optimizer=opt, rng=False)
    guard = oomguard.Guard(recovery=ckpt)
    step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=guard)
    xs, ys = _batches(steps)
    # An OOM inside Adam's step at step 3: a rollback must restore the float64 weights.
    oomguard.set_fault_rules("oom@step=3,site=optimizer")
    rollbacks = 0
    while guard.next_step < steps:
        try:
            step(xs[guard.next_step], ys[guard.next_step])
        except oomguard.RolledBackError:
            rollbacks += 1
    ckpt.wait()
    assert rollbacks == 1
    assert _rel(ogt.flat_parameters(model), reference) <= 1e-10
    shard = oomguard.inspect_shard(str(tmp_path / "ckpt" / f"step-{steps - 1:08d}" / "rank-00000.h5"))
    dtypes = {t.path: t.dtype for t in shard.tensors}
    assert dtypes["/model/0.weight"] == "float64", dtypes

    # A fresh process-like start: resume restores those float64 weights.
    fresh = _mlp().double()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    del guard, step, ckpt
    ckpt2 = oomguard.Checkpointer(str(tmp_path / "ckpt"), fsync=False)
    ogt.register_state(ckpt2, model=fresh, rng=False)
    assert oomguard.Guard(recovery=ckpt2).resume() == steps - 1
    assert torch.equal(ogt.flat_parameters(fresh), ogt.flat_parameters(model))


def test_a_tensor_replaced_after_the_first_use_is_refused_loudly(tmp_path):
    model = _mlp().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = oomguard.Checkpointer(str(tmp_path), fsync=False)
    ogt.register_state(ckpt, model=model, optimizer=opt)
    step = ogt.TrainStep(model, opt, torch.nn.functional.mse_loss, guard=oomguard.Guard(recovery=ckpt))
    xs, ys = _batches(2)
    step(xs[0], ys[0])
    model.float()  # the registered float64 tensors are no longer the model's
    with pytest.raises(ogt.StateReplacedError, match=r"'0.weight' \(torch.float64 .*\(now torch.float32"):
        step(xs[1].float(), ys[1].float())


# ---- 2. evaluation ----

@needs_budget
def test_an_evaluation_batch_that_does_not_fit_is_split_and_equals_the_whole(tmp_path):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Tanh(), torch.nn.Linear(512, 3)).double().eval()
    x = torch.randn(256, 32, dtype=torch.float64)
    y = torch.randn(256, 3, dtype=torch.float64)
    with torch.no_grad():
        whole_out, whole_loss = model(x), torch.nn.functional.mse_loss(model(x), y)
    kb = oomguard.KnowledgeBase(str(tmp_path / "kb.sqlite"))
    guard = oomguard.Guard(knowledge_base=kb, device=ogt.TorchDevice("cpu"))

    def forward(m, xb, yb):
        out = m(xb)
        return {"out": out, "loss": torch.nn.functional.mse_loss(out, yb)}

    # The hidden activations of 256 samples (1 MiB) do not fit; 64 samples' do.
    with oomguard.budget.limit(600 << 10):
        got = ogt.evaluate(model, x, y, forward=forward, guard=guard)
    assert guard.eval_micro_limit is not None and guard.eval_micro_limit < 256
    assert torch.allclose(got["out"], whole_out, rtol=1e-13, atol=0)
    assert float(got["loss"]) == pytest.approx(float(whole_loss), rel=1e-12)
    kb.flush()
    incidents = kb.query(run_id=guard.run_id)
    assert incidents and all(i.phase == "eval" for i in incidents)
    assert guard.next_step == 0 and guard.micro_limit is None, "evaluation leaves training's step and limit alone"


def test_train_step_evaluate_recovers_from_an_oom_at_the_eval_site():
    model = _mlp().double()
    step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    xs, ys = _batches(1, 12)
    with torch.no_grad():
        whole = torch.nn.functional.mse_loss(model(xs[0]), ys[0])
    oomguard.set_fault_rules("oom@site=eval")
    got = step.evaluate(xs[0], ys[0])
    assert oomguard.faults_fired() == 1
    assert float(got) == pytest.approx(float(whole), rel=1e-12)
    assert step.guard.eval_micro_limit == 6


def test_an_evaluation_that_cannot_fit_says_so():
    guard = oomguard.Guard(initial_micro_batch=1)

    def forward(m, xb):
        raise MemoryError("cannot allocate")

    with pytest.raises(oomguard.OutOfMemoryError, match="evaluation .* one sample"):
        ogt.evaluate(torch.nn.Identity(), torch.zeros(3, 2), forward=forward, guard=guard)


# ---- 3. the micro-batch after OOMs ----

def test_an_oom_at_the_sync_site_does_not_pin_the_micro_batch():
    model = _mlp().double()
    step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                         initial_micro_batch=1, sync_gradients=True)
    xs, ys = _batches(4, 8)
    oomguard.set_fault_rules("oom@step=1,site=sync")
    sizes = []
    for k in range(4):
        step(xs[k], ys[k])
        sizes.append(step.last_report.largest_micro)
    assert oomguard.faults_fired() == 1
    assert sizes == [1, 1, 1, 1], "the sync's memory does not depend on the split: the limit stays"
    assert step.guard.micro_limit == 1


def test_one_injected_oom_on_one_rank_does_not_hold_it_low():
    """Two ranks (threads): an OOM injected once on rank 1 at size 4; 4 fits,
    so rank 1 is back at 4 after grow_after clean steps."""
    steps, grow_after = 8, 2
    coordinators = oomguard.make_thread_group(2)
    xs, ys = _batches(steps, 16)
    limits = [[], []]
    errors = []
    oomguard.set_fault_rules("oom@step=1,rank=1,site=backward")

    def run(rank):
        try:
            model = _mlp().double()
            guard = oomguard.Guard(coordinator=coordinators[rank], initial_micro_batch=4, max_micro_batch=4,
                                   grow_after=grow_after)
            step = ogt.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                                 guard=guard)
            for k in range(steps):
                step(xs[k, rank * 8:(rank + 1) * 8], ys[k, rank * 8:(rank + 1) * 8])
                limits[rank].append(guard.micro_limit)
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert limits[0] == [4] * steps
    assert limits[1][1] == 2, limits[1]
    assert limits[1][1 + grow_after:] == [4] * (steps - 1 - grow_after), limits[1]


# ---- 4. torch.compile ----

def test_a_compiled_model_is_guarded_and_checkpointed_by_its_own_names(tmp_path):
    steps = 4
    reference = _plain(steps, compiled=True)
    model = _mlp().double()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = oomguard.Checkpointer(str(tmp_path), every_steps=1, fsync=False)
    ogt.register_state(ckpt, model=compiled, optimizer=opt, rng=False)
    step = ogt.TrainStep(compiled, opt, torch.nn.functional.mse_loss,
                         guard=oomguard.Guard(recovery=ckpt, initial_micro_batch=16))
    xs, ys = _batches(steps)
    oomguard.set_fault_rules("oom@step=1,site=backward;oom@step=2,site=forward")
    for k in range(steps):
        step(xs[k], ys[k])
    ckpt.wait()
    assert oomguard.faults_fired() == 2
    assert _rel(ogt.flat_parameters(compiled), reference) <= 1e-10
    names = {t.path for t in oomguard.inspect_shard(str(tmp_path / f"step-{steps - 1:08d}" / "rank-00000.h5")).tensors}
    assert "/model/0.weight" in names and not any("_orig_mod" in n for n in names), names
