"""Data helpers every task shares: the data error, image listing and readability checks, the
seeded split and the resumable loader.

A task's own data (what a sample is, how it is scanned and checked) lives in its folder under
:mod:`bigbatch.train.tasks`.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from bigbatch.images import UnreadableImageError, probe

__all__ = [
    "IMAGE_SUFFIXES",
    "DataError",
    "check_readable",
    "images_to_predict",
    "list_images",
    "make_loader",
    "read_csv_rows",
    "split_items",
    "unreadable_reason",
    "windows_per_epoch",
]


class Items(Protocol):
    """A task's list of samples: a length and a subset by index."""

    def __len__(self) -> int: ...

    def subset(self, index: Sequence[int]) -> Any: ...


ItemsT = TypeVar("ItemsT", bound=Items)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".dcm"}


class DataError(ValueError):
    """A problem with the data, naming the file or folder and the fix."""


def unreadable_reason(path: Path) -> str:
    """'' when the image can be read faithfully (:func:`bigbatch.images.probe`), else why."""
    try:
        probe(path)
        return ""
    except UnreadableImageError as exc:
        return str(exc)
    except ModuleNotFoundError:
        raise  # a missing library (Pillow, pydicom), not a bad image
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def check_readable(files: Sequence[Path], where: str | Path) -> None:
    """Raise DataError naming the unreadable images among ``files`` (test images cannot be
    skipped: a submission needs a row for each)."""
    bad = [(f, problem) for f in files if (problem := unreadable_reason(f))]
    if bad:
        raise DataError(
            f"{len(bad)} image(s) in {where} cannot be read, e.g. {bad[0][0]} ({bad[0][1][:100]}); "
            "replace or remove them"
        )


def images_to_predict(folder: str | Path) -> list[Path]:
    """Every image under ``folder`` (recursively), each readable; DataError otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder of images")
    files = list_images(folder)
    if not files:
        raise DataError(f"{folder} has no images to predict")
    check_readable(files, folder)
    return files


def list_images(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    )


def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    num_workers: int,
    min_last: int = 1,
    skip: int = 0,
    pin_memory: bool = False,
) -> DataLoader[Any]:
    """A DataLoader whose order (and augmentation, through worker seeds) depends only on ``seed``.

    The epoch's batches are drawn up front from a generator of their own, so a run resumed in
    the middle of an epoch skips the first ``skip`` batches without loading them and sees the
    same ones after. ``min_last=2`` folds a last batch of one sample into the one before it
    (BatchNorm cannot normalise a lone sample in training).

    >>> [len(b) for b in make_loader(list(range(33)), 16, shuffle=True, seed=0, num_workers=0, min_last=2).batch_sampler]
    [16, 17]
    """
    n = len(dataset)  # type: ignore[arg-type]
    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        if shuffle
        else list(range(n))
    )
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if len(batches) > 1 and len(batches[-1]) < min_last:
        short = batches.pop()
        batches[-1] = batches[-1] + short
    return DataLoader(
        dataset,
        batch_sampler=batches[skip:],
        # Worker seeds from their own generator: the global RNG (augmentation, dropout) is
        # not consumed by starting an epoch, so a restored RNG state replays it exactly.
        generator=torch.Generator().manual_seed(seed + 1),
        num_workers=num_workers,
        persistent_workers=False,
        pin_memory=pin_memory,  # page-locked batches: copies to a GPU that overlap compute
    )


def windows_per_epoch(n: int, batch: int, min_last: int = 1) -> int:
    """How many batches :func:`make_loader` yields for ``n`` samples.

    >>> windows_per_epoch(33, 16), windows_per_epoch(33, 16, min_last=2)
    (3, 2)
    """
    windows = -(-n // batch)
    short = n % batch
    return windows - 1 if windows > 1 and 0 < short < min_last else windows


def split_items(items: ItemsT, valid_pct: float, seed: int) -> tuple[ItemsT, ItemsT]:
    """A seeded random split (the same seed always gives the same validation set)."""
    index = list(range(len(items)))
    random.Random(seed).shuffle(index)
    n_valid = round(len(items) * valid_pct)
    if valid_pct > 0 and n_valid == 0:
        n_valid = 1
    train = items.subset(sorted(index[n_valid:]))
    valid = items.subset(sorted(index[:n_valid]))
    if len(train) == 0:
        raise DataError(f"no training images left after holding out valid_pct={valid_pct}")
    return train, valid


def read_csv_rows(path: Path) -> list[list[str]]:
    """Every row of a CSV, read as UTF-8 with or without Excel's byte-order mark; DataError
    naming the file and the fix otherwise."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel's byte-order mark
            return list(csv.reader(f))
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not UTF-8 text (byte {exc.start}): save it as UTF-8 (in Excel: CSV UTF-8)"
        ) from None
    except csv.Error as exc:
        raise DataError(f"{path} is not a readable CSV: {exc}") from None
