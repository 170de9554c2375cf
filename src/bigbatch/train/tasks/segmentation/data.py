"""Segmentation data: images with masks (2D) and volumes with label maps (3D), every one checked
before training, then MONAI's transforms.

Layouts:

- a folder holding ``images/`` and ``masks/`` whose files pair by name (``a.png`` with
  ``a.png``; ``case1.nii.gz`` or ``case1.npy`` with the same name in ``masks/``);
- a CSV with columns ``image,mask``; for volumes an image cell may list several files separated
  by ``;`` (one per MRI modality: T1, T2, FLAIR ...), stacked as channels.

2D images are PNG/TIFF/JPEG (RGB), masks lossless label maps (PNG, TIFF, BMP): 0/255 or 0/1 for
binary, 0..K-1 for K classes, ``ignore_index`` (255 by default) for void pixels, or colours
mapped through ``palette``. 3D volumes are NIfTI (``.nii``/``.nii.gz``, through nibabel;
``(X, Y, Z)`` or ``(X, Y, Z, C)``, with the header's affine) or ``.npy`` (``(D, H, W)`` or
``(C, D, H, W)``), masks the same formats.

Every pair is read once before training: a missing mask, a mask whose size differs from its
image, mask values outside the classes, a lossy or colour-coded mask, non-finite voxels, mixed
channel counts or dimensions, and unreadable files are errors that name the file.

Volumes then go through MONAI: orientation to RAS and resampling to ``spacing`` (when set),
z-scoring over the foreground (non-zero voxels) of each channel, patches sampled around the
labels (``pos_neg``: the odds of a patch centred on foreground against background), flips, in-plane quarter turns
and intensity scaling and shifting when ``augment``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from bigbatch.images import probe, read_pixels
from bigbatch.models import MEAN, STD
from bigbatch.segmentation.rle import header_problem
from bigbatch.train.data import IMAGE_SUFFIXES, DataError, read_csv_rows

__all__ = [
    "SegDataset",
    "SegItems",
    "Volume",
    "image_input",
    "parse_palette",
    "read_image",
    "read_mask",
    "read_volume",
    "scan_segmentation",
    "standardise",
    "volume_suffix",
]

VOLUME_SUFFIXES = (".nii.gz", ".nii", ".npy")
# Up to this many bytes of images, every voxel is read before training; beyond, the headers.
FULL_CHECK_BYTES = 2 * 2**30
# A mask is a label map: JPEG's compression blurs the edges into values between the labels.
LOSSY_SUFFIXES = (".jpg", ".jpeg")


def volume_suffix(path: Path) -> str:
    """``.nii.gz``, ``.nii``, ``.npy`` or the image suffix ('' when it is none of them)."""
    name = path.name.lower()
    for suffix in VOLUME_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower() if path.suffix.lower() in IMAGE_SUFFIXES else ""


def stem(path: Path) -> str:
    """The name without its (possibly double) suffix: ``case1.nii.gz`` -> ``case1``."""
    suffix = volume_suffix(path)
    return path.name[: -len(suffix)] if suffix else path.stem


@dataclass
class Volume:
    """An array and, for NIfTI, the affine that places its voxels in the world (mm)."""

    array: np.ndarray
    affine: np.ndarray | None = None


def _nibabel() -> Any:
    try:
        import nibabel as nib
    except ImportError as exc:
        raise DataError("NIfTI needs nibabel: pip install 'bigbatch[seg]'") from exc
    return nib


# numpy parses a .npy header with ast.literal_eval, and CPython 3.11 counts the AST
# constructor's recursion in one place for all threads (python/cpython#106905): two threads
# parsing at once (MONAI's CacheDataset fills its cache from a thread pool) can fail with
# "SystemError: AST constructor recursion depth mismatch". Headers are parsed one at a time.
_NPY_HEADER = threading.Lock()


def _npy_mapped(path: Path) -> np.ndarray:
    """A ``.npy`` file mapped, not read: its header parsed (one thread at a time), its voxels
    read when used, by any number of threads at once."""
    with _NPY_HEADER:
        return np.load(path, mmap_mode="r", allow_pickle=False)


def read_volume(path: Path) -> Volume:
    """One file as an array (NIfTI channels moved first) with its affine, if it has one."""
    suffix = volume_suffix(path)
    try:
        if suffix == ".npy":
            return Volume(np.array(_npy_mapped(path)))
        if suffix in (".nii", ".nii.gz"):
            image: Any = _nibabel().load(str(path))
            return Volume(_nifti_channels_first(np.asarray(image.dataobj)), image.affine)
        from PIL import Image

        with Image.open(path) as im:
            return Volume(np.asarray(im))
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


def read_case(files: Sequence[Path], dims: int) -> Volume:
    """One sample as float32 ``(C, *spatial)`` (an RGB image, or volumes stacked as channels)
    with the first file's affine; non-finite values are refused by name."""
    if dims == 2:
        if len(files) > 1:
            raise DataError(
                f"{len(files)} images in one row ({', '.join(f.name for f in files)}): several "
                "files per case are the modalities of a volume; a 2D row has one image"
            )
        try:
            probe(files[0])  # refuses what cannot be read faithfully (16-bit colour PNG)
            # As 0..255 RGB: 16-bit and float images are scaled (2^k - 1 of their own peak: a
            # 12-bit X-ray by 4095), never clipped at 255 as PIL's convert("RGB") would.
            array = read_pixels(files[0]) * 255.0
        except Exception as exc:
            raise DataError(f"cannot read {files[0]}: {type(exc).__name__}: {exc}") from exc
        return Volume(array)
    parts, affine = [], None
    for f in files:
        volume = read_volume(f)
        a = volume.array.astype(np.float32)
        if a.ndim == 3:
            a = a[None]
        if a.ndim != 4:
            raise DataError(
                f"{f} has shape {a.shape}: a volume is (D, H, W), or (C, D, H, W) for channels "
                "((X, Y, Z, C) in NIfTI); 2D images train as images/ of PNGs"
            )
        bad = int((~np.isfinite(a)).sum())
        if bad:
            raise DataError(
                f"{f} holds {bad} NaN or infinite voxel(s): fix or remove the volume (a NaN "
                "spreads through every layer and ends in an empty prediction or a diverged run)"
            )
        parts.append(a)
        affine = affine if affine is not None else volume.affine
    shapes = {p.shape[1:] for p in parts}
    if len(shapes) > 1:
        listed = ", ".join(f"{f.name} {p.shape[1:]}" for f, p in zip(files, parts, strict=True))
        raise DataError(
            f"the modalities of one case differ in shape ({listed}): resample them to one grid"
        )
    return Volume(np.concatenate(parts), affine)


def read_image(files: Sequence[Path], dims: int) -> np.ndarray:
    """One sample as float32 ``(C, *spatial)``: :func:`read_case` without the affine."""
    return read_case(files, dims).array


def parse_palette(text: str) -> list[tuple[int, ...]]:
    """``palette=0,0,0;255,0,0;0,255,0``: the colour of class 0, 1, 2 ... in RGB masks.

    >>> parse_palette("0,0,0; 255,0,0")
    [(0, 0, 0), (255, 0, 0)]
    """
    if not text.strip():
        return []
    colours: list[tuple[int, ...]] = []
    for part in text.replace(" ", "").split(";"):
        try:
            colour = tuple(int(v) for v in part.split(","))
        except ValueError:
            colour = ()
        if len(colour) != 3 or not all(0 <= v <= 255 for v in colour):
            raise DataError(
                f"palette={text!r}: give one R,G,B colour (0-255) per class, separated by ';', "
                "class 0 first, e.g. palette=0,0,0;255,0,0;0,255,0"
            )
        colours.append(colour)
    if len(set(colours)) != len(colours):
        raise DataError(f"palette={text!r} names a colour twice: each class needs its own")
    return colours


def _labels_from_colours(a: np.ndarray, path: Path, palette: list[tuple[int, ...]]) -> np.ndarray:
    rgb = a[..., :3].astype(np.int64)
    if not palette:
        if (rgb == rgb[..., :1]).all():
            return rgb[..., 0]  # a grey label map saved as RGB
        raise DataError(
            f"mask {path} is colour-coded (its red, green and blue differ): give the colour of "
            "each class with palette=R,G,B;R,G,B;... (class 0 first), or save label maps of "
            "class indices"
        )
    codes = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]
    labels = np.full(codes.shape, -1, dtype=np.int64)
    for index, (r, g, b) in enumerate(palette):
        labels[codes == (r << 16 | g << 8 | b)] = index
    if (labels < 0).any():
        code = int(codes[labels < 0][0])
        raise DataError(
            f"mask {path} holds the colour {code >> 16},{code >> 8 & 255},{code & 255}, which "
            "palette= does not list: add it (as a class), or fix the mask"
        )
    return labels


def read_mask(path: Path, dims: int = 2, palette: Sequence[tuple[int, ...]] = ()) -> np.ndarray:
    """A label map as int64 ``(*spatial)`` with its values as stored (RGB masks through
    ``palette``); lossy formats and non-integer values are refused."""
    if path.name.lower().endswith(LOSSY_SUFFIXES):
        raise DataError(
            f"mask {path} is a JPEG: lossy compression blurs the label edges into values between "
            "the classes. Save masks losslessly (PNG)"
        )
    a = read_volume(path).array
    if a.ndim == dims + 1 and volume_suffix(path) in IMAGE_SUFFIXES and a.shape[-1] in (3, 4):
        a = _labels_from_colours(a, path, list(palette))
    elif a.ndim == dims + 1 and a.shape[0] == 1:
        a = a[0]  # (1, *spatial)
    if not np.issubdtype(a.dtype, np.integer) and (
        not np.isfinite(a).all() or not np.all(np.equal(np.mod(a, 1), 0))
    ):
        raise DataError(f"mask {path} holds non-integer values: a mask is a label map")
    return a.astype(np.int64)


@dataclass
class SegItems:
    """Image (one or several modality files) and mask pairs, 2D or 3D, and what their labels
    mean: the class count, the void label and whether 255 stands for the foreground."""

    images: list[tuple[Path, ...]]
    masks: list[Path]
    num_classes: int  # 1: binary (one sigmoid output); K > 1: K softmax outputs
    dims: int
    channels: int
    void: int | None = None  # the label of pixels/voxels that count nowhere
    binary_255: bool = False  # masks of 0/255: 255 is the foreground
    palette: list[tuple[int, ...]] = field(default_factory=list)
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
            self.void,
            self.binary_255,
            self.palette,
        )

    def labels(self, i: int) -> np.ndarray:
        """Mask ``i`` as training uses it: 0/255 as 0/1, void as :attr:`void`."""
        a = read_mask(self.masks[i], self.dims, self.palette)
        return (a > 0).astype(np.int64) if self.binary_255 else a


def _pairs_from_folder(folder: Path) -> list[tuple[tuple[Path, ...], Path]]:
    images_dir, masks_dir = folder / "images", folder / "masks"
    if not images_dir.is_dir() or not masks_dir.is_dir():
        raise DataError(
            f"{folder} needs an images/ and a masks/ folder whose files pair by name (or give "
            "a CSV with image,mask columns)"
        )
    masks: dict[str, Path] = {}
    for p in sorted(masks_dir.iterdir()):
        if volume_suffix(p):
            if stem(p) in masks:
                raise DataError(
                    f"{masks[stem(p)].name} and {p.name} in {masks_dir} are masks for the same "
                    "image: keep one"
                )
            masks[stem(p)] = p
    pairs: list[tuple[tuple[Path, ...], Path]] = []
    for image in sorted(p for p in images_dir.iterdir() if volume_suffix(p)):
        mask = masks.get(stem(image))
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
    rows = read_csv_rows(path)
    header = [h.strip().lower() for h in rows[0]] if rows else []
    if "image" not in header or "mask" not in header:
        raise DataError(
            f"{path}: {header_problem(tuple(h.strip() for h in rows[0]) if rows else ())}; or, "
            "for masks as image files, a header with image,mask columns"
        )
    at_image, at_mask = header.index("image"), header.index("mask")
    pairs = []
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue  # a blank line
        cells = row + [""] * (len(header) - len(row))
        images = tuple(root / p.strip() for p in cells[at_image].split(";") if p.strip())
        mask = cells[at_mask].strip()
        if not images or not mask:
            raise DataError(f"{path}, line {line}: an image and a mask are both needed")
        for p in (*images, root / mask):
            if not p.is_file():
                raise DataError(f"{path}, line {line}: {p} does not exist")
        pairs.append((images, root / mask))
    if not pairs:
        raise DataError(f"{path} lists no image,mask rows")
    return pairs


def _dims_of(path: Path) -> int:
    return 2 if volume_suffix(path) in IMAGE_SUFFIXES else 3


def _pairs_of(data: str | Path, image_root: str) -> tuple[list[Any], int]:
    """Each case's image file(s) and mask, from a folder or a CSV, and their dimensions (one
    run trains 2D images or 3D volumes, not both)."""
    path = Path(data)
    if path.is_dir():
        pairs = _pairs_from_folder(path)
    elif path.suffix.lower() == ".csv" and path.is_file():
        pairs = _pairs_from_csv(path, Path(image_root) if image_root else path.parent)
    else:
        raise DataError(f"data={data}: not a folder with images/ and masks/, nor a CSV")
    dims = _dims_of(pairs[0][0][0])
    for images, _ in pairs:
        if _dims_of(images[0]) != dims:
            raise DataError(
                f"{images[0]} is a {_dims_of(images[0])}D file among {dims}D ones ({pairs[0][0][0]}"
                "): train images and volumes in separate runs"
            )
    return pairs, dims


def scan_segmentation(
    data: str | Path,
    image_root: str = "",
    num_classes: int = 0,
    *,
    ignore_index: int = 255,
    palette: str = "",
    like: SegItems | None = None,
) -> SegItems:
    """Pair and check every image with its mask. ``num_classes`` 0 infers the classes from the
    masks (values 0/1 or 0/255: binary). ``ignore_index`` is the void label (-1: none); masks
    holding only 0 and 255 are binary. ``like``: the training items a validation set must match
    (dimensions, channels, labels)."""
    pairs, dims = _pairs_of(data, image_root)
    if like is not None and (why := _unlike(data, dims, like.channels, like)):
        raise DataError(why)
    colours = parse_palette(palette)
    values: set[int] = set()
    channels = None
    foreground = False
    # Large sets: image shapes from the headers here, each volume's values when it is first
    # read (a NaN then stops training with the file's name); masks are read in full.
    full = dims == 2 or sum(f.stat().st_size for c, _ in pairs for f in c) < FULL_CHECK_BYTES
    for images, mask in pairs:
        shape = read_case(images, dims).array.shape if full else case_shape(images)
        labels = read_mask(mask, dims, colours)
        _check_pair(images, mask, shape, labels)
        if like is not None and (why := _unlike(data, dims, shape[0], like)):
            raise DataError(why)
        if channels is not None and shape[0] != channels:
            raise DataError(
                f"{images[0]} has {shape[0]} channel(s), the others {channels}: every "
                "case needs the same modalities"
            )
        channels = shape[0]
        here = set(np.unique(labels).tolist())
        values |= here
        foreground = foreground or bool(here - {0, ignore_index})
        top = max(here - {ignore_index}, default=0)
        if num_classes and top >= max(num_classes, 2):
            raise DataError(
                f"mask {mask} holds label {top}, outside num_classes={num_classes} "
                f"(labels 0..{max(num_classes, 2) - 1}, and ignore_index={ignore_index} for "
                "void); raise num_classes or fix the mask"
            )
    binary_255 = values <= {0, 255} and 255 in values and not num_classes > 2
    void = None if binary_255 or ignore_index < 0 or ignore_index not in values else ignore_index
    if not foreground and not binary_255:
        raise DataError(
            f"every mask in {data} is background (0){' or void' if void is not None else ''}: "
            "there is nothing to learn. Check that the masks are label maps of this data (a "
            "mask saved as 0/1 in an 8-bit image looks black but is not)"
        )
    top = max(values - {void} if void is not None else values, default=0)
    classes = num_classes or (1 if binary_255 or top <= 1 else top + 1)
    items = SegItems(
        [p[0] for p in pairs],
        [p[1] for p in pairs],
        classes,
        dims,
        channels or 1,
        void,
        binary_255,
        colours,
    )
    if like is not None:  # a validation set keeps the training set's meaning of its labels
        items.num_classes, items.binary_255 = like.num_classes, like.binary_255
        items.void = like.void if items.void is None else items.void
    return items


def _check_pair(
    images: Sequence[Path], mask: Path, shape: tuple[int, ...], labels: np.ndarray
) -> None:
    if labels.shape != tuple(shape[1:]):
        raise DataError(
            f"mask {mask} is {labels.shape} but its image {images[0]} is {tuple(shape[1:])}: "
            "a mask must have its image's size"
        )
    if labels.size and labels.min() < 0:
        raise DataError(f"mask {mask} holds negative values: labels are 0..K-1")


def case_shape(files: Sequence[Path]) -> tuple[int, ...]:
    """A volume case's ``(C, *spatial)`` from its files' headers, without reading the voxels."""
    channels, spatial = 0, None
    for f in files:
        try:
            if volume_suffix(f) == ".npy":
                shape = _npy_mapped(f).shape
            else:
                shape = tuple(_nibabel().load(str(f)).shape)
                if len(shape) == 5 and shape[3] == 1:
                    shape = (*shape[:3], shape[4])
                shape = (shape[3], *shape[:3]) if len(shape) == 4 else shape
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"cannot read {f}: {type(exc).__name__}: {str(exc)[:160]}") from exc
        if len(shape) == 3:
            shape = (1, *shape)
        if len(shape) != 4:
            raise DataError(f"{f} has shape {shape}: a volume is (D, H, W), or (C, D, H, W)")
        if spatial is not None and shape[1:] != spatial:
            raise DataError(
                f"the modalities of one case differ in shape ({files[0].name} {spatial}, "
                f"{f.name} {shape[1:]}): resample them to one grid"
            )
        channels, spatial = channels + shape[0], shape[1:]
    return (channels, *(spatial or ()))


def _unlike(where: str | Path, dims: int, channels: int, train: SegItems) -> str:
    """Why a validation set cannot be scored by the model trained on ``train`` ('' if it can)."""
    if dims != train.dims:
        return (
            f"{where} holds {dims}D data but training is {train.dims}D: give "
            f"{'volumes' if train.dims == 3 else 'images'} like the training data"
        )
    if channels != train.channels:
        return (
            f"{where} has {channels} channel(s) per case, the training data {train.channels}: "
            "give the same modalities in the same order"
        )
    return ""


# ---------------------------------------------------------------------------------- datasets
@dataclass(frozen=True)
class VolumeRecipe:
    """How volumes become network inputs (the same in training, validation and prediction)."""

    size: int  # the patch edge, in voxels
    spacing: tuple[float, ...] = ()  # resample to this voxel size (mm), from the NIfTI header
    pos_neg: float = 1.0  # the odds of a training patch centred on foreground
    multiple: int = 8  # whole volumes are padded to a multiple of this (validation)


def _monai_transforms() -> Any:
    try:
        from monai import transforms
    except ModuleNotFoundError as exc:
        raise DataError(
            "3D segmentation uses MONAI's transforms, which are not installed: "
            "pip install 'bigbatch[seg]'"
        ) from exc
    return transforms


def to_meta(volume: Volume) -> Any:
    """A MONAI MetaTensor carrying the volume's affine (identity for .npy)."""
    from monai.data import MetaTensor

    affine = torch.as_tensor(volume.affine if volume.affine is not None else np.eye(4))
    return MetaTensor(torch.from_numpy(np.ascontiguousarray(volume.array)), affine=affine)


# NIfTI's world axes (left-right, posterior-anterior, inferior-superior), stated rather than
# left to MONAI's changing default.
_RAS_LABELS = (("L", "R"), ("P", "A"), ("I", "S"))


def preprocess(image: Any, label: Any, recipe: VolumeRecipe) -> tuple[Any, Any]:
    """Orientation (RAS) and resampling to ``recipe.spacing`` (labels by nearest neighbour),
    then each channel z-scored over its non-zero voxels (the head, not the air around it)."""
    t = _monai_transforms()
    if recipe.spacing:
        image = t.Spacing(pixdim=recipe.spacing, mode="bilinear")(
            t.Orientation("RAS", labels=_RAS_LABELS)(image)
        )
        if label is not None:
            label = t.Spacing(pixdim=recipe.spacing, mode="nearest")(
                t.Orientation("RAS", labels=_RAS_LABELS)(label)
            )
    image = t.NormalizeIntensity(nonzero=True, channel_wise=True)(image)
    return image, label


class SegDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(image, mask) tensors. 2D: resized to ``size`` x ``size`` (the mask by nearest
    neighbour), ImageNet-normalised, flipped when ``augment``. 3D: :func:`preprocess`, then a
    ``size``^3 patch sampled around the labels with MONAI's augmentation when training, or the
    whole volume padded to the network's multiple when validating. MONAI's random transforms
    are seeded from torch's generator, so a seed (and a resumed run) replays them."""

    def __init__(
        self,
        items: SegItems,
        size: int,
        *,
        train: bool,
        augment: bool,
        recipe: VolumeRecipe | None = None,
    ) -> None:
        self.items, self.size, self.train, self.augment = items, size, train, augment
        self.recipe = recipe or VolumeRecipe(size)
        self._sampler: Any = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.from_prepared(self.prepared(i))

    def prepared(self, i: int) -> tuple[Any, Any]:
        """Case ``i`` read and through the deterministic steps: a 2D image resized and
        normalised; a volume oriented, resampled and z-scored (:func:`preprocess`). What a
        cache keeps (:mod:`bigbatch.train.tasks.segmentation.cache`)."""
        if self.items.dims == 2:
            image = torch.from_numpy(read_image(self.items.images[i], 2))
            mask = torch.from_numpy(self.items.labels(i))
            return self._image_2d(image, mask)
        case = read_case(self.items.images[i], 3)
        label = Volume(self.items.labels(i)[None].astype(np.float32), case.affine)
        return preprocess(to_meta(case), to_meta(label), self.recipe)

    def from_prepared(self, pair: tuple[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sample of a :meth:`prepared` case: in training, its random patch and
        augmentation; in validation, the whole volume padded to the network's multiple."""
        if self.items.dims == 2:
            x, y = pair
            if self.train and self.augment:
                for axis in (1, 2):
                    if torch.rand(()) < 0.5:
                        x, y = x.flip(axis), y.flip(axis - 1)
            return x.contiguous(), y.contiguous()
        image, mask = pair
        if not self.train:
            x, y = _pad_to_multiple(image.as_tensor(), mask.as_tensor(), self.recipe.multiple)
            return x.float(), y[0].long()
        sample = self._sample(image, mask)
        return sample["image"].as_tensor().float(), sample["label"].as_tensor()[0].long()

    def _image_2d(
        self, image: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = (self.size, self.size)
        y = F.interpolate(mask[None, None].float(), size=size, mode="nearest")[0, 0].long()
        return image_input(image, self.size), y

    def _sample(self, image: Any, mask: Any) -> dict[str, Any]:
        t = _monai_transforms()
        if self._sampler is None:
            keys = ["image", "label"]
            size = (self.size,) * 3
            steps = [
                t.SpatialPadd(keys, spatial_size=size),
                t.RandCropByPosNegLabeld(
                    keys,
                    label_key="label",
                    spatial_size=size,
                    pos=self.recipe.pos_neg,
                    neg=1,
                    num_samples=1,
                    allow_smaller=True,
                ),
            ]
            if self.augment:
                steps += [t.RandFlipd(keys, prob=0.5, spatial_axis=axis) for axis in range(3)]
                steps += [
                    t.RandRotate90d(keys, prob=0.5, spatial_axes=(0, 1)),  # in-plane
                    t.RandScaleIntensityd("image", factors=0.1, prob=0.5),
                    t.RandShiftIntensityd("image", offsets=0.1, prob=0.5),
                ]
            self._sampler = t.Compose(steps)
        # MONAI's random state follows torch's generator (seeded per run, saved on resume).
        self._sampler.set_random_state(seed=int(torch.randint(0, 2**31 - 1, ())))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "num_samples" on a small volume
            out = self._sampler({"image": image, "label": mask})
        return out[0] if isinstance(out, list) else out


def _pad_to_multiple(
    image: torch.Tensor, mask: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor]:
    pad: list[int] = []
    for s in reversed(image.shape[1:]):
        pad += [0, -s % multiple]
    return F.pad(image, pad), F.pad(mask, pad)


def image_input(image: torch.Tensor, size: int) -> torch.Tensor:
    """A ``(3, H, W)`` RGB image of 0..255 as the model sees it, in training and prediction
    alike: resized to ``size`` x ``size`` and ImageNet-normalised."""
    x = F.interpolate(image[None] / 255.0, size=(size, size), mode="bilinear", antialias=True)[0]
    return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


def standardise(volume: torch.Tensor) -> torch.Tensor:
    """Each channel of a ``(C, D, H, W)`` volume to mean 0 and standard deviation 1 over its
    non-zero voxels (MONAI's ``NormalizeIntensity(nonzero=True, channel_wise=True)``)."""
    t = _monai_transforms()
    return torch.as_tensor(t.NormalizeIntensity(nonzero=True, channel_wise=True)(volume))
