"""Misuse of the Accumulator that used to train silently: each now raises (or skips the step
and warns) with the fix."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bigbatch import Accumulator, NonFiniteGradientWarning
from bigbatch.counts import MicroBatchCount
from helpers import make_data, make_model, sgd


def test_a_forgotten_step_is_refused_instead_of_merging_windows() -> None:
    model = make_model()
    acc = Accumulator(sgd(model.parameters()), micro_batches=2)
    x, y = make_data(10)
    for i, (xb, yb) in enumerate(zip(x.split(2), y.split(2), strict=True)):
        if i < 2:
            acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
            continue
        with pytest.raises(RuntimeError, match=r"window is full \(2 micro-batches\).*acc\.step"):
            acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
        break
    assert acc.micro_in_window == 2  # the refused micro-batch was not counted
    acc.step()
    acc.backward(F.cross_entropy(model(x[:2]), y[:2]), count=2)  # a new window opens


def test_a_forgotten_step_with_target_count_is_refused() -> None:
    model = make_model()
    acc = Accumulator(sgd(model.parameters()), target_count=4)
    x, y = make_data(6)
    acc.backward(F.cross_entropy(model(x[:5]), y[:5]), count=5)
    with pytest.raises(RuntimeError, match="count 5 >= target_count 4"):
        acc.backward(F.cross_entropy(model(x[5:]), y[5:]), count=1)


def test_a_carried_window_that_the_next_epoch_fills_steps_at_the_epoch_end() -> None:
    model = make_model()
    acc = Accumulator(sgd(model.parameters()), micro_batches={0: 4, 1: 2}, last_window="carry")
    x, y = make_data(6)
    for xb, yb in zip(x.split(2), y.split(2), strict=True):  # 3 of epoch 0's window of 4
        acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
    result = acc.end_epoch()  # epoch 1 windows hold 2: the carried 3 are a full window
    assert result is not None and result.micro_batches == 3 and acc.micro_in_window == 0


def test_nan_loss_without_a_scaler_skips_the_step_and_names_the_micro_batch() -> None:
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    acc = Accumulator(sgd(model.parameters()), micro_batches=3)
    x, y = make_data(9)
    x[4] = float("nan")  # in the second micro-batch
    for xb, yb in zip(x.split(3), y.split(3), strict=True):
        acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
    with pytest.warns(NonFiniteGradientWarning, match="loss of micro-batch 2 of 3"):
        result = acc.step()
    assert result.skipped and acc.optimizer_step == 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # not a single nan written
    # The next window is clean and steps as usual.
    x, y = make_data(9)
    for xb, yb in zip(x.split(3), y.split(3), strict=True):
        acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not acc.step().skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_inf_gradient_from_a_finite_loss_is_caught_too() -> None:
    model = make_model()
    acc = Accumulator(sgd(model.parameters()), micro_batches=1)
    x, y = make_data(4)
    hook = model[0].weight.register_hook(lambda g: g * float("inf"))
    acc.backward(F.cross_entropy(model(x), y), count=4)
    hook.remove()
    with pytest.warns(NonFiniteGradientWarning, match="losses were finite"):
        assert acc.step().skipped


@pytest.mark.parametrize("kind", ["count", "weight"])
def test_negative_tensor_counts_and_weights_are_refused(kind: str) -> None:
    model = make_model()
    acc = Accumulator(sgd(model.parameters()), micro_batches=2)
    x, y = make_data(4)
    value = torch.tensor(-3) if kind == "count" else torch.tensor(-1.5)
    with pytest.raises(ValueError, match=f"{kind} must be >= 0"):
        acc.backward(F.cross_entropy(model(x), y), **{kind: value})


def test_negative_counts_on_a_device_are_refused_at_step_time() -> None:
    """A count on an accelerator is not read per micro-batch (that would wait for the device);
    the step, which reads the counts anyway, refuses a negative one."""
    model = make_model()
    acc = Accumulator(sgd(model.parameters()), micro_batches=2)
    x, y = make_data(4)
    for c in (2, -2):
        loss = F.cross_entropy(model(x[:2]), y[:2])
        factor = acc.add_micro_batch(MicroBatchCount(torch.tensor(float(c)), 2, 0), loss.detach())
        (loss * factor).backward()
    with pytest.raises(ValueError, match="micro-batch 2 of this window has a negative count"):
        acc.step()


def _with_default(make: Any, dtype: torch.dtype) -> Any:
    """``torch.zeros``/``ones`` as under ``torch.set_default_dtype(dtype)``."""

    def made(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.setdefault("dtype", dtype)
        return make(*args, **kwargs)  # type: ignore[no-any-return]

    return made


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
@pytest.mark.parametrize("fused", [True, False])  # False: a backend without the fused check
def test_the_finite_check_finds_any_inf_or_nan_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bad: float | None, fused: bool
) -> None:
    from bigbatch.accumulate import _grads_finite

    # Under another default dtype too (Lightning's and users' float64 runs set it).
    monkeypatch.setattr(torch, "zeros", _with_default(torch.zeros, torch.float64))
    monkeypatch.setattr(torch, "ones", _with_default(torch.ones, torch.float64))

    if not fused:

        def missing(*args: object) -> None:
            raise NotImplementedError("no such kernel on this backend")

        monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (5, 300, 7)]
    for p in params:
        p.grad = (
            torch.randn(p.shape, dtype=torch.float64).mul(10000).to(dtype)
        )  # fp16: up to half its max
    if bad is not None:
        params[1].grad[123] = bad  # type: ignore[index]
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    assert _grads_finite(params) is (bad is None)
    # The same gradients, bit for bit (the nan put there read as 0 on both sides).
    assert all(
        torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))  # type: ignore[arg-type]
        for a, b in zip([p.grad for p in params], before, strict=True)
    )
