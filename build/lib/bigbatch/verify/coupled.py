"""``bigbatch verify``'s coupled-loss cases: plain accumulation against gradient caching.

For InfoNCE (two views through one encoder, with dropout), supervised contrastive and batch
Dice, over micro-batches 5, 5, 3: the plain path accumulates the same loss per micro-batch (with
exact counts, and still another objective: fewer negatives, per-micro-batch Dice sums); the
cached path (:func:`bigbatch.coupled.cached_backward`) computes the big batch's gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from bigbatch.accumulate import Accumulator
from bigbatch.coupled import cached_backward, info_nce, supervised_contrastive
from bigbatch.segmentation.losses import batch_dice_loss
from bigbatch.verify import (
    TOLERANCES,
    CaseResult,
    Method,
    _cast_floats,
    compare_gradients,
    roundoff_tolerance,
)

__all__ = ["run_coupled_cases"]

SIZES = (5, 5, 3)

Case = tuple[nn.Module, Callable[[Any], Any], Callable[..., torch.Tensor], list[Any], Any]


def _case(name: str, dtype: torch.dtype) -> Case:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    if name == "batch_dice":
        seg = nn.Conv2d(2, 1, 3, padding=1).to(dtype)
        masks = (torch.rand(sum(SIZES), 1, 8, 8, generator=g) > 0.5).to(dtype)
        return seg, seg, batch_dice_loss, [rand(n, 2, 8, 8) for n in SIZES], masks
    enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 6)).to(dtype)
    if name == "info_nce":
        views = [(rand(n, 8), rand(n, 8)) for n in SIZES]
        return enc, lambda b: (enc(b[0]), enc(b[1])), info_nce, views, None
    labels = torch.randint(0, 3, (sum(SIZES),), generator=g)
    return enc, enc, supervised_contrastive, [rand(n, 8) for n in SIZES], labels


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(
    name: str, dtype: torch.dtype, method: str, widen: bool = False
) -> dict[str, torch.Tensor]:
    """One path's window gradient; ``widen``: the ``dtype`` case's weights and data in float64
    (the big batch there measures the round-off of ``dtype`` itself)."""
    model, encode, loss_fn, batches, targets = _case(name, dtype)
    if widen:
        model.double()  # in place: encode closes over it
        batches, targets = _cast_floats((batches, targets), torch.float64)
    torch.manual_seed(123)  # the same dropout masks on every path
    extra = [] if targets is None else [targets]
    if method == "big":
        outs = [encode(b) for b in batches]  # a graph through every micro-batch: the reference
        if name == "info_nce":
            towers = [torch.cat([o[t] for o in outs]) for t in range(2)]
        else:
            towers = [torch.cat(outs)]
        loss_fn(*towers, *extra).backward()
        return _grads(model)
    captured: dict[str, torch.Tensor] = {}

    class Capture(torch.optim.SGD):
        """Records the window's gradient as the step sees it: normalised by its true count."""

        def step(self, closure: Any = None) -> Any:
            captured.update(_grads(model))

    acc = Accumulator(Capture(model.parameters(), lr=0.0))
    if method == "cached":
        cached_backward(acc, encode, loss_fn, batches, targets=targets)
    else:
        start = 0
        for b, n in zip(batches, SIZES, strict=True):
            out = encode(b)
            mine = out if isinstance(out, tuple) else (out,)
            part = [] if targets is None else [targets[start : start + n]]
            acc.backward(loss_fn(*mine, *part), count=n)
            start += n
    acc.step()
    return captured


def run_coupled_cases(
    dtypes: Sequence[torch.dtype] = (torch.float64, torch.float32),
) -> list[CaseResult]:
    """Each coupled loss, plain accumulation and the cached path, against the big batch."""
    results = []
    for name in ("info_nce", "supcon", "batch_dice"):
        for dtype in dtypes:
            ref = _run(name, dtype, "big")
            tol, roundoff = TOLERANCES[torch.float64], 0.0
            if dtype != torch.float64:
                tol, roundoff = roundoff_tolerance(ref, _run(name, dtype, "big", widen=True), dtype)
            methods: tuple[Method, ...] = ("cached", "plain")
            for method in methods:
                max_abs, max_rel, groups = compare_gradients(_run(name, dtype, method), ref)
                passed = max_rel <= tol
                results.append(
                    CaseResult(
                        case=name,
                        method=method,
                        dtype=str(dtype).replace("torch.", ""),
                        micro_batch_counts=list(SIZES),
                        max_abs=max_abs,
                        max_rel=max_rel,
                        tolerance=tol,
                        passed=passed,
                        groups=groups,
                        roundoff=roundoff,
                        explanation=""
                        if passed
                        else "the loss couples the samples (in-batch negatives or batch-wide sums): "
                        "accumulating it per micro-batch trains another objective, whatever the "
                        "counts. bigbatch.coupled.cached_backward computes the big batch's gradient "
                        "with one micro-batch's memory.",
                    )
                )
    return results
