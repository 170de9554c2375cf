"""Segmentation data: images with masks (2D) and volumes with label maps (3D), checked up front.

Layouts:

- a folder holding ``images/`` and ``masks/`` whose files pair by name (``a.png`` with
  ``a.png``; ``case1.nii.gz`` or ``case1.npy`` with the same name in ``masks/``);
- a CSV with columns ``image,mask``; an image cell may list several files separated by ``;``
  (one per MRI modality: T1, T2, FLAIR ...), stacked as channels.

2D images are PNG/JPEG (RGB), masks PNG label maps (0/255 or 0/1 for binary, 0..K-1 for K
classes). 3D volumes are NIfTI (``.nii``/``.nii.gz``, through nibabel; ``(X, Y, Z)``, or
``(X, Y, Z, C)`` for several modalities, as the NIfTI standard and the Medical Segmentation
Decathlon store them) or ``.npy`` (``(D, H, W)``, or ``(C, D, H, W)``), masks the same formats.

Every pair is read once before training: a missing mask, a mask whose size differs from its
image, mask values outside the classes, modalities of different shapes and unreadable files are
errors that name the file.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from bigbatch.models import MEAN, STD
from bigbatch.train.data import IMAGE_SUFFIXES, DataError

__all__ = [
    "SegDataset",
    "SegItems",
    "image_input",
    "read_image",
    "read_mask",
    "scan_segmentation",
    "standardise",
    "volume_suffix",
]

VOLUME_SUFFIXES = (".nii.gz", ".nii", ".npy")


def volume_suffix(path: Path) -> str:
    """``.nii.gz``, ``.nii``, ``.npy`` or the image suffix ('' when it is none of them)."""
    name = path.name.lower()
    for suffix in VOLUME_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower() if path.suffix.lower() in IMAGE_SUFFIXES else ""


def _stem(path: Path) -> str:
    suffix = volume_suffix(path)
    return path.name[: -len(suffix)] if suffix else path.stem


def _read_array(path: Path) -> np.ndarray:
    suffix = volume_suffix(path)
    try:
        if suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if suffix in (".nii", ".nii.gz"):
            try:
                import nibabel as nib
            except ImportError as exc:
                raise DataError(
                    f"{path} is NIfTI, which needs nibabel: pip install 'bigbatch[seg]'"
                ) from exc
            volume: Any = nib.load(str(path))
            return _nifti_channels_first(np.asarray(volume.dataobj))
        from PIL import Image

        with Image.open(path) as im:
            return np.asarray(im)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"cannot read {path}: {type(exc).__name__}: {str(exc)[:160]}") from exc


def _nifti_channels_first(a: np.ndarray) -> np.ndarray:
    """NIfTI keeps modalities (or time) in its 4th dimension, after the 3 spatial ones; ITK
    writes a vector image as 5D with a time dimension of 1. Both become ``(C, X, Y, Z)``."""
    if a.ndim == 5 and a.shape[3] == 1:
        a = a[:, :, :, 0]
    return np.moveaxis(a, -1, 0) if a.ndim == 4 else a


def read_image(files: Sequence[Path], dims: int) -> np.ndarray:
    """One sample as float32 ``(C, *spatial)``: an RGB image, or volumes stacked as channels."""
    if dims == 2:
        from PIL import Image

        try:
            with Image.open(files[0]) as im:
                return np.asarray(im.convert("RGB"), dtype=np.float32).transpose(2, 0, 1)
        except Exception as exc:
            raise DataError(f"cannot read {files[0]}: {type(exc).__name__}: {exc}") from exc
    parts = []
    for f in files:
        a = _read_array(f).astype(np.float32)
        if a.ndim == 3:
            a = a[None]
        if a.ndim != 4:
            raise DataError(
                f"{f} has shape {a.shape}: a volume is (D, H, W), or (C, D, H, W) for channels "
                "((X, Y, Z, C) in NIfTI)"
            )
        parts.append(a)
    shapes = {p.shape[1:] for p in parts}
    if len(shapes) > 1:
        listed = ", ".join(f"{f.name} {p.shape[1:]}" for f, p in zip(files, parts, strict=True))
        raise DataError(
            f"the modalities of one case differ in shape ({listed}): resample them to one grid"
        )
    return np.concatenate(parts)


def read_mask(path: Path) -> np.ndarray:
    """A label map as int64 ``(*spatial)``; a binary PNG saved as 0/255 becomes 0/1."""
    a = _read_array(path)
    if a.ndim == 3 and volume_suffix(path) in IMAGE_SUFFIXES:
        a = a[..., 0]  # an RGB(A) PNG label map: one channel holds the label
    if not np.issubdtype(a.dtype, np.integer) and not np.all(np.equal(np.mod(a, 1), 0)):
        raise DataError(f"mask {path} holds non-integer values: a mask is a label map")
    a = a.astype(np.int64)
    values = np.unique(a)
    if set(values.tolist()) <= {0, 255}:
        a = (a > 0).astype(np.int64)
    return a


@dataclass
class SegItems:
    """Image (one or several modality files) and mask pairs, 2D or 3D, with the class count."""

    images: list[tuple[Path, ...]]
    masks: list[Path]
    num_classes: int  # 1: binary (one sigmoid output); K > 1: K softmax outputs
    dims: int
    channels: int
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def classes(self) -> list[str]:
        return (
            ["foreground"] if self.num_classes == 1 else [str(i) for i in range(self.num_classes)]
        )

    def subset(self, index: Sequence[int]) -> SegItems:
        return SegItems(
            [self.images[i] for i in index],
            [self.masks[i] for i in index],
            self.num_classes,
            self.dims,
            self.channels,
        )


def _pairs_from_folder(folder: Path) -> list[tuple[tuple[Path, ...], Path]]:
    images_dir, masks_dir = folder / "images", folder / "masks"
    if not images_dir.is_dir() or not masks_dir.is_dir():
        raise DataError(
            f"{folder} needs an images/ and a masks/ folder whose files pair by name (or give "
            "a CSV with image,mask columns)"
        )
    masks = {_stem(p): p for p in sorted(masks_dir.iterdir()) if volume_suffix(p)}
    pairs: list[tuple[tuple[Path, ...], Path]] = []
    for image in sorted(p for p in images_dir.iterdir() if volume_suffix(p)):
        mask = masks.get(_stem(image))
        if mask is None:
            raise DataError(
                f"{image} has no mask: expected {masks_dir / image.name} (a mask with the same "
                "name); add it, or remove the image"
            )
        pairs.append(((image,), mask))
    if not pairs:
        raise DataError(f"{images_dir} holds no images or volumes")
    return pairs


def _pairs_from_csv(path: Path, root: Path) -> list[tuple[tuple[Path, ...], Path]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"image", "mask"} <= set(rows[0]):
        raise DataError(f"{path} needs a header with image,mask columns")
    pairs = []
    for line, row in enumerate(rows, start=2):
        images = tuple(root / p.strip() for p in (row["image"] or "").split(";") if p.strip())
        mask = (row["mask"] or "").strip()
        if not images or not mask:
            raise DataError(f"{path}, line {line}: an image and a mask are both needed")
        for p in (*images, root / mask):
            if not p.is_file():
                raise DataError(f"{path}, line {line}: {p} does not exist")
        pairs.append((images, root / mask))
    return pairs


def scan_segmentation(data: str | Path, image_root: str = "", num_classes: int = 0) -> SegItems:
    """Pair and check every image with its mask; ``num_classes`` 0 infers it from the masks
    (values 0/1 or 0/255: binary)."""
    path = Path(data)
    if path.is_dir():
        pairs = _pairs_from_folder(path)
    elif path.suffix.lower() == ".csv" and path.is_file():
        pairs = _pairs_from_csv(path, Path(image_root) if image_root else path.parent)
    else:
        raise DataError(f"data={data}: not a folder with images/ and masks/, nor a CSV")
    first = pairs[0][0][0]
    dims = 2 if volume_suffix(first) in IMAGE_SUFFIXES else 3
    top = 0
    channels = None
    for images, mask in pairs:
        image = read_image(images, dims)
        labels = read_mask(mask)
        if labels.shape != image.shape[1:]:
            raise DataError(
                f"mask {mask} is {labels.shape} but its image {images[0]} is {image.shape[1:]}: "
                "a mask must have its image's size"
            )
        if labels.min() < 0:
            raise DataError(f"mask {mask} holds negative values: labels are 0..K-1")
        if channels is not None and image.shape[0] != channels:
            raise DataError(
                f"{images[0]} has {image.shape[0]} channel(s), the others {channels}: every "
                "case needs the same modalities"
            )
        channels = image.shape[0]
        top = max(top, int(labels.max()))
        if num_classes and top >= max(num_classes, 2):
            raise DataError(
                f"mask {mask} holds label {top}, outside num_classes={num_classes} "
                f"(labels 0..{max(num_classes, 2) - 1}); raise num_classes or fix the mask"
            )
    classes = num_classes or (1 if top <= 1 else top + 1)
    return SegItems([p[0] for p in pairs], [p[1] for p in pairs], classes, dims, channels or 1)


class SegDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(image, mask) tensors. 2D: resized to ``size`` x ``size`` (the mask by nearest
    neighbour), ImageNet-normalised. 3D: each channel z-scored, then a ``size``^3 patch (random
    when training, central otherwise; padded when the volume is smaller). Flips, when
    ``augment``, move image and mask together."""

    def __init__(self, items: SegItems, size: int, *, train: bool, augment: bool) -> None:
        self.items, self.size, self.train, self.augment = items, size, train, augment

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = torch.from_numpy(read_image(self.items.images[i], self.items.dims))
        mask = torch.from_numpy(read_mask(self.items.masks[i]))
        if self.items.dims == 2:
            x, y = self._image_2d(image, mask)
        else:
            x, y = self._volume(image, mask)
        if self.train and self.augment:
            for axis in range(1, x.dim()):
                if torch.rand(()) < 0.5:
                    x, y = x.flip(axis), y.flip(axis - 1)
        return x.contiguous(), y.contiguous()

    def _image_2d(
        self, image: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = (self.size, self.size)
        y = F.interpolate(mask[None, None].float(), size=size, mode="nearest")[0, 0].long()
        return image_input(image, self.size), y

    def _volume(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        image = standardise(image)
        pad: list[int] = []
        for s in reversed(image.shape[1:]):
            extra = max(0, self.size - s)
            pad += [extra // 2, extra - extra // 2]
        if any(pad):
            image = F.pad(image, pad)
            mask = F.pad(mask, pad)
        starts = []
        for s in image.shape[1:]:
            room = s - self.size
            starts.append(int(torch.randint(0, room + 1, ())) if self.train else room // 2)
        crop = tuple(slice(a, a + self.size) for a in starts)
        return image[(slice(None), *crop)], mask[crop]


def image_input(image: torch.Tensor, size: int) -> torch.Tensor:
    """A ``(3, H, W)`` RGB image of 0..255 as the model sees it, in training and prediction
    alike: resized to ``size`` x ``size`` and ImageNet-normalised."""
    x = F.interpolate(image[None] / 255.0, size=(size, size), mode="bilinear", antialias=True)[0]
    return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


def standardise(volume: torch.Tensor) -> torch.Tensor:
    """Each channel of a ``(C, D, H, W)`` volume to mean 0 and standard deviation 1."""
    flat = volume.flatten(1)
    shape = (-1, *[1] * (volume.dim() - 1))
    return (volume - flat.mean(1).view(shape)) / flat.std(1).clamp(min=1e-6).view(shape)
