"""torch.distributed glue: global counts, gradient sync once per window, rank agreement.

Nothing here starts a process group: bigbatch uses the one the user (or torchrun) set up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "all_reduce_sum",
    "any_rank",
    "is_ddp",
    "is_distributed",
    "is_fsdp",
    "maybe_no_sync",
    "syncs_gradients",
    "world_size",
]


def is_distributed(group: Any = None) -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1


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
    if not is_distributed(group):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


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
