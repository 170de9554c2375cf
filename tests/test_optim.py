"""The drop-in optimizer wrapper: exact with step(count=...), and the naive alternative is not."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from bigbatch import AccumulatingOptimizer, Accumulator
from helpers import big_batch_run, make_data, make_model, sgd, split, update_rel_diff

TOL64 = 1e-12


def _wrapped_run(
    sizes: list[int], n: int, *, with_count: bool, epochs: int = 1, **kw: object
) -> torch.nn.Module:
    model = make_model()
    opt = AccumulatingOptimizer(sgd(model.parameters()), micro_batches=n, **kw)  # type: ignore[arg-type]
    for e in range(epochs):
        x, y = make_data(sum(sizes), seed=1 + e)
        for xb, yb in split(x, y, sizes):
            # The user's loop, unchanged but for count=:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step(count=len(yb)) if with_count else opt.step()
        opt.end_epoch()
    return model


def test_wrapper_equals_big_batch_with_uneven_windows() -> None:
    sizes = [8, 8, 8, 8, 4]
    start = make_model()
    windows = []
    for e in range(2):
        x, y = make_data(36, seed=1 + e)
        mbs = split(x, y, sizes)
        windows += [mbs[:3], mbs[3:]]
    ref = big_batch_run(copy.deepcopy(start), windows)
    assert update_rel_diff(start, _wrapped_run(sizes, 3, with_count=True, epochs=2), ref) <= TOL64
    # Negative control: without counts every micro-batch weighs the same, like loss / N.
    with pytest.warns(UserWarning, match="count="):
        unweighted = _wrapped_run(sizes, 3, with_count=False, epochs=2)
    assert update_rel_diff(start, unweighted, ref) > 1e-3


def test_wrapper_steps_the_scheduler_once_per_window() -> None:
    model = make_model()
    inner = sgd(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = AccumulatingOptimizer(inner, micro_batches=2, scheduler=sched)
    x, y = make_data(20)
    results = []
    for xb, yb in split(x, y, [4, 4, 4, 4, 4]):
        F.cross_entropy(model(xb), yb).backward()
        results.append(opt.step(count=len(yb), loss=None))
        opt.zero_grad()
    opt.end_epoch()
    assert [r is not None for r in results] == [False, True, False, True, False]
    assert opt.optimizer_step == 3 and sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.5**3)


def test_wrapper_errors_name_the_fix() -> None:
    model = make_model()
    opt = AccumulatingOptimizer(sgd(model.parameters()), micro_batches=2)
    with pytest.raises(RuntimeError, match=r"loss\.backward"):
        opt.step(count=4)
    with pytest.raises(TypeError, match="closure"):
        opt.step(lambda: 0.0, count=4)
    with pytest.raises(TypeError, match="wrap it once"):
        AccumulatingOptimizer(opt, micro_batches=2)
    with pytest.raises(TypeError, match=r"wrapper\.optimizer"):
        Accumulator(opt, micro_batches=2)


def test_torch_lr_schedulers_take_the_wrapper_and_step_per_window() -> None:
    """StepLR(wrapper) used to raise TypeError: the wrapper is now a torch Optimizer whose
    param_groups are the real optimizer's, so the scheduler moves the real learning rate."""
    sizes = [8, 8, 8, 8, 4]
    start = make_model()

    def steplr(o: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)

    model = copy.deepcopy(start)
    opt = AccumulatingOptimizer(sgd(model.parameters()), micro_batches=3)
    assert isinstance(opt, torch.optim.Optimizer)
    opt.scheduler = steplr(opt)
    x, y = make_data(36)
    for xb, yb in split(x, y, sizes):
        F.cross_entropy(model(xb), yb).backward()
        opt.step(count=len(yb))
        opt.zero_grad()
    opt.end_epoch()
    assert opt.optimizer_step == 2 and opt.optimizer.param_groups[0]["lr"] == 0.5 * 0.5**2
    mbs = split(x, y, sizes)
    ref = big_batch_run(copy.deepcopy(start), [mbs[:3], mbs[3:]], scheduler_factory=steplr)
    assert update_rel_diff(start, model, ref) <= TOL64
    # Negative control: the same scheduler stepped by the loop after every micro-batch (what a
    # loop written for a plain optimizer does) decays the rate 5 times instead of twice.
    model = copy.deepcopy(start)
    opt = AccumulatingOptimizer(sgd(model.parameters()), micro_batches=3)
    sched = steplr(opt)
    for xb, yb in split(x, y, sizes):
        F.cross_entropy(model(xb), yb).backward()
        opt.step(count=len(yb))
        opt.zero_grad()
        sched.step()
    opt.end_epoch()
    assert update_rel_diff(start, model, ref) > 1e-3


@pytest.mark.parametrize("stop_after", [1, 2, 4])
def test_wrapper_state_dict_mid_window_resumes_bit_identically(stop_after: int) -> None:
    sizes = [8, 4, 8, 8, 4]
    x, y = make_data(32)
    mbs = split(x, y, sizes)
    start = make_model()

    def run(model: torch.nn.Module, opt: AccumulatingOptimizer, batches: list) -> None:
        for xb, yb in batches:
            F.cross_entropy(model(xb), yb).backward()
            opt.step(count=len(yb))
            opt.zero_grad()

    full = copy.deepcopy(start)
    opt = AccumulatingOptimizer(torch.optim.AdamW(full.parameters(), lr=0.01), micro_batches=3)
    run(full, opt, mbs)
    opt.end_epoch()

    first = copy.deepcopy(start)
    opt = AccumulatingOptimizer(torch.optim.AdamW(first.parameters(), lr=0.01), micro_batches=3)
    run(first, opt, mbs[:stop_after])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = copy.deepcopy(start)
    resumed.load_state_dict(saved["model"])
    opt = AccumulatingOptimizer(torch.optim.AdamW(resumed.parameters(), lr=0.01), micro_batches=3)
    opt.load_state_dict(saved["opt"])
    run(resumed, opt, mbs[stop_after:])
    opt.end_epoch()
    for p, q in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
