"""Classification data: class sub-folders or a CSV of ``file,label``, checked before training.

Every file is opened once up front (a few ms each): unreadable images are skipped and counted
(or stop the run, with ``bad_images="error"``), and empty classes, missing files and labels the
training set never saw are errors that name the file, before any long work starts.
"""

from __future__ import annotations

import random
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from bigbatch.images import ImageInfo, UnreadableImageError, probe, read_pixels, scale_for
from bigbatch.models import MEAN, STD
from bigbatch.train.data import (
    IMAGE_SUFFIXES,
    DataError,
    list_images,
    read_csv_rows,
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


@dataclass(frozen=True)
class ImageFormat:
    """How a set's images become tensors, the same in training and prediction (saved in the
    run): 1 channel when every image is greyscale, else 3; ``wide`` images (16-bit, float,
    DICOM) read as floats (:func:`bigbatch.images.read_pixels`) and divided by ``scale``,
    DICOM through ``window``; 8-bit ones through PIL and timm's transforms."""

    grey: bool = False
    wide: bool = False
    scale: float = 0.0
    window: tuple[float, float] | None = None

    @property
    def channels(self) -> int:
        return 1 if self.grey else 3

    def to_dict(self) -> dict[str, Any]:
        return {"grey": self.grey, "wide": self.wide, "scale": self.scale, "window": self.window}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ImageFormat:
        """A run's saved format (runs from before it was saved: 8-bit RGB)."""
        if not d:
            return cls()
        window = d.get("window")
        centre_width = (float(window[0]), float(window[1])) if window else None
        return cls(bool(d["grey"]), bool(d["wide"]), float(d["scale"]), centre_width)


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


def _check_images(
    files: list[Path], labels: list[int], bad_images: str
) -> tuple[list[Path], list[int], list[tuple[Path, str]], ImageFormat]:
    keep_f, keep_l, skipped, infos = [], [], [], []
    for f, label in zip(files, labels, strict=True):
        try:
            infos.append(probe(f))
        except ModuleNotFoundError:
            raise  # a missing library (Pillow, pydicom), not a bad image: named by the CLI
        except Exception as exc:
            problem = (
                str(exc)
                if isinstance(exc, UnreadableImageError)
                else f"{type(exc).__name__}: {exc}"
            )
            if bad_images == "error":
                raise DataError(
                    f"cannot read image {f}: {problem}; remove it, or set bad_images=skip"
                ) from None
            skipped.append((f, problem))
            continue
        keep_f.append(f)
        keep_l.append(label)
    return keep_f, keep_l, skipped, format_of(infos)


def parse_window(text: str) -> tuple[float, float] | None:
    """``window=40,400``: a DICOM window's centre and width (here CT soft tissue, in HU).

    >>> parse_window("40,400"), parse_window("")
    ((40.0, 400.0), None)
    """
    if not text.strip():
        return None
    try:
        centre, width = (float(v) for v in text.split(","))
    except ValueError:
        centre, width = 0.0, 0.0
    if not width > 0:
        raise DataError(f"window={text!r}: give a centre and a width > 0, e.g. window=40,400")
    return centre, width


def format_of(infos: Sequence[ImageInfo], window: tuple[float, float] | None = None) -> ImageFormat:
    """The format a set of images trains in: greyscale only if all are; wide (read as floats)
    if any is; the scale from the widest value of the wide ones."""
    wide = [i for i in infos if i.depth != "8bit"]
    peaks = [i.peak for i in wide if i.depth == "high"]
    return ImageFormat(
        grey=bool(infos) and all(i.grey for i in infos),
        wide=bool(wide),
        scale=scale_for(max(peaks)) if peaks else 0.0,
        window=window,
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
    files, labels, skipped, fmt = _check_images(files, labels, bad_images)
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
    files, labels, skipped, fmt = _check_images(files, [index[t] for t in labels_text], bad_images)
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


DEFAULT_DATA: dict[str, Any] = {
    "mean": MEAN,
    "std": STD,
    "interpolation": "bilinear",
    "crop_pct": 0.875,
}


def resolve_data_config(factory: Callable[[], Any], channels: int = 3) -> dict[str, Any]:
    """The model's own input normalisation, interpolation and crop (timm's
    ``resolve_model_data_config``: ViT augreg's 0.5/0.5, CLIP's, inception's ...), built on the
    meta device (no weights, no memory); a model without timm's ``pretrained_cfg`` gets
    ImageNet's. For 1-channel data the means of the three channels' statistics."""
    from timm.data import resolve_model_data_config

    with torch.device("meta"):
        model = factory()
    if getattr(model, "pretrained_cfg", None) is None:
        resolved = dict(DEFAULT_DATA)
    else:
        resolved = resolve_model_data_config(model)
    mean, std = tuple(resolved["mean"]), tuple(resolved["std"])
    if channels == 1 and len(mean) == 3:
        mean, std = (sum(mean) / 3,), (sum(std) / 3,)
    return {
        "mean": [float(m) for m in mean],
        "std": [float(s) for s in std],
        "interpolation": str(resolved.get("interpolation", "bilinear")),
        "crop_pct": float(resolved.get("crop_pct") or 0.875),
    }


def build_transforms(
    size: int,
    item_transform: str,
    *,
    train: bool,
    augment: bool,
    flip: bool = False,
    data: dict[str, Any] | None = None,
    fmt: ImageFormat | None = None,
    auto_augment: str = "",
) -> Callable[[Any], torch.Tensor]:
    """The item transform: timm's ``create_transform`` for 8-bit images (resize by
    ``item_transform``: squish or centre crop; when training, a random resized crop of 75-100 %
    of the image, a horizontal flip and ``auto_augment``, e.g. ``rand-m9-mstd0.5``), the same
    geometry on float tensors for wide images (16-bit, float, DICOM); both normalised with the
    model's ``data`` config. ``flip`` adds a certain horizontal flip (a TTA pass)."""
    data = data or DEFAULT_DATA
    fmt = fmt or ImageFormat()
    if fmt.wide:
        return _tensor_transforms(size, item_transform, train and augment, flip, data)
    from timm.data import create_transform
    from torchvision.transforms import v2 as T

    channels = fmt.channels
    common: dict[str, Any] = {
        "input_size": (channels, size, size),
        "interpolation": data["interpolation"],
        "mean": tuple(data["mean"]),
        "std": tuple(data["std"]),
    }
    if train and augment:
        out = create_transform(
            **common,
            is_training=True,
            scale=(0.75, 1.0),
            color_jitter=0.0,
            auto_augment=auto_augment or None,
        )
    else:
        out = create_transform(
            **common,
            is_training=False,
            crop_pct=1.0 if item_transform == "squish" else data["crop_pct"],
            crop_mode="squash" if item_transform == "squish" else "center",
        )
    return T.Compose([T.RandomHorizontalFlip(p=1.0), out]) if flip else out


def _tensor_transforms(
    size: int, item_transform: str, augment: bool, flip: bool, data: dict[str, Any]
) -> Callable[[Any], torch.Tensor]:
    from torchvision.transforms import v2 as T

    mode = (
        T.InterpolationMode.BICUBIC
        if data["interpolation"] == "bicubic"
        else T.InterpolationMode.BILINEAR
    )
    if augment:
        steps: list[Any] = [
            T.RandomResizedCrop(size, scale=(0.75, 1.0), interpolation=mode, antialias=True),
            T.RandomHorizontalFlip(),
        ]
    elif item_transform == "squish":
        steps = [T.Resize((size, size), interpolation=mode, antialias=True)]
    else:
        steps = [
            T.Resize(int(size / data["crop_pct"]), interpolation=mode, antialias=True),
            T.CenterCrop(size),
        ]
    if flip:
        steps.append(T.RandomHorizontalFlip(p=1.0))
    steps.append(T.Normalize(data["mean"], data["std"]))
    return T.Compose(steps)


class ImageDataset(Dataset[tuple[torch.Tensor, int]]):
    """(image tensor, label): 8-bit images through PIL (greyscale or RGB by ``fmt``), wide
    ones read as floats in [0, 1] (:func:`bigbatch.images.read_pixels`), then ``transform``."""

    def __init__(
        self,
        files: Sequence[Path],
        labels: Sequence[int] | None,
        transform: Callable[[Any], torch.Tensor],
        fmt: ImageFormat | None = None,
    ) -> None:
        self.files = list(files)
        self.labels = list(labels) if labels is not None else [-1] * len(self.files)
        self.transform = transform
        self.fmt = fmt or ImageFormat()

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        fmt = self.fmt
        if fmt.wide:
            pixels = read_pixels(self.files[i], scale=fmt.scale, grey=fmt.grey, window=fmt.window)
            return self.transform(torch.from_numpy(pixels)), self.labels[i]
        from PIL import Image, ImageOps

        with Image.open(self.files[i]) as im:
            # Cameras store the orientation in EXIF: a photo taken upright must train upright.
            image = ImageOps.exif_transpose(im).convert("L" if fmt.grey else "RGB")
        # timm's PIL transforms draw from Python's `random`: seeded from torch's generator, so
        # a seed (and a resumed run, which restores torch's state) replays the augmentation.
        random.seed(int(torch.randint(0, 2**31 - 1, ())))
        return self.transform(image), self.labels[i]


def class_counts(items: ImageItems) -> dict[str, int]:
    counts = Counter(items.labels)
    return {name: counts.get(i, 0) for i, name in enumerate(items.classes)}
