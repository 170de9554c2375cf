"""torch.distributed glue: global counts, gradient sync once per window, rank agreement.

Nothing here starts a process group: bigbatch uses the one the user (or torchrun) set up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.window import Window, mean_loss

__all__ = [
    "SyncControl",
    "all_reduce_grads",
    "all_reduce_sum",
    "any_rank",
    "ddp_bucket_bytes",
    "is_ddp",
    "is_distributed",
    "is_fsdp",
    "max_over_ranks",
    "maxima_over_ranks",
    "maybe_no_sync",
    "rank_share",
    "share_line",
    "syncs_gradients",
    "window_totals",
    "world_size",
]


def is_distributed(group: Any = None) -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1


def ddp_bucket_bytes(model: nn.Module) -> int:
    """What ``DistributedDataParallel`` holds on each rank beside the step, from its
    construction on: its buckets, a copy of every trainable weight's gradient in the weight's
    dtype (``gradient_as_bucket_view`` off, its default and how bigbatch train wraps).

    >>> ddp_bucket_bytes(nn.Linear(100, 10))  # (1000 weights + 10 biases) x 4 bytes
    4040
    """
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def rank_share(batch: int, world: int) -> int:
    """The samples each of ``world`` ranks holds of a window of ``batch``: its share, rounded up
    (DistributedSampler pads the ranks to the same length), what each rank plans for.

    >>> rank_share(63, 2)
    32
    """
    return math.ceil(batch / world)


def share_line(batch: int, world: int) -> str:
    """What ``bigbatch train`` under torchrun and ``bigbatch plan --world-size`` say first.

    >>> share_line(64, 2)
    'distributed: 2 ranks x 32 samples per window = target batch 64'
    """
    share = f"{world} ranks x {rank_share(batch, world)} samples per window"
    return f"distributed: {share} = target batch {batch}"


def is_ddp(model: nn.Module | None) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def is_fsdp(model: nn.Module | None) -> bool:
    """An FSDP2 module (``torch.distributed.fsdp.fully_shard``)."""
    return model is not None and callable(getattr(model, "set_requires_gradient_sync", None))


def syncs_gradients(model: nn.Module | None) -> bool:
    """Whether ``model`` reduces gradients across ranks itself during backward."""
    return is_ddp(model) or is_fsdp(model)


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (a no-op on one process); returns it."""
    if is_distributed(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def any_rank(flag: bool, device: torch.device | str = "cpu", group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on at least one (used so ranks agree on OOM)."""
    return max_over_ranks(int(flag), device, group) > 0


def max_over_ranks(value: int, device: torch.device | str = "cpu", group: Any = None) -> int:
    """The largest ``value`` of all ranks, on every rank (one process: ``value``); used so that
    ranks measuring different peaks agree on one micro-batch.

    >>> max_over_ranks(3)
    3
    """
    return maxima_over_ranks([value], device, group)[0]


def maxima_over_ranks(
    values: list[int], device: torch.device | str = "cpu", group: Any = None
) -> list[int]:
    """Each of ``values``' largest over all ranks, on every rank, in one collective (one
    process: ``values``): the measurements a refit agrees on (a peak, what the card holds
    outside the allocator, the OOM back-offs so far), so that every rank refits alike.

    >>> maxima_over_ranks([3, 0, 1])
    [3, 0, 1]
    """
    if not is_distributed(group):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


@contextmanager
def maybe_no_sync(model: nn.Module | None, skip_sync: bool) -> Iterator[None]:
    """Skip the gradient reduction of the backward run inside, when ``skip_sync``: DDP's
    ``no_sync``, or FSDP2's ``set_requires_gradient_sync(False)``; otherwise nothing."""
    if skip_sync and is_fsdp(model):
        model.set_requires_gradient_sync(False)  # type: ignore[union-attr, operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[union-attr, operator]
        return
    ctx = model.no_sync() if (skip_sync and is_ddp(model)) else nullcontext()  # type: ignore[operator, union-attr]
    with ctx:
        yield


def window_totals(
    count: float | torch.Tensor,
    loss_sum: torch.Tensor | None,
    *,
    local: bool,
    synced: bool,
    model: nn.Module | None,
    device: torch.device,
    group: Any = None,
) -> tuple[float, float, bool] | None:
    """One small all-reduce of every rank's window count, loss sum and sync state: (the global
    count, the exact mean loss, whether DDP/FSDP2 synchronised the gradients already), or None
    when no rank had a window (every rank ran out of data)."""
    totals = torch.tensor(
        [
            float(count),
            float(loss_sum) if loss_sum is not None else 0.0,
            1.0 if local else 0.0,
            1.0 if synced else 0.0,
        ],
        dtype=torch.float64,
        device=device,
    )
    all_reduce_sum(totals, group)
    total, loss_total, n_local, n_synced = totals.tolist()
    if n_local == 0:
        return None
    world = world_size(group)
    if 0 < n_synced < world:
        raise RuntimeError(
            "ranks disagree on whether DDP synchronised this window's gradients: they ran "
            "different numbers of micro-batches. Use Accumulator(..., sync='step'), which "
            "synchronises once at step time and lets ranks run out of data at different times"
        )
    all_synced = n_synced == world
    if not all_synced and is_fsdp(model):
        raise RuntimeError(
            "this window ended before its last micro-batch synchronised FSDP2's sharded "
            "gradients (a partial window): use Accumulator(..., sync='every') with FSDP2, "
            "or windows that always fill"
        )
    return total, (loss_total / total if total > 0 else math.nan), all_synced


def all_reduce_grads(params: list[torch.Tensor], group: Any) -> None:
    """Sum the gradients over ranks in one flat all-reduce. A rank without a gradient for a
    parameter (it ran out of data, or the parameter was unused) takes part with zeros."""
    trainable = [p for p in params if p.requires_grad]
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in trainable:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in groups.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_sum(flat, group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class SyncControl:
    """How a window's gradients meet across ranks, chosen once from the model and ``sync``: by
    DDP/FSDP2 itself during the window's last backward (``"last"``), during every backward
    (``"every"``, FSDP2: less memory), or by one flat all-reduce at step time (``"step"``). It
    also sums the window's count and loss over ranks. On one process everything is a no-op.

    >>> control = SyncControl(None, "last")
    >>> control.distributed, control.totals(Window(), [])[0]
    (False, 0.0)
    """

    def __init__(self, model: nn.Module | None, sync: str, group: Any = None) -> None:
        self.model, self.sync, self.group = model, sync, group
        self.pending = True  # whether DDP will all-reduce the next backward (not in no_sync)
        self.last_synced = True  # whether the window's last backward did

    @property
    def distributed(self) -> bool:
        return is_distributed(self.group)

    @contextmanager
    def micro_batch(self, model: nn.Module | None, is_last: Callable[[], bool]) -> Iterator[None]:
        """Run one micro-batch's forward and backward; ``is_last()``: whether it ends the window
        (asked only where the answer matters)."""
        model = model if model is not None else self.model
        skip = (
            syncs_gradients(model)
            and self.sync != "every"
            and (self.sync == "step" or not is_last())
        )
        self.pending = not skip
        try:
            with maybe_no_sync(model, skip):
                yield
        finally:
            self.pending = True

    def after_backward(self) -> None:
        self.last_synced, self.pending = self.pending, True

    def totals(
        self, window: Window, params: list[torch.Tensor]
    ) -> tuple[float, float, float | Callable[[], float]] | None:
        """(the window's count over all ranks, the reference its gradient is scaled against,
        its exact mean loss), or None when no rank had a window; under DDP the gradients are
        summed over ranks here where DDP did not do it during backward."""
        ref = float(window.ref) if window.ref is not None else 1.0
        if not self.distributed:
            count = float(window.count)
            # Computed when first read: a loop that does not log it never waits for the device
            # (the window's lists are replaced, not cleared, when it resets).
            loss = partial(mean_loss, window.losses, window.counts, window.reduction, count)
            return count, ref, loss
        local = window.micro > 0
        device = next((p.grad.device for p in params if p.grad is not None), params[0].device)
        totals = window_totals(
            window.count,
            window.loss_sum(),
            local=local,
            synced=local and self.last_synced and syncs_gradients(self.model),
            model=self.model,
            device=device,
            group=self.group,
        )
        if totals is None:
            return None
        count, mean, synced = totals
        if synced:
            # DDP (all-reduce) and FSDP2 (reduce-scatter) averaged the per-rank sums over world
            # size; undo that and divide by the count.
            ref *= world_size(self.group)
        elif count > 0:
            all_reduce_grads(params, self.group)
        return count, ref, mean
