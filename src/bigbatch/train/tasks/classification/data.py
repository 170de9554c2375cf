"""Classification data: class sub-folders or a CSV of ``file,label``, checked before training.

Every file is opened once up front (a few ms each): unreadable images are skipped and counted
(or stop the run, with ``bad_images="error"``), and empty classes, missing files and labels the
training set never saw are errors that name the file, before any long work starts.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from bigbatch.models import MEAN, STD
from bigbatch.train.data import (
    IMAGE_SUFFIXES,
    DataError,
    list_images,
    read_csv_rows,
    unreadable_reason,
)

__all__ = [
    "DuplicateRowsWarning",
    "ImageDataset",
    "ImageItems",
    "build_transforms",
    "class_counts",
    "load_items",
    "scan_csv",
    "scan_folder",
]


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


def _check_images(
    files: list[Path], labels: list[int], bad_images: str
) -> tuple[list[Path], list[int], list[tuple[Path, str]]]:
    keep_f, keep_l, skipped = [], [], []
    for f, label in zip(files, labels, strict=True):
        problem = unreadable_reason(f)
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
    rows = read_csv_rows(path)
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


def class_counts(items: ImageItems) -> dict[str, int]:
    counts = Counter(items.labels)
    return {name: counts.get(i, 0) for i, name in enumerate(items.classes)}
