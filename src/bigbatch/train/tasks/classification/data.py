"""Classification data: class sub-folders or a CSV of ``file,label``, checked before training.

Every file is opened once up front (a few ms each): unreadable images are skipped and counted
(or stop the run, with ``bad_images="error"``), and empty classes, missing files and labels the
training set never saw are errors that name the file, before any long work starts.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bigbatch.train.data import (
    IMAGE_SUFFIXES,
    DataError,
    list_images,
    read_csv_rows,
)
from bigbatch.train.tasks.images import (  # the shared image layer; here for older imports
    DEFAULT_DATA,
    ImageDataset,
    ImageFormat,
    build_transforms,
    check_images,
    format_of,
    parse_window,
    resolve_data_config,
)

__all__ = [
    "DEFAULT_DATA",
    "DuplicateRowsWarning",
    "ImageDataset",
    "ImageFormat",
    "ImageItems",
    "build_transforms",
    "check_images",
    "class_counts",
    "format_of",
    "load_items",
    "parse_window",
    "resolve_data_config",
    "scan_csv",
    "scan_folder",
]


class DuplicateRowsWarning(UserWarning):
    """A CSV listed a file more than once; it is used once."""


@dataclass
class ImageItems:
    """A list of image files with class indices, how they are stored, and what was skipped."""

    files: list[Path]
    labels: list[int]
    classes: list[str]
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    format: ImageFormat = field(default_factory=ImageFormat)

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, index: Sequence[int]) -> ImageItems:
        return ImageItems(
            [self.files[i] for i in index],
            [self.labels[i] for i in index],
            self.classes,
            format=self.format,
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
    files, labels, skipped, fmt = check_images(files, labels, bad_images)
    _check_readable_classes(root, files, labels, order, skipped, require_all=classes is None)
    return ImageItems(files, labels, order, skipped, fmt)


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
    _refuse_numeric_targets(path, labels_text)
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
    files, labels, skipped, fmt = check_images(files, [index[t] for t in labels_text], bad_images)
    _check_readable_classes(path, files, labels, order, skipped, require_all=classes is None)
    return ImageItems(files, labels, order, skipped, fmt)


def _refuse_numeric_targets(path: Path, labels: list[str]) -> None:
    """A label column of fractional numbers is a regression target, not classes: read as
    classes it would silently become one class per distinct value."""
    fractional = []
    for label in labels:
        try:
            value = float(label)
        except ValueError:
            return  # a word: classes
        if not value.is_integer():
            fractional.append(label)
    if fractional:
        distinct = len(set(labels))
        raise DataError(
            f"{path}: the label column holds numbers ({distinct} distinct values, e.g. "
            f"{fractional[0]}), a regression target, not classes: train it with "
            "task=regression (data= the same CSV)"
        )


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


def class_counts(items: ImageItems) -> dict[str, int]:
    counts = Counter(items.labels)
    return {name: counts.get(i, 0) for i, name in enumerate(items.classes)}
