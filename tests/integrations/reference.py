"""Shared data and big-batch references for the framework adapter tests.

Inputs are float64 tensors holding float32 values, so a framework that passes data through
float32 (Keras's data adapters) still sees exactly the reference's inputs.

Each scenario is a list of micro-batches ``(x, labels)`` for a per-sample (labels of shape (n,))
or per-token (labels of shape (n, T), padding = -100) classifier with a linear head. The
reference update is computed on the whole window at once, in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FEATURES, CLASSES, SEQ = 8, 3, 16
Batch = tuple[torch.Tensor, torch.Tensor]


def sample_batches(sizes: list[int], seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, FEATURES, generator=g).double(),
            torch.randint(0, CLASSES, (n,), generator=g),
        )
        for n in sizes
    ]


def token_batches(sizes: list[int], seed: int = 0) -> list[Batch]:
    """Sequences of random length (1..SEQ) padded to SEQ: token counts differ a lot per batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        x = torch.randn(n, SEQ, FEATURES, generator=g).double()
        y = torch.randint(0, CLASSES, (n, SEQ), generator=g)
        lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
        y[torch.arange(SEQ)[None, :] >= lengths[:, None]] = -100
        out.append((x, y))
    return out


# name -> (micro-batches of one epoch, micro-batches per window)
SCENARIOS: dict[str, tuple[list[Batch], int]] = {
    "uneven": (sample_batches([4, 12, 16, 32]), 4),
    "short_last": (sample_batches([16, 16, 4], seed=1), 4),
    "tokens": (token_batches([1, 3, 8, 27], seed=2), 4),
}


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled samples or tokens."""
    return F.cross_entropy(logits.reshape(-1, CLASSES), labels.reshape(-1), ignore_index=-100)


def cat(batches: list[Batch]) -> Batch:
    xs = [x for x, _ in batches]
    ys = [y for _, y in batches]
    return torch.cat(xs), torch.cat(ys)


def reference_update(
    weight: torch.Tensor,
    bias: torch.Tensor,
    windows: list[list[Batch]],
    lr: float,
    clip: float | None = None,
    dtype: torch.dtype = torch.float64,
    autocast: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain SGD on each window as one big batch, in float64: the update accumulation must equal
    (``dtype=torch.float32``: the same big batch at float32's round-off; with ``autocast``, at
    that dtype's under CPU autocast, as a mixed-precision run computes it)."""
    w = weight.detach().to(dtype).clone().requires_grad_(True)
    b = bias.detach().to(dtype).clone().requires_grad_(True)
    for window in windows:
        x, y = cat(window)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = loss_of(x.to(dtype) @ w.T + b, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([w, b], clip)
        with torch.no_grad():
            w -= lr * w.grad
            b -= lr * b.grad
        w.grad = b.grad = None
    return w.detach().double(), b.detach().double()


def roundoff_tol(
    init: tuple[torch.Tensor, torch.Tensor],
    windows: list[list[Batch]],
    lr: float,
    autocast: torch.dtype | None = None,
) -> float:
    """The tolerance of a float32 run (with ``autocast``, of one under CPU autocast at that
    dtype): a multiple of that big batch's own distance from the float64 one, on the update,
    never below a few units in the last place (``bigbatch.verify.roundoff_tolerance``)."""
    from bigbatch.verify import roundoff_tolerance

    def update(dtype: torch.dtype, at: torch.dtype | None) -> dict[str, torch.Tensor]:
        got = reference_update(*init, windows, lr, dtype=dtype, autocast=at)
        return {str(i): g - i0.double() for i, (g, i0) in enumerate(zip(got, init, strict=True))}

    rounded, exact = update(torch.float32, autocast), update(torch.float64, None)
    return roundoff_tolerance(rounded, exact, autocast or torch.float32)[0]


def rel_err(
    got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], init: tuple[torch.Tensor, ...]
) -> float:
    """Largest difference between the two runs' updates, relative to the reference update."""
    got, want, init = (tuple(t.detach() for t in ts) for ts in (got, want, init))
    num = max(float((g.double() - w).abs().max()) for g, w in zip(got, want, strict=True))
    den = max(float((w - i.double()).abs().max()) for w, i in zip(want, init, strict=True))
    return num / den


def windows_of(batches: list[Batch], n: int) -> list[list[Batch]]:
    return [batches[i : i + n] for i in range(0, len(batches), n)]
