"""BatchNorm's running statistics kept through a block that runs the forward again: the backward
of an activation-checkpointed model (its recomputation), or gradient caching's graph-free first
pass (:mod:`bigbatch.coupled`). Without it each such forward moves the statistics once more: a
checkpointed step counts two batches in ``num_batches_tracked`` and pulls the running mean
twice towards the same batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["running_stats_kept"]


@contextmanager
def running_stats_kept() -> Iterator[None]:
    """Inside: every BatchNorm that runs in train mode (tracking running statistics) has them
    put back on exit as they were when it first ran inside. Found through a forward pre-hook,
    removed on exit, so it covers any model, whichever module runs; a block in which no
    BatchNorm runs costs nothing. :meth:`bigbatch.Accumulator.backward` runs every backward
    inside it; wrap your own ``loss.backward()`` where you call it yourself.

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> bn = torch.nn.BatchNorm1d(3)
    >>> loss = checkpoint(bn, torch.randn(4, 3, requires_grad=True), use_reentrant=False).sum()
    >>> with running_stats_kept():
    ...     loss.backward()  # recomputes bn's forward
    >>> int(bn.num_batches_tracked)  # once, as without checkpointing
    1
    """
    saved: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def snapshot(module: nn.Module, _: Any) -> None:
        if (
            isinstance(module, nn.modules.batchnorm._NormBase)
            and module.training
            and module.track_running_stats
            and module not in saved
        ):
            saved[module] = [(b, b.detach().clone()) for b in module.buffers(recurse=False)]

    handle = nn.modules.module.register_module_forward_pre_hook(snapshot)
    try:
        yield
    finally:
        handle.remove()
        with torch.no_grad():
            for buffers in saved.values():
                for live, before in buffers:
                    live.copy_(before)
