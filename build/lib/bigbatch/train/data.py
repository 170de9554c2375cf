"""Image data: a folder of class sub-folders or a CSV of ``file,label``; checked before training.

Every file is opened once up front (a few ms each): unreadable images are skipped and counted
(or stop the run, with ``bad_images="error"``), and empty classes, missing files and labels the
training set never saw are errors that name the file, before any long work starts.
"""

from __future__ import annotations

import csv
import random
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "DataError",
    "DuplicateRowsWarning",
    "ImageDataset",
    "ImageItems",
    "build_transforms",
    "check_readable",
    "images_to_predict",
    "list_images",
    "make_loader",
    "scan_csv",
    "scan_folder",
    "windows_per_epoch",
]

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DataError(ValueError):
    """A problem with the data, naming the file or folder and the fix."""


class DuplicateRowsWarning(UserWarning):
    """A CSV listed a file more than once; it is used once."""


@dataclass
class ImageItems:
    """A list of image files with class indices, and what was skipped on the way."""

    files: list[Path]
    labels: list[int]
    classes: list[str]
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, index: Sequence[int]) -> ImageItems:
        return ImageItems(
            [self.files[i] for i in index], [self.labels[i] for i in index], self.classes
        )


def _readable(path: Path) -> str:
    """'' when PIL can decode the image, else the reason."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
        return ""
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _check_images(
    files: list[Path], labels: list[int], bad_images: str
) -> tuple[list[Path], list[int], list[tuple[Path, str]]]:
    keep_f, keep_l, skipped = [], [], []
    for f, label in zip(files, labels, strict=True):
        problem = _readable(f)
        if problem:
            if bad_images == "error":
                raise DataError(
                    f"cannot read image {f}: {problem}; remove it, or set bad_images=skip"
                )
            skipped.append((f, problem))
            continue
        keep_f.append(f)
        keep_l.append(label)
    return keep_f, keep_l, skipped


def check_readable(files: Sequence[Path], where: str | Path) -> None:
    """Raise DataError naming the unreadable images among ``files`` (test images cannot be
    skipped: a submission needs a row for each)."""
    bad = [(f, problem) for f in files if (problem := _readable(f))]
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


def scan_folder(
    root: str | Path, *, classes: Sequence[str] | None = None, bad_images: str = "skip"
) -> ImageItems:
    """One sub-folder per class. ``classes`` (from training) fixes the order and rejects new ones."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data folder {root} does not exist")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(
            f"{root} has no class sub-folders; put each class's images in {root}/<class>/"
        )
    names = [p.name for p in folders]
    if classes is None and {"images", "masks"} <= set(names):
        raise DataError(
            f"{root} holds images/ and masks/: a segmentation data set, not classes. Add "
            "task=segmentation (or, to classify, put each class's images in its own sub-folder)"
        )
    if classes is not None:
        unseen = sorted(set(names) - set(classes))
        if unseen:
            raise DataError(f"{root} has classes the training data does not: {', '.join(unseen)}")
    order = list(classes) if classes is not None else names
    files: list[Path] = []
    labels: list[int] = []
    for folder in folders:
        images = list_images(folder)
        if not images:
            raise DataError(
                f"class folder {folder} has no images ({', '.join(sorted(IMAGE_SUFFIXES))}); add some or remove it"
            )
        files += images
        labels += [order.index(folder.name)] * len(images)  # once per class folder
    files, labels, skipped = _check_images(files, labels, bad_images)
    _check_readable_classes(root, files, labels, order, skipped, require_all=classes is None)
    return ImageItems(files, labels, order, skipped)


def _check_readable_classes(
    source: Path,
    files: list[Path],
    labels: list[int],
    order: Sequence[str],
    skipped: list[tuple[Path, str]],
    *,
    require_all: bool,
) -> None:
    """After unreadable images are skipped: no image left at all, or (for training data) a
    class left with none, is an error that names the files, not an empty class."""
    if not files:
        example = f", e.g. {skipped[0][0]} ({skipped[0][1][:100]})" if skipped else ""
        raise DataError(
            f"none of the {len(skipped)} image(s) in {source} can be read{example}; check the "
            "files are images (PNG, JPEG, ...) and not empty or damaged"
        )
    if require_all:
        present = set(labels)
        empty = [name for i, name in enumerate(order) if i not in present]
        if empty:
            raise DataError(
                f"class {empty[0]!r} in {source} has no readable image (all "
                f"{sum(1 for f, _ in skipped if f.parent.name == empty[0]) or 'of its'} "
                "unreadable): fix its images, or remove the class"
            )


def scan_csv(
    path: str | Path,
    *,
    image_root: str | Path | None = None,
    classes: Sequence[str] | None = None,
    bad_images: str = "skip",
) -> ImageItems:
    """A CSV with a header; the first column is the file (relative to ``image_root``), the second
    the label."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"CSV {path} does not exist")
    root = Path(image_root) if image_root else path.parent
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel's byte-order mark
            rows = list(csv.reader(f))
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not UTF-8 text (byte {exc.start}): save it as UTF-8 (in Excel: CSV UTF-8)"
        ) from None
    except csv.Error as exc:
        raise DataError(f"{path} is not a readable CSV: {exc}") from None
    if len(rows) < 2 or len(rows[0]) < 2:
        raise DataError(f"{path} needs a header and rows of file,label")
    body: list[tuple[str, str]] = []
    for line, row in enumerate(rows[1:], start=2):
        if not row or not any(cell.strip() for cell in row):
            continue  # a blank line
        if len(row) < 2 or not row[1].strip():
            raise DataError(
                f"{path} line {line} has no label ({','.join(row)!r}): every row needs file,label"
            )
        # Stray spaces would make "cat" and "cat " two classes.
        body.append((row[0].strip(), row[1].strip()))
    body = _drop_duplicate_rows(path, body)
    missing = [f for f, _ in body if not (root / f).is_file()]
    if missing and all((root / label).is_file() for _, label in body):
        raise DataError(
            f"{path}: the second column holds the image files ({body[0][1]!r}) and the first the "
            f"labels ({body[0][0]!r}): the columns are swapped; put file first, label second"
        )
    if missing:
        raise DataError(
            f"{len(missing)} file(s) named in {path} do not exist under {root}, e.g. {missing[0]!r}; "
            "fix the CSV or set image_root"
        )
    labels_text = [label for _, label in body]
    if classes is None:
        order = sorted(set(labels_text))
    else:
        unseen = sorted(set(labels_text) - set(classes))
        if unseen:
            raise DataError(
                f"{path} has labels the training data does not: {', '.join(unseen[:10])}"
            )
        order = list(classes)
    files = [root / f for f, _ in body]
    index = {name: i for i, name in enumerate(order)}  # not order.index: rows x classes
    files, labels, skipped = _check_images(files, [index[t] for t in labels_text], bad_images)
    _check_readable_classes(path, files, labels, order, skipped, require_all=classes is None)
    return ImageItems(files, labels, order, skipped)


def _drop_duplicate_rows(path: Path, body: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A file listed twice would land on both sides of the train/validation split (a leak) and
    weigh double: identical rows are kept once; one file with two labels is an error."""
    first: dict[str, tuple[int, str]] = {}
    kept: list[tuple[str, str]] = []
    for i, (f, label) in enumerate(body):
        key = str(Path(f))
        if key in first:
            if first[key][1] != label:
                raise DataError(
                    f"{path} labels {f!r} twice, as {first[key][1]!r} and {label!r}: keep one row"
                )
            continue
        first[key] = (i, label)
        kept.append((f, label))
    if len(kept) < len(body):
        warnings.warn(
            f"{path} lists {len(body) - len(kept)} file(s) more than once; each is used once",
            DuplicateRowsWarning,
            stacklevel=3,
        )
    return kept


def load_items(
    source: str,
    image_root: str = "",
    *,
    classes: Sequence[str] | None = None,
    bad_images: str = "skip",
) -> ImageItems:
    if source.lower().endswith(".csv"):
        return scan_csv(
            source, image_root=image_root or None, classes=classes, bad_images=bad_images
        )
    return scan_folder(source, classes=classes, bad_images=bad_images)


def split_items(items: ImageItems, valid_pct: float, seed: int) -> tuple[ImageItems, ImageItems]:
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


def build_transforms(
    size: int, item_transform: str, *, train: bool, augment: bool, flip: bool = False
) -> Callable[[Any], torch.Tensor]:
    """Item resize (squish or crop), light augmentation when training, tensor + normalise."""
    from torchvision.transforms import v2 as T

    if item_transform == "squish":
        resize: list[Any] = [T.Resize((size, size), antialias=True)]
    else:
        resize = [T.Resize(size, antialias=True), T.CenterCrop(size)]
    steps: list[Any] = [T.ToImage(), *resize]
    if train and augment:
        steps += [
            T.RandomHorizontalFlip(),
            T.RandomResizedCrop(size, scale=(0.75, 1.0), antialias=True),
        ]
    if flip:
        steps.append(T.RandomHorizontalFlip(p=1.0))
    steps += [T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)]
    return T.Compose(steps)


class ImageDataset(Dataset[tuple[torch.Tensor, int]]):
    def __init__(
        self,
        files: Sequence[Path],
        labels: Sequence[int] | None,
        transform: Callable[[Any], torch.Tensor],
    ) -> None:
        self.files = list(files)
        self.labels = list(labels) if labels is not None else [-1] * len(self.files)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image, ImageOps

        with Image.open(self.files[i]) as im:
            # Cameras store the orientation in EXIF: a photo taken upright must train upright.
            image = ImageOps.exif_transpose(im).convert("RGB")
        return self.transform(image), self.labels[i]


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


def class_counts(items: ImageItems) -> dict[str, int]:
    counts = Counter(items.labels)
    return {name: counts.get(i, 0) for i, name in enumerate(items.classes)}
