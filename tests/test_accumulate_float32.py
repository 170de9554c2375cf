"""The same equivalences in float32, on the gradient the optimizer applies: sum-reduced loss,
per-sample weights, clipping, the optimizer wrapper. The tolerance follows the float32 big
batch's own round-off (its distance from the float64 big batch); the naive ``loss / N`` fails
the same check (the negative control)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bigbatch import AccumulatingOptimizer, Accumulator
from helpers import make_data, make_model, roundoff_tol

SIZES = [2, 6, 12, 16]


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref, strict=True))


def _capture(opt: torch.optim.Optimizer, store: list[torch.Tensor]) -> None:
    params = [p for group in opt.param_groups for p in group["params"]]
    opt.register_step_pre_hook(lambda *_: store.extend(p.grad.detach().clone() for p in params))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = make_data(sum(SIZES), dtype=torch.float32)
    w = torch.rand(sum(SIZES), generator=torch.Generator().manual_seed(3)) * 2
    return x, y, w


def _weighted(out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (F.cross_entropy(out, y, reduction="none") * w).sum() / w.sum()


def _sum_loss(out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="sum")


def _mean_loss(out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


CASES: dict[
    str,
    tuple[Callable[..., torch.Tensor], dict[str, Any], Callable[..., dict[str, Any]], float | None],
] = {
    # name: (micro-batch loss, Accumulator kwargs, backward count kwargs, clip)
    "sum_reduced": (_sum_loss, {"reduction": "sum"}, lambda y, w: {"count": len(y)}, None),
    "weights": (_weighted, {}, lambda y, w: {"weight": w.sum(), "count": len(y)}, None),
    "clipping": (_mean_loss, {"clip_grad_norm": 0.05}, lambda y, w: {"count": len(y)}, 0.05),
}


def _reference(name: str, exact: bool = False) -> list[torch.Tensor]:
    """The big batch in float32, or (``exact``) the same float32 weights and data in float64."""
    clip = CASES[name][3]
    model = make_model(dtype=torch.float32)
    x, y, w = _data()
    if exact:
        model, x, w = model.double(), x.double(), w.double()
    # The big batch: a mean over all samples (the sum-reduced case means the same objective).
    loss = _weighted(model(x), y, w) if name == "weights" else F.cross_entropy(model(x), y)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(CASES))
def test_float32_matches_big_batch_and_naive_does_not(name: str) -> None:
    loss_fn, kwargs, count_kwargs, clip = CASES[name]
    ref = _reference(name)
    x, y, w = _data()
    parts = list(zip(x.split(SIZES), y.split(SIZES), w.split(SIZES), strict=True))

    model = make_model(dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    got: list[torch.Tensor] = []
    _capture(opt, got)
    acc = Accumulator(opt, micro_batches=len(SIZES), **kwargs)
    for xb, yb, wb in parts:
        acc.backward(loss_fn(model(xb), yb, wb), **count_kwargs(yb, wb))
    acc.step()
    tol = roundoff_tol(ref, _reference(name, exact=True))
    assert _rel(got, ref) <= tol

    naive = make_model(dtype=torch.float32)
    for xb, yb, wb in parts:
        (loss_fn(naive(xb), yb, wb) / len(SIZES)).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(naive.parameters(), clip)
    assert _rel([p.grad for p in naive.parameters()], ref) > tol


def test_float32_optimizer_wrapper() -> None:
    ref = _reference("clipping")  # clipped mean-loss gradient
    x, y, _ = _data()
    model = make_model(dtype=torch.float32)
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    got: list[torch.Tensor] = []
    _capture(inner, got)
    opt = AccumulatingOptimizer(inner, micro_batches=len(SIZES), clip_grad_norm=0.05)
    for xb, yb in zip(x.split(SIZES), y.split(SIZES), strict=True):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step(count=len(yb))
    assert _rel(got, ref) <= roundoff_tol(ref, _reference("clipping", exact=True))
