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
from helpers import roundoff_tol

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
    models, encode, loss_fn, batches, targets = make(name, dtype)
    ref_models, ref_encode, *_ = make(name, dtype)  # the same weights, untouched by the test
    want = big_batch(ref_models, ref_encode, loss_fn, batches, targets)
    tol = 1e-12 if dtype == torch.float64 else roundoff_tol(want, widened_big_batch(name))
    assert rel(cached(models, encode, loss_fn, batches, targets), want) <= tol
    models.zero_grad()
    assert rel(plain(models, encode, loss_fn, batches, targets), want) > max(tol, 1e-3)


def widened_big_batch(name: str) -> list[torch.Tensor]:
    """The float32 case's big batch computed in float64 (the same float32 weights and data)."""
    models, encode, loss_fn, batches, targets = make(name, torch.float32)
    models.double()  # in place: encode sees the float64 weights

    def wide(b: Any) -> Any:
        return tuple(t.double() for t in b) if isinstance(b, tuple) else b.double()

    if targets is not None and targets.is_floating_point():
        targets = targets.double()
    return big_batch(models, encode, loss_fn, [wide(b) for b in batches], targets)


@pytest.mark.parametrize("name", ["simclr", "supcon"])
def test_dropout_masks_are_replayed(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    models, encode, loss_fn, batches, targets = make(name, torch.float64, dropout=0.3)
    ref_models, ref_encode, *_ = make(name, torch.float64, dropout=0.3)
    want = big_batch(ref_models, ref_encode, loss_fn, batches, targets)
    assert rel(cached(models, encode, loss_fn, batches, targets), want) <= 1e-12
    # Without the replay the second pass draws other masks: the gradient would be wrong, and the
    # check of the recomputed representations refuses it.
    monkeypatch.setattr(coupled, "set_rng_state", lambda state: None)
    models.zero_grad()
    with pytest.raises(RuntimeError, match="randomness is not replayed"):
        cached(models, encode, loss_fn, batches, targets)
    monkeypatch.setattr(coupled, "_check_replayed", lambda *args: None)
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
    from bigbatch.memory.step import StepSpec

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


def test_randomness_outside_torch_is_refused_not_inexact() -> None:
    """numpy noise and a private torch.Generator are not replayed by the saved RNG states: the
    second pass would see other inputs, and the gradient would be silently wrong."""
    import numpy as np

    models, _, loss_fn, batches, _ = make("simclr", torch.float64)
    rng = np.random.default_rng(0)
    private = torch.Generator().manual_seed(0)
    noisy = {
        "numpy": lambda b: (
            models["a"](b[0] + torch.from_numpy(rng.normal(size=tuple(b[0].shape)))),
            models["a"](b[1]),
        ),
        "generator": lambda b: (
            models["a"](b[0] + torch.randn(b[0].shape, generator=private, dtype=b[0].dtype)),
            models["a"](b[1]),
        ),
    }
    for encode in noisy.values():
        acc = Accumulator(torch.optim.SGD(models.parameters(), lr=0.1), micro_batches=1)
        with pytest.raises(RuntimeError, match=r"randomness is not replayed.*global generator"):
            cached_backward(acc, encode, loss_fn, batches)


def test_batchnorm_running_stats_are_updated_once_per_micro_batch() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 6)).double()
    twin = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 6)).double()
    twin.load_state_dict(net.state_dict())
    batches = [torch.randn(n, 8, dtype=torch.float64) for n in SIZES]
    acc = Accumulator(torch.optim.SGD(net.parameters(), lr=0.0), micro_batches=1)
    cached_backward(acc, net, lambda z: (z**2).mean(), batches)
    for b in batches:  # the reference: one forward per micro-batch in train mode
        twin(b)
    bn, ref = net[1], twin[1]
    assert int(bn.num_batches_tracked) == len(batches)
    assert torch.allclose(bn.running_mean, ref.running_mean, rtol=0, atol=1e-15)
    assert torch.allclose(bn.running_var, ref.running_var, rtol=0, atol=1e-15)


def test_a_second_cached_batch_into_a_full_window_is_refused() -> None:
    models, encode, loss_fn, batches, _ = make("simclr", torch.float64)
    acc = Accumulator(torch.optim.SGD(models.parameters(), lr=0.1), micro_batches=1)
    cached_backward(acc, encode, loss_fn, batches)
    with pytest.raises(RuntimeError, match=r"window is full.*acc\.step\(\)"):
        cached_backward(acc, encode, loss_fn, batches)
    acc.step()
    cached_backward(acc, encode, loss_fn, batches)  # after the step: a new window


def test_encode_misuse_names_encode_or_micro_batches() -> None:
    models, encode, loss_fn, batches, _ = make("simclr", torch.float64)

    def acc() -> Accumulator:
        return Accumulator(torch.optim.SGD(models.parameters(), lr=0.1), micro_batches=1)

    with pytest.raises(TypeError, match="micro_batches must be a list"):
        cached_backward(acc(), encode, loss_fn, iter(batches))
    calls = {"n": 0}

    def shrinking(b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls["n"] += 1
        z1, z2 = encode(b)
        return (z1, z2) if calls["n"] <= len(batches) else (z1[:, :3], z2[:, :3])

    with pytest.raises(ValueError, match=r"encode returned .* in the second pass"):
        cached_backward(acc(), shrinking, loss_fn, batches)
    frozen, *_ = make("simclr", torch.float64)
    frozen.requires_grad_(False)
    # The optimizer needs a trainable parameter; the encoder itself is frozen.
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(RuntimeError, match=r"does not require grad.*frozen"):
        cached_backward(
            Accumulator(opt, micro_batches=1),
            lambda b: (frozen["a"](b[0]), frozen["a"](b[1])),
            loss_fn,
            batches,
        )


class TwoHeads(nn.Module):
    """Two outputs, as deep supervision has; the loss below uses only the first."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.used, self.unused = nn.Linear(8, 6), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.used(h), self.unused(h)


def _first_only(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return batch_dice_loss(a[..., None], y[..., None])  # couples the samples


@pytest.mark.parametrize("parts", [1, 3])
def test_an_output_the_loss_does_not_use_leaves_its_weights_without_gradient(parts: int) -> None:
    """Seen in nnU-Net (its lowest deep-supervision output has weight 0): caching backpropagated
    zeros through it, so SGD's weight decay and momentum moved weights the big batch leaves
    alone. Those weights keep no gradient now, as in the big batch; the rest equal it."""
    torch.manual_seed(0)
    model = TwoHeads().double()
    x = torch.randn(9, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (9,))
    _first_only(*model(x), y).backward()
    want = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    calls = []

    def encode(mb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(len(mb))
        return model(mb)

    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-2))
    cached_backward(acc, encode, _first_only, list(x.tensor_split(parts)), targets=y)
    for name, p in model.named_parameters():
        if want[name] is None:
            assert p.grad is None, name
        else:
            assert p.grad is not None and float((p.grad - want[name]).abs().max()) < 1e-12, name
    assert want["unused.weight"] is None
    # One micro-batch is the big batch: its own forward and backward, no second pass.
    assert calls == ([9] if parts == 1 else [3, 3, 3, 3, 3, 3])
