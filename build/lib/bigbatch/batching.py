"""Splitting a batch into micro-batches: balanced parts for the OOM back-off and the training
command, given sizes for ``verify``. A batch is a tensor, or a tuple/list/dict of tensors that
share their first dimension."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["batch_len", "even_sizes", "split_batch", "split_by_sizes"]


def batch_len(batch: Any) -> int:
    """Number of samples in a batch: a tensor, or a tuple/list/dict of tensors (first one)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return batch_len(next(iter(batch.values())))
    if isinstance(batch, Sequence) and batch:
        return batch_len(batch[0])
    raise TypeError(f"cannot tell the number of samples of a {type(batch).__name__}")


def split_batch(batch: Any, size: int, *, min_size: int = 1) -> list[Any]:
    """Split a batch (tensor, tuple/list or dict of tensors) into as few micro-batches of at
    most ``size`` as possible, balanced (20 by 8: 7, 7, 6, not 8, 8, 4: a lower peak, the same
    update). With ``min_size``, no part is smaller: BatchNorm models pass 2, so a window of 17
    at micro-batch 8 is not split into 8, 8, 1 (a lone sample BatchNorm cannot normalise) but
    6, 6, 5, and a window of 3 at 2 runs whole.

    >>> [len(p) for p in split_batch(torch.arange(20), 8)]
    [7, 7, 6]
    >>> [len(p) for p in split_batch(torch.arange(3), 2, min_size=2)]
    [3]
    """
    n = batch_len(batch)
    parts = max(1, min(-(-n // size), n // max(1, min_size)))
    return _split_into(batch, parts)


def _split_into(batch: Any, parts: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(parts))
    if isinstance(batch, Mapping):
        split = {k: _split_into(v, parts) for k, v in batch.items()}
        return [
            dict(zip(split, values, strict=True)) for values in zip(*split.values(), strict=True)
        ]
    if isinstance(batch, Sequence):
        columns = [_split_into(v, parts) for v in batch]
        return [type(batch)(values) for values in zip(*columns, strict=True)]  # type: ignore[call-arg]
    raise TypeError(f"cannot split a {type(batch).__name__} into micro-batches")


def split_by_sizes(x: Any, sizes: Sequence[int]) -> list[Any]:
    """Split ``x`` into micro-batches of the given sizes (which add up to its length).

    >>> [len(p) for p in split_by_sizes(torch.arange(10), [4, 4, 2])]
    [4, 4, 2]
    """
    if isinstance(x, torch.Tensor):
        return list(torch.split(x, list(sizes)))
    if isinstance(x, tuple | list):
        parts = [split_by_sizes(v, sizes) for v in x]
        return [type(x)(p[i] for p in parts) for i in range(len(sizes))]
    if isinstance(x, dict):
        split = {k: split_by_sizes(v, sizes) for k, v in x.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(len(sizes))]
    raise TypeError(f"cannot split inputs of type {type(x).__name__} into micro-batches")


def even_sizes(n: int, k: int) -> list[int]:
    """``n`` samples in ``k`` near-equal parts (fewer when ``n < k``).

    >>> even_sizes(10, 4)
    [3, 3, 2, 2]
    """
    k = max(1, min(k, n))
    return [n // k + (1 if i < n % k else 0) for i in range(k)]
