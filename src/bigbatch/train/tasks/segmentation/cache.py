"""Cases kept in memory after their deterministic preprocessing, through MONAI's
``CacheDataset``: reading a volume, orienting, resampling and z-scoring it (or decoding and
resizing an image) happens once, before training; each epoch then runs only the random part
(the patch, the flips, the intensity changes) on a copy.

How many cases are kept follows a byte budget (``cache=auto``: a quarter of the memory the
system can still give; ``cache=none``: nothing; or a size such as ``8GB``), measured on the
first case. Loader workers started by fork (Linux) share the kept cases; started by spawn
(macOS, Windows) each worker holds a copy, so there ``auto`` divides its quarter between them.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import torch
from torch.utils.data import Dataset

from bigbatch.device import free_bytes
from bigbatch.memory.budget import parse_bytes
from bigbatch.train.tasks.segmentation.data import SegDataset

__all__ = ["CachedCases", "cache_budget", "case_bytes"]


def cache_budget(setting: str, workers: int = 0) -> int:
    """The bytes ``cache=`` allows: ``auto``, ``none`` or a size.

    >>> cache_budget("none"), cache_budget("1MB")
    (0, 1000000)
    """
    text = setting.strip().lower()
    if text == "none":
        return 0
    if text != "auto":
        try:
            return parse_bytes(text)
        except ValueError as exc:
            raise ValueError(f"cache={setting!r}: give auto, none or a size such as 8GB") from exc
    forked = multiprocessing.get_start_method(allow_none=True) in (None, "fork")
    copies = 1 if forked else max(workers, 1) + 1  # spawned workers each unpickle a copy
    return free_bytes("cpu") // 4 // copies


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def case_bytes(dataset: SegDataset, i: int = 0) -> int:
    """What case ``i`` takes once prepared (image and mask)."""
    return max(_nbytes(dataset.prepared(i)), 1)


class CachedCases(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``dataset`` with its first ``cache_num`` cases prepared once (MONAI's CacheDataset,
    filled by ``threads`` threads now); the rest prepared when read, as before. Samples are the
    same as ``dataset``'s for the same torch random state."""

    def __init__(self, dataset: SegDataset, cache_num: int, threads: int = 1) -> None:
        from monai.data import CacheDataset
        from monai.transforms import Compose, Lambda, RandLambda

        # The random part is a RandLambda: CacheDataset keeps what comes before it. Validation
        # has none, so its whole (padded) sample is kept. map_items=False: a prepared case is a
        # (image, mask) pair, not two items.
        # track_meta=False: the pairs pass through as they are (no MetaTensor wrapping).
        final = RandLambda if dataset.train else Lambda
        last = final(func=dataset.from_prepared, track_meta=False)
        first = Lambda(func=dataset.prepared, track_meta=False)
        pipeline = Compose([first, last], map_items=False)
        self.inner = CacheDataset(
            list(range(len(dataset))),
            pipeline,
            cache_num=cache_num,
            num_workers=max(threads, 1),
            progress=False,
        )

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.inner[i]
        return x, y
