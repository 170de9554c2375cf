"""Segmentation data as Kaggle ships it: a run-length encoded CSV (either layout of
:mod:`bigbatch.segmentation.rle`) beside a folder of images, at full resolution.

Everything is checked before training, from the CSV and the image headers alone (no pixel is
decoded): every encoding against its image's size, every listed image present (and, for
``Image_Label``, every image listed), and whether two classes share a pixel. Masks are decoded
when a sample is read. Training samples go through albumentations (random crop, flips,
shift-scale-rotate, brightness and contrast), image and masks together; validation sees whole
images.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from bigbatch.images import exif_orientation, probe, read_pixels
from bigbatch.io import CSVError, read_csv_rows
from bigbatch.models import MEAN, STD
from bigbatch.segmentation.rle import (
    RLEError,
    RLETable,
    check_listing,
    parse_mask_size,
    read_rle_csv,
    rle_layout,
    rle_runs,
    runs_overlap,
)
from bigbatch.train.config import ConfigError
from bigbatch.train.data import IMAGE_SUFFIXES, DataError

__all__ = [
    "RLEDataset",
    "RLEItems",
    "is_rle_csv",
    "network_input",
    "parse_size",
    "read_rgb",
    "scan_rle",
    "transforms",
]


def is_rle_csv(path: str | Path) -> bool:
    """Whether ``path`` is a CSV whose header is one of Kaggle's RLE layouts."""
    path = Path(path)
    if path.suffix.lower() != ".csv" or not path.is_file():
        return False
    try:
        rows = read_csv_rows(path, max_rows=1)  # the header tells; the rows are read by the task
    except CSVError:
        return False
    return bool(rows) and bool(rle_layout(tuple(h.strip() for h in rows[0])))


def parse_size(text: str, key: str) -> tuple[int, int] | None:
    """``"350x525"`` -> (350, 525) for the option ``key``; '' -> None.

    >>> parse_size("64x96", "crop")
    (64, 96)
    """
    if not text.strip():
        return None
    try:
        return parse_mask_size(text)
    except RLEError:
        raise ConfigError(f"{key}={text!r} is not HEIGHTxWIDTH: give e.g. {key}=512x512") from None


@dataclass
class RLEItems:
    """The images of an RLE CSV with their sizes, and how their masks are read: ``multilabel``
    (a 0/1 plane per class) or exclusive (a label map, 0 the background, class k as k + 1)."""

    table: RLETable
    images: list[Path]
    shapes: list[tuple[int, int]]  # (height, width) of each image, from its header
    multilabel: bool
    modes: dict[str, int] = field(default_factory=dict)  # PIL mode -> images stored so

    def __len__(self) -> int:
        return len(self.images)

    @property
    def classes(self) -> list[str]:
        return list(self.table.classes)

    @property
    def num_classes(self) -> int:
        """The network's outputs: a sigmoid per class, or a softmax over background + classes."""
        return len(self.table.classes) + (0 if self.multilabel else 1)

    def subset(self, index: Sequence[int]) -> RLEItems:
        return RLEItems(
            self.table,
            [self.images[i] for i in index],
            [self.shapes[i] for i in index],
            self.multilabel,
            self.modes,  # the whole set's: what the data holds
        )

    def masks(self, i: int) -> np.ndarray:
        """Image ``i``'s (classes, height, width) boolean masks, decoded now."""
        return self.table.decode(self.images[i].name, self.shapes[i])


def scan_rle(data: str | Path, image_root: str = "", labels: str = "auto") -> RLEItems:
    """Read and check an RLE CSV and its images (``image_root``: their folder; default the
    CSV's), and decide how the masks are read (``labels``: auto, multilabel or exclusive);
    DataError with the row and the fix for anything wrong, before any training."""
    data = Path(data)
    root = Path(image_root) if image_root else data.parent
    try:
        table = read_rle_csv(data)
        files = check_listing(table, root, data.name)
    except RLEError as exc:
        raise DataError(str(exc)) from None
    if table.layout == "image_class":  # images without a row have empty masks there
        listed = {f.name for f in files}
        files += sorted(
            p
            for p in root.iterdir()
            if p.suffix.lower() in IMAGE_SUFFIXES
            and p.name not in listed
            and not p.name.startswith(".")
        )
    shapes, overlapping = [], ""
    modes: dict[str, int] = {}
    for path in files:
        try:
            probe(path)  # readable faithfully (a 16-bit colour PNG is refused)
            from PIL import Image

            with Image.open(path) as im:
                width, height = im.size
                turn = exif_orientation(im)
                modes[im.mode] = modes.get(im.mode, 0) + 1
        except Exception as exc:
            raise DataError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
        refuse_exif_orientation(path, turn)
        shape = (height, width)
        shapes.append(shape)
        own = table.masks.get(path.name, {})
        try:
            runs = [
                rle_runs(own.get(c, ""), shape, f"{data.name}: {path.name} {c}")
                for c in table.classes
            ]
        except RLEError as exc:
            raise DataError(str(exc)) from None
        if not overlapping and runs_overlap(runs):
            overlapping = path.name
    if labels == "exclusive" and overlapping:
        raise DataError(
            f"{overlapping}: two classes share pixels, so one label per pixel cannot hold both; "
            "use labels=multilabel (a sigmoid per class), or labels=auto"
        )
    multilabel = labels == "multilabel" or (labels == "auto" and bool(overlapping))
    return RLEItems(table, files, shapes, multilabel, modes)


def conversion_note(modes: dict[str, int]) -> str:
    """What reading the images as RGB did to those stored otherwise, in words ('' for none).

    >>> conversion_note({"RGB": 8, "L": 2, "RGBA": 1})
    '2 greyscale image(s) read as RGB (the grey repeated); 1 with transparency read as RGB (the alpha dropped)'
    """
    grey = sum(n for m, n in modes.items() if m in ("1", "L", "I;16", "I;16B", "I;16L", "I", "F"))
    alpha = sum(n for m, n in modes.items() if m in ("RGBA", "LA", "PA", "La", "RGBa"))
    parts = []
    if grey:
        parts.append(f"{grey} greyscale image(s) read as RGB (the grey repeated)")
    if alpha:
        parts.append(f"{alpha} with transparency read as RGB (the alpha dropped)")
    return "; ".join(parts)


def _albumentations() -> Any:
    # albumentations asks PyPI for a newer version when imported unless told not to: a training
    # run makes no network call it was not asked for (loader workers inherit the setting).
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    try:
        import albumentations
    except ModuleNotFoundError as exc:
        raise DataError(
            "RLE segmentation data is augmented with albumentations, which is not installed: "
            "pip install 'bigbatch[seg]'"
        ) from exc
    return albumentations


def transforms(
    train: bool, augment: bool, image_size: tuple[int, int] | None, crop: tuple[int, int] | None
) -> Any:
    """The albumentations pipeline of an image and its masks: the resize to ``image_size``
    (masks by nearest neighbour), then, in training, the random ``crop`` and, with
    ``augment``, flips, shift-scale-rotate and brightness/contrast."""
    a = _albumentations()
    steps: list[Any] = []
    if image_size:
        steps.append(a.Resize(*image_size))
    if train and crop:
        steps.append(a.RandomCrop(*crop))
    if train and augment:
        steps += [
            a.HorizontalFlip(p=0.5),
            a.VerticalFlip(p=0.5),
            a.Affine(
                scale=(0.9, 1.1), translate_percent=(-0.0625, 0.0625), rotate=(-15, 15), p=0.5
            ),
            a.RandomBrightnessContrast(brightness_limit=0.2, contrast_limit=0.2, p=0.5),
        ]
    return a.Compose(steps, seed=None)


def network_input(pixels: np.ndarray) -> torch.Tensor:
    """An ``(H, W, 3)`` image in [0, 1], after its transforms, as the network takes it:
    ``(3, H, W)`` float32, ImageNet-normalised (training, validation and prediction alike)."""
    image = torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))).float()
    return (image - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


def refuse_exif_orientation(path: Path, turn: int) -> None:
    """An RLE image must be used as stored: its runs count pixels in the stored order, and a
    viewer's EXIF rotation (``turn``: :func:`bigbatch.images.exif_orientation`) would put
    them elsewhere (or swap height and width)."""
    if turn != 1:
        raise DataError(
            f"{path} carries an EXIF orientation ({turn}: shown rotated or flipped), so its "
            "RLE runs and the picture viewers show would disagree: save it without the tag "
            "(PIL: Image.open(p).save(p, exif=b'') keeps the stored pixels, as the runs do)"
        )


def read_rgb(path: Path) -> np.ndarray:
    """An image as ``(H, W, 3)`` float32 in [0, 1], as albumentations expects float images (a
    16-bit image scaled, not clipped)."""
    return read_pixels(path).transpose(1, 2, 0)


class RLEDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(image, masks) tensors: the image ``(3, H, W)`` ImageNet-normalised; the masks
    ``(classes, H, W)`` uint8 0/1 (multilabel) or an ``(H, W)`` int64 label map (exclusive).
    Random transforms are seeded from torch's generator, so a seed replays them."""

    def __init__(
        self,
        items: RLEItems,
        *,
        train: bool,
        augment: bool,
        image_size: tuple[int, int] | None = None,
        crop: tuple[int, int] | None = None,
    ) -> None:
        self.items, self.train = items, train
        self.pipeline = transforms(train, augment, image_size, crop)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The masks as one (H, W, classes) array, transformed with the image.
        masks = self.items.masks(i).transpose(1, 2, 0).astype(np.uint8)
        if self.train:
            self.pipeline.set_random_seed(int(torch.randint(0, 2**31 - 1, ())))
        out = self.pipeline(image=read_rgb(self.items.images[i]), mask=masks)
        x = network_input(out["image"])
        planes = torch.from_numpy(np.ascontiguousarray(out["mask"].transpose(2, 0, 1)))
        if self.items.multilabel:
            return x, planes
        # Exclusive classes: the label of each pixel (0: none of them).
        labels = (planes.long() * torch.arange(1, len(planes) + 1).view(-1, 1, 1)).amax(0)
        return x, labels
