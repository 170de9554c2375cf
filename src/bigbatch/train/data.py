"""Data helpers every task shares: the data error, image listing and readability checks, the
seeded split and the resumable loader.

A task's own data (what a sample is, how it is scanned and checked) lives in its folder under
:mod:`bigbatch.train.tasks`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from bigbatch import io
from bigbatch.images import UnreadableImageError, probe

__all__ = [
    "IMAGE_SUFFIXES",
    "DataError",
    "EpochBatches",
    "SeededSamples",
    "check_readable",
    "images_to_predict",
    "list_images",
    "make_loader",
    "read_csv_rows",
    "seed_python_from_torch",
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
    """A problem with the data, naming the file or folder and the fix: what a task raises for
    bad data. Every command says it in one line, without a traceback, before any training.

    >>> raise DataError("train.csv line 3: no tags: every row is image,tag1 tag2 ...")
    Traceback (most recent call last):
    ...
    bigbatch.train.data.DataError: train.csv line 3: no tags: every row is image,tag1 tag2 ...
    """


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
    """Every image under ``folder`` (recursively, hidden files and folders left out), each
    readable; DataError otherwise.

    >>> import tempfile
    >>> from PIL import Image
    >>> folder = Path(tempfile.mkdtemp()); Image.new("RGB", (4, 4)).save(folder / "a.png")
    >>> Image.new("RGB", (4, 4)).save(folder / "._a.png")  # macOS's copy: not an image to predict
    >>> [p.name for p in images_to_predict(folder)]
    ['a.png']
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder of images")
    files = list_images(folder)
    if not files:
        raise DataError(f"{folder} has no images to predict")
    check_readable(files, folder)
    return files


def list_images(folder: Path) -> list[Path]:
    """The images under ``folder``, recursively, leaving out hidden files and folders (a
    ``.DS_Store``, macOS's ``._name.jpg`` copies, a ``.ipynb_checkpoints`` folder): they are no
    test images, and a submission would gain rows for them."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in IMAGE_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


class EpochBatches:
    """A loader's batches, epoch by epoch, in an order that depends only on the seed
    :meth:`set_epoch` gives: one batch sampler for the whole run, so a loader's workers live
    across epochs (``persistent_workers``) and the order still changes with each epoch.

    ``min_last=2`` folds a last batch of one sample into the one before it (BatchNorm cannot
    normalise a lone sample in training); ``skip`` leaves out the batches a resumed run has
    done. With ``seeded``, each index comes with its sample's seed (:class:`SeededSamples`).

    >>> batches = EpochBatches(5, 2, shuffle=False, min_last=2)
    >>> batches.set_epoch(0); list(batches)
    [[0, 1], [2, 3, 4]]
    """

    def __init__(
        self, n: int, batch_size: int, *, shuffle: bool, min_last: int = 1, seeded: bool = False
    ) -> None:
        self.n, self.batch_size, self.shuffle = n, batch_size, shuffle
        self.min_last, self.seeded = min_last, seeded
        self.batches: list[list[Any]] = []

    def set_epoch(self, seed: int, skip: int = 0) -> None:
        order = (
            torch.randperm(self.n, generator=torch.Generator().manual_seed(seed)).tolist()
            if self.shuffle
            else list(range(self.n))
        )
        batches = [order[i : i + self.batch_size] for i in range(0, self.n, self.batch_size)]
        if len(batches) > 1 and len(batches[-1]) < self.min_last:
            short = batches.pop()
            batches[-1] = batches[-1] + short
        if self.seeded:
            batches = [[(sample_seed(seed, i), i) for i in batch] for batch in batches]
        self.batches = batches[skip:]

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def sample_seed(seed: int, index: int) -> int:
    """A sample's seed in an epoch: distinct for each (epoch seed, index), any worker."""
    return (seed * 0x9E3779B97F4A7C15 + index) % 2**63


def seed_python_from_torch() -> None:
    """Seed Python's ``random`` from torch's CPU generator, as an image sample's transforms
    start: timm's PIL transforms draw from Python's generator, so a seed (and a resumed run,
    which restores torch's state) replays the augmentation; the GPU path's draws
    (:mod:`bigbatch.train.tasks.device_images`) start the same way, so both draw alike."""
    random.seed(int(torch.randint(0, 2**31 - 1, ())))


class SeededSamples(Dataset[Any]):
    """``dataset[index]`` with torch's and Python's generators seeded for that sample first,
    from ``(seed, index)`` keys (:class:`EpochBatches` with ``seeded``): in loader workers a
    sample's augmentation then depends on the seed alone, not on which worker loads it or what
    it loaded before, so persistent workers, any ``num_workers`` and a run resumed mid-epoch
    draw the same augmentation."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        seed, index = key
        # The CPU generator alone, which a worker's transforms draw from: torch.manual_seed
        # also queues a seed for every GPU backend, about 80 us a sample (a stack formatted
        # each time where CUDA is not started), 15 % of decoding and cropping a 256 px JPEG.
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        return self.dataset[index]


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
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """A DataLoader whose order (and augmentation) depends only on ``seed``: its batches are
    drawn up front (:class:`EpochBatches`), so a run resumed in the middle of an epoch skips
    the first ``skip`` batches without loading them and sees the same ones after. With workers,
    each sample's augmentation is seeded from ``(seed, index)`` (:class:`SeededSamples`) and the
    workers persist: call ``loader.batch_sampler.set_epoch(seed, skip)`` for the next epoch
    instead of making a new loader (no workers started again each epoch). ``collate_fn`` joins
    samples into a batch (the task's; default torch's ``default_collate``).

    >>> [len(b) for b in make_loader(list(range(33)), 16, shuffle=True, seed=0, num_workers=0, min_last=2).batch_sampler]
    [16, 17]
    """
    n = len(dataset)  # type: ignore[arg-type]
    batches = EpochBatches(
        n, batch_size, shuffle=shuffle, min_last=min_last, seeded=num_workers > 0
    )
    batches.set_epoch(seed, skip)
    return DataLoader(
        SeededSamples(dataset) if num_workers > 0 else dataset,
        batch_sampler=batches,
        # Worker seeds from their own generator: the global RNG (augmentation, dropout) is
        # not consumed by starting an epoch, so a restored RNG state replays it exactly.
        generator=torch.Generator().manual_seed(seed + 1),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,  # page-locked batches: copies to a GPU that overlap compute
        collate_fn=collate_fn,
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
    """A seeded random split (the same seed always gives the same validation set); ``items``
    has ``len()`` and ``subset(index)``, which a task's own items define.

    >>> class Items(list):
    ...     def subset(self, index):
    ...         return Items(self[i] for i in index)
    >>> train, valid = split_items(Items("abcdefghij"), 0.2, seed=0)
    >>> len(train), len(valid)
    (8, 2)
    """
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
    """Every row of a CSV in the dialects spreadsheets write (:func:`bigbatch.io.read_csv_rows`);
    DataError naming the file and the fix otherwise.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "train.csv"; _ = path.write_text("image,tags\\na.png,red\\n")
    >>> read_csv_rows(path)
    [['image', 'tags'], ['a.png', 'red']]
    """
    try:
        return io.read_csv_rows(path)
    except io.CSVError as exc:
        raise DataError(str(exc)) from None
