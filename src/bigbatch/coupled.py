"""Exact big batches for losses that couple the samples: contrastive (in-batch negatives), batch
Dice, listwise ranking. Gradient caching (Gao et al., 2021).

Such a loss is not a sum over samples, so no weighting of micro-batch losses equals it: 4
micro-batches of 64 see 63 negatives each, the batch of 256 sees 255. :func:`cached_backward`
computes the big batch's loss and gradient with the memory of one micro-batch:

1. each micro-batch is encoded without a graph (its random state recorded), giving the
   representations, small (batch x dim);
2. the loss runs once on all of them, and its gradient with respect to them is kept;
3. each micro-batch is encoded again, with a graph and the same random state (so dropout draws
   the same masks), and backpropagates its slice of that gradient.

The parameter gradient is then the big batch's, by the chain rule; the cost is one more forward.
It goes through :meth:`bigbatch.Accumulator.backward`, so the window's normalisation, GradScaler,
clipping, schedulers and checkpoints work as for any micro-batch, and several cached big batches
can make one optimizer step (each weighted by its count).

>>> import torch, torch.nn.functional as F
>>> from bigbatch import Accumulator
>>> encoder = torch.nn.Linear(8, 4)
>>> acc = Accumulator(torch.optim.SGD(encoder.parameters(), lr=0.1), micro_batches=1)
>>> def info_nce(z1, z2):
...     logits = F.normalize(z1, dim=1) @ F.normalize(z2, dim=1).T / 0.1
...     return F.cross_entropy(logits, torch.arange(len(z1)))
>>> pairs = [(torch.randn(3, 8), torch.randn(3, 8)) for _ in range(2)]  # 2 micro-batches of 3 pairs
>>> loss = cached_backward(acc, lambda b: (encoder(b[0]), encoder(b[1])), info_nce, pairs)
>>> _ = acc.step()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from bigbatch.accumulate import Accumulator
from bigbatch.batchnorm import running_stats_kept
from bigbatch.device import rng_state, set_rng_state

__all__ = ["cache_bytes", "cached_backward", "info_nce", "supervised_contrastive"]

# How far (in units of the representations' machine epsilon, relative to their largest value) the
# second pass may differ from the first and still count as the same computation: graph or no
# graph, the kernels are the same, so real replays agree to a few ulps.
_REPLAY_ULPS = 64

Encode = Callable[[Any], "torch.Tensor | tuple[torch.Tensor, ...]"]


def _check_replayed(out: tuple[torch.Tensor, ...], cached: list[torch.Tensor], i: int) -> None:
    """The second pass must recompute the first pass's representations: randomness that the
    saved torch RNG states do not replay (numpy augmentation, a private torch.Generator) would
    make the gradient silently inexact."""
    if len(out) != len(cached) or any(
        o.shape != c.shape for o, c in zip(out, cached, strict=False)
    ):
        raise ValueError(
            f"encode returned {[tuple(o.shape) for o in out]} for micro-batch {i} in the second "
            f"pass but {[tuple(c.shape) for c in cached]} in the first: encode must return the "
            "same representations for the same micro-batch"
        )
    for o, c in zip(out, (c.detach() for c in cached), strict=True):
        scale = float(c.abs().max()) if c.numel() else 0.0
        diff = float((o.detach() - c).abs().max()) if c.numel() else 0.0
        if diff > _REPLAY_ULPS * torch.finfo(c.dtype).eps * max(scale, 1e-30):
            raise RuntimeError(
                f"encode gave different representations for micro-batch {i} in the second pass "
                f"(max difference {diff:.2e} of {scale:.2e}): its randomness is not replayed. "
                "cached_backward replays torch's global RNGs only: draw augmentation and dropout "
                "from torch's global generator (not numpy, random or a private torch.Generator), "
                "or augment in the data pipeline before cached_backward"
            )


def _towers(out: Any, where: str) -> tuple[torch.Tensor, ...]:
    towers = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    if not towers or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in towers):
        raise TypeError(
            f"encode must return a tensor of representations (batch first) or a tuple of them "
            f"(one per tower), got {type(out).__name__} from {where}"
        )
    return towers


def _gather(t: torch.Tensor) -> torch.Tensor:
    """All ranks' rows, in rank order; the gradient flows back to the rank that owns each row.
    Ranks may hold different numbers of rows: padded to the largest for the collective, then
    trimmed."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    world = dist.get_world_size()
    rows = torch.tensor([len(t)], device=t.device)
    counts = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(counts, rows)
    sizes = [int(c) for c in counts]
    padded = torch.cat([t, t.new_zeros((max(sizes) - len(t), *t.shape[1:]))])
    if t.requires_grad:
        parts = list(dist_fn.all_gather(padded))
    else:
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


# One function, long: the two passes share their state (the RNG states, the cached
# representations and their gradients), which the second pass's closure reads.
def cached_backward(
    acc: Accumulator,
    encode: Encode,
    loss_fn: Callable[..., torch.Tensor],
    micro_batches: Sequence[Any],
    *,
    targets: torch.Tensor | None = None,
    count: int | None = None,
    gather: bool = False,
) -> torch.Tensor:
    """Backpropagate ``loss_fn`` over the big batch made of ``micro_batches``, exactly, holding
    one micro-batch's activations at a time. Returns the loss (detached).

    ``encode(micro_batch)`` returns its representations, batch first: a tensor, or a tuple with
    one per tower (image and text, or two views). ``loss_fn(*towers)`` (``loss_fn(*towers,
    targets)`` when ``targets`` are given, for the whole big batch, in order) gets each tower's
    representations of the whole big batch and returns its mean loss. ``count`` is what the loss
    averages over (default: the number of rows); the Accumulator weights this big batch by it.
    ``gather=True`` under torch.distributed: every rank's representations (and targets) join the
    loss, so the negatives are the global batch; the gradient of each row flows back to its rank.
    Put autocast inside ``encode`` and ``loss_fn`` where you want it.

    >>> from torch import nn
    >>> encoder = nn.Linear(8, 4)
    >>> acc = Accumulator(torch.optim.SGD(encoder.parameters(), lr=0.1))
    >>> pairs = torch.randn(6, 2, 8)  # two views of 6 samples, in micro-batches of 3
    >>> encode = lambda p: (encoder(p[:, 0]), encoder(p[:, 1]))
    >>> loss = cached_backward(acc, encode, info_nce, [pairs[:3], pairs[3:]])
    >>> torch.allclose(loss, info_nce(*encode(pairs))), acc.step().count  # the big batch's loss
    (True, 6.0)
    """
    if not isinstance(micro_batches, Sequence) or isinstance(micro_batches, str | bytes):
        raise TypeError(
            f"micro_batches must be a list of micro-batches (each is encoded twice), got "
            f"{type(micro_batches).__name__}: pass list(...) of the big batch's micro-batches, "
            "e.g. [next(it) for _ in range(4)]"
        )
    if not micro_batches:
        raise ValueError("micro_batches is empty: give the big batch's micro-batches")
    # Checked before the first pass's work; backward() checks again.
    acc.window.check_open()
    if len(micro_batches) == 1 and not gather:
        # The big batch is one micro-batch: its own forward and backward are the big batch's,
        # with no second forward pass to pay (nor representations to cache).
        towers_of_one = _towers(encode(micro_batches[0]), "micro-batch 0")
        extra = [targets] if targets is not None else []
        loss = loss_fn(*towers_of_one, *extra)
        acc.backward(loss, count=count if count is not None else len(towers_of_one[0]))
        return loss.detach()
    states = []
    parts: list[tuple[torch.Tensor, ...]] = []
    with running_stats_kept():  # the second pass updates them, once per micro-batch
        for i, mb in enumerate(micro_batches):
            states.append(rng_state())
            with torch.no_grad():
                parts.append(tuple(t.detach() for t in _towers(encode(mb), f"micro-batch {i}")))
    n_towers = len(parts[0])
    if any(len(p) != n_towers for p in parts):
        raise ValueError("encode returned a different number of towers for different micro-batches")
    sizes = [len(p[0]) for p in parts]
    local = [torch.cat([p[t] for p in parts]).requires_grad_(True) for t in range(n_towers)]
    after_first_pass = rng_state()
    towers = [_gather(t) for t in local] if gather else local
    args: list[Any] = list(towers)
    if targets is not None:
        args.append(_gather(targets) if gather else targets)
    loss = loss_fn(*args)

    def second_pass(weighted: torch.Tensor) -> None:
        # The loss's gradient with respect to every row of this rank (all-gather's backward
        # routes the other ranks' share here), then each micro-batch's own backward.
        weighted.backward()
        # A tower the loss does not use (deep supervision's output of weight 0) gets no
        # gradient: backpropagating zeros through it would give the weights only it reaches a
        # zero gradient where the big batch leaves none, and weight decay and momentum would
        # then move them.
        grads = [t.grad for t in local]
        start = 0
        for i, (state, mb, n) in enumerate(zip(states, micro_batches, sizes, strict=True)):
            set_rng_state(state)  # the same dropout masks as the first pass
            out = _towers(encode(mb), "the second pass")
            cached = [t[start : start + n] for t in local]
            _check_replayed(out, cached, i)
            if not any(o.requires_grad for o in out):
                raise RuntimeError(
                    f"encode's output for micro-batch {i} does not require grad in the second "
                    "pass: the encoder is frozen (requires_grad=False) or encode detaches or runs "
                    "under torch.no_grad(); gradient caching needs a trainable encoder"
                )
            used = [
                (o, g[start : start + n])
                for o, g in zip(out, grads, strict=True)
                if o.requires_grad and g is not None
            ]
            if used:
                with running_stats_kept():  # a checkpointed encoder's recomputation
                    torch.autograd.backward([o for o, _ in used], [g for _, g in used])
            start += n
        set_rng_state(after_first_pass)

    acc.backward(loss, count=count if count is not None else sum(sizes), backward=second_pass)
    return loss.detach()


def info_nce(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.2) -> torch.Tensor:
    """Symmetric InfoNCE (CLIP, SimCLR's NT-Xent across views): row i of ``z1`` and of ``z2`` are
    a positive pair, every other row of the batch a negative. It couples the samples.

    >>> z = torch.eye(4)
    >>> round(float(info_nce(z, z, temperature=0.05)), 4)
    0.0
    """
    logits = F.normalize(z1, dim=1) @ F.normalize(z2, dim=1).T / temperature
    target = torch.arange(len(z1), device=z1.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def supervised_contrastive(
    z: torch.Tensor, labels: torch.Tensor, temperature: float = 0.2
) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al., 2020): rows with the same label are each
    other's positives, all other rows of the batch negatives. It couples the samples, so a
    window accumulates it with :func:`cached_backward`.

    >>> z = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    >>> together = supervised_contrastive(z, torch.tensor([0, 0, 1, 1]))
    >>> apart = supervised_contrastive(z, torch.tensor([0, 1, 0, 1]))
    >>> bool(together < apart), supervised_contrastive.couples_samples
    (True, True)
    """
    z = F.normalize(z, dim=1)
    self_mask = torch.eye(len(z), dtype=torch.bool, device=z.device)
    sim = (z @ z.T / temperature).masked_fill(self_mask, torch.finfo(z.dtype).min)
    log_prob = sim.log_softmax(dim=1)
    positives = (labels[:, None] == labels[None, :]) & ~self_mask
    per_anchor = -(log_prob.masked_fill(~positives, 0)).sum(1) / positives.sum(1).clamp(min=1)
    return per_anchor.mean()


info_nce.couples_samples = True  # type: ignore[attr-defined]
supervised_contrastive.couples_samples = True  # type: ignore[attr-defined]


def cache_bytes(
    batch: int,
    dim: int,
    *,
    towers: int = 2,
    element_bytes: int = 4,
    pairwise: bool = True,
) -> int:
    """Memory :func:`cached_backward` holds besides one micro-batch's step, for planning
    (``plan_micro_batch(..., extra_bytes=cache_bytes(...))``): the representations and their
    gradients (``2 x towers x batch x dim``), and, for a ``pairwise`` loss (InfoNCE, supervised
    contrastive), its own activations at the full batch: the ``batch x batch`` similarities,
    their softmax both ways and its gradient, about 6 of them.

    >>> cache_bytes(1024, 128) // 2**20   # MiB: 2 MiB of representations, 24 of similarities
    26
    """
    reps = 2 * towers * batch * dim * element_bytes
    return reps + (6 * batch * batch * element_bytes if pairwise else 0)
