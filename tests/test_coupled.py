"""Gradient caching: losses that couple the samples (InfoNCE with one or two towers, supervised
contrastive, batch Dice) equal the big batch exactly; plain accumulation of the same loss per
micro-batch does not (the negative control); dropout needs the random-state replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import bigbatch.coupled as coupled
from bigbatch import Accumulator
from bigbatch.coupled import cached_backward, info_nce
from bigbatch.coupled import supervised_contrastive as sup_con
from bigbatch.segmentation.losses import batch_dice_loss

SIZES = [5, 5, 3]  # an uneven last micro-batch


def encoder(dim_in: int = 8, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(dim_in, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 6))


def make(name: str, dtype: torch.dtype, dropout: float = 0.0) -> tuple[Any, ...]:
    """(models, encode, loss_fn, micro_batches, targets) of each coupled-loss case."""
    torch.manual_seed(0)
    models = nn.ModuleDict(
        {
            "a": encoder(dropout=dropout),
            "b": encoder(dim_in=5, dropout=dropout),
            "seg": nn.Conv2d(2, 1, 3, padding=1),
        }
    ).to(dtype)
    g = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    if name == "simclr":  # one encoder, two views of each sample
        batches = [(rand(n, 8), rand(n, 8)) for n in SIZES]
        return models, lambda b: (models["a"](b[0]), models["a"](b[1])), info_nce, batches, None
    if name == "clip":  # two towers: "images" and "texts"
        batches = [(rand(n, 8), rand(n, 5)) for n in SIZES]
        return models, lambda b: (models["a"](b[0]), models["b"](b[1])), info_nce, batches, None
    if name == "supcon":
        batches = [rand(n, 8) for n in SIZES]
        labels = torch.randint(0, 3, (sum(SIZES),), generator=g)
        return models, lambda b: models["a"](b), sup_con, batches, labels
    if name == "batch_dice":
        batches = [rand(n, 2, 8, 8) for n in SIZES]
        masks = (torch.rand(sum(SIZES), 1, 8, 8, generator=g) > 0.5).to(dtype)
        return models, lambda b: models["seg"](b), batch_dice_loss, batches, masks
    raise KeyError(name)


def grads(models: nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in models.parameters()
    ]


def rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    return num / max(float(b.abs().max()) for b in want)


def big_batch(
    models: nn.Module, encode: Callable, loss_fn: Callable, batches: list, targets: Any
) -> list[torch.Tensor]:
    """The loss on the whole batch at once, with a graph through every micro-batch's forward (in
    the same order, so dropout draws the same masks as the cached path's first pass)."""
    torch.manual_seed(123)
    outs = [encode(b) for b in batches]
    towers = [
        torch.cat([o[t] if isinstance(o, tuple) else o for o in outs])
        for t in range(len(outs[0]) if isinstance(outs[0], tuple) else 1)
    ]
    loss = loss_fn(*towers, *([targets] if targets is not None else []))
    loss.backward()
    return grads(models)


def cached(
    models: nn.Module, encode: Callable, loss_fn: Callable, batches: list, targets: Any
) -> list[torch.Tensor]:
    acc = Accumulator(torch.optim.SGD(models.parameters(), lr=0.0), micro_batches=1)
    torch.manual_seed(123)
    cached_backward(acc, encode, loss_fn, batches, targets=targets)
    return grads(models)


def plain(
    models: nn.Module, encode: Callable, loss_fn: Callable, batches: list, targets: Any
) -> list[torch.Tensor]:
    """Ordinary (exact-count) accumulation of the same loss per micro-batch: another objective."""
    acc = Accumulator(torch.optim.SGD(models.parameters(), lr=0.0), micro_batches=len(batches))
    torch.manual_seed(123)
    start = 0
    for b, n in zip(batches, SIZES, strict=True):
        out = encode(b)
        towers = out if isinstance(out, tuple) else (out,)
        extra = [targets[start : start + n]] if targets is not None else []
        acc.backward(loss_fn(*towers, *extra), count=n)
        start += n
    return grads(models)


CASES = ["simclr", "clip", "supcon", "batch_dice"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", CASES)
def test_cached_equals_big_batch_and_plain_accumulation_does_not(
    name: str, dtype: torch.dtype
) -> None:
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    models, encode, loss_fn, batches, targets = make(name, dtype)
    ref_models, ref_encode, *_ = make(name, dtype)  # the same weights, untouched by the test
    want = big_batch(ref_models, ref_encode, loss_fn, batches, targets)
    assert rel(cached(models, encode, loss_fn, batches, targets), want) <= tol
    models.zero_grad()
    if dtype == torch.float64:
        assert rel(plain(models, encode, loss_fn, batches, targets), want) > 1e-3


@pytest.mark.parametrize("name", ["simclr", "supcon"])
def test_dropout_masks_are_replayed(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    models, encode, loss_fn, batches, targets = make(name, torch.float64, dropout=0.3)
    ref_models, ref_encode, *_ = make(name, torch.float64, dropout=0.3)
    want = big_batch(ref_models, ref_encode, loss_fn, batches, targets)
    assert rel(cached(models, encode, loss_fn, batches, targets), want) <= 1e-12
    # Without the replay the second pass draws other masks: the gradient is wrong.
    monkeypatch.setattr(coupled, "_set_rng_state", lambda state: None)
    models.zero_grad()
    assert rel(cached(models, encode, loss_fn, batches, targets), want) > 1e-3


def test_two_cached_big_batches_make_one_step_each_weighted_by_its_count() -> None:
    models, encode, loss_fn, batches, _ = make("simclr", torch.float64)
    first, second = batches[:2], batches[2:]  # 10 and 3 pairs
    acc = Accumulator(torch.optim.SGD(models.parameters(), lr=1.0), micro_batches=2)
    before = [p.detach().clone() for p in models.parameters()]
    state = None
    for i, part in enumerate((first, second)):
        cached_backward(acc, encode, loss_fn, part)
        if i == 0:
            state = acc.state_dict()  # resume mid-window: the cache lives inside one call
            fresh = Accumulator(torch.optim.SGD(models.parameters(), lr=1.0), micro_batches=2)
            fresh.load_state_dict(state)
            acc = fresh
    acc.step()
    update = [b - p.detach() for b, p in zip(before, models.parameters(), strict=True)]
    # The reference: (10 * L(first) + 3 * L(second)) / 13, each loss on its own big batch.
    ref_models, ref_encode, *_ = make("simclr", torch.float64)
    total = 0
    for part in (first, second):
        outs = [ref_encode(b) for b in part]
        z1 = torch.cat([o[0] for o in outs])
        z2 = torch.cat([o[1] for o in outs])
        total = total + len(z1) * loss_fn(z1, z2)
    (total / 13).backward()
    assert rel(update, grads(ref_models)) <= 1e-12


def test_misuse_is_refused() -> None:
    models, encode, loss_fn, batches, _ = make("simclr", torch.float64)
    acc = Accumulator(torch.optim.SGD(models.parameters(), lr=0.1), micro_batches=1)
    with pytest.raises(ValueError, match="micro_batches is empty"):
        cached_backward(acc, encode, loss_fn, [])
    with pytest.raises(TypeError, match="encode must return a tensor"):
        cached_backward(acc, lambda b: "not a tensor", loss_fn, batches)


def test_plan_leaves_room_for_the_gradient_cache() -> None:
    from bigbatch.coupled import cache_bytes
    from bigbatch.memory.plan import DoesNotFitError, plan_micro_batch
    from bigbatch.memory.predict import StepSpec

    def spec_at(b: int) -> StepSpec:
        wide = lambda: nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 6))  # noqa: E731
        return StepSpec(wide, (512,), b)

    budget = 64 * 2**20
    plain = plan_micro_batch(spec_at, 1024, budget, overhead=0)
    cache = cache_bytes(1024, 6)  # 1024 pairs: the 1024 x 1024 similarities dominate
    cached = plan_micro_batch(spec_at, 1024, budget, overhead=0, extra_bytes=cache)
    assert cached.micro_batch < plain.micro_batch
    assert cached.predicted_peak_bytes + cache <= budget * 0.9
    with pytest.raises(DoesNotFitError, match="gradient cache"):
        plan_micro_batch(spec_at, 1024, cache, overhead=0, extra_bytes=cache)
