"""The drop-in optimizer wrapper: exact with step(count=...), and the naive alternative is not."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from bigbatch import AccumulatingOptimizer
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
    x, y = make_data(4)
    F.cross_entropy(model(x), y).backward()
    opt.step(count=4)
    with pytest.raises(RuntimeError, match="window boundary"):
        opt.state_dict()
