"""Small synthetic segmentation sets, generated (never downloaded): 2D shapes, 3D blobs and a
BraTS-shaped set of four-modality NIfTI volumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bigbatch.io import atomic_path

__all__ = [
    "BRATS_REGIONS",
    "CLOUD_CLASSES",
    "write_blobs_3d",
    "write_brats_like",
    "write_clouds_like",
    "write_shapes_2d",
]


def write_shapes_2d(folder: str | Path, n: int = 64, size: int = 64, seed: int = 0) -> Path:
    """``folder/images/*.png`` (noisy RGB) and ``folder/masks/*.png`` (0 background, 1 disc,
    2 square): a 3-class 2D set. Existing files are kept, so a rerun writes nothing.

    >>> import tempfile; d = write_shapes_2d(tempfile.mkdtemp(), n=2, size=16)
    >>> sorted(p.name for p in (d / "masks").iterdir())
    ['shape_000.png', 'shape_001.png']
    """
    from PIL import Image

    root = Path(folder)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    for i in range(n):
        mask = np.zeros((size, size), dtype=np.uint8)
        for label in (1, 2):
            r = rng.integers(size // 8, size // 4)
            cy, cx = rng.integers(r, size - r, 2)
            if label == 1:
                mask[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = 1
            else:
                mask[max(0, cy - r) : cy + r, max(0, cx - r) : cx + r] = 2
        colours = np.array([[40, 40, 40], [200, 60, 60], [60, 60, 200]], dtype=np.float32)
        image = colours[mask] + rng.normal(0, 25, (size, size, 3))
        image = np.clip(image, 0, 255).astype(np.uint8)
        for sub, array in (("images", image), ("masks", mask)):
            path = root / sub / f"shape_{i:03d}.png"
            if not path.exists():
                with atomic_path(path) as tmp:
                    Image.fromarray(array).save(tmp, format="PNG")
    return root


def write_blobs_3d(
    folder: str | Path, n: int = 8, size: int = 32, channels: int = 2, seed: int = 0
) -> Path:
    """``folder/images/*.npy`` (``channels`` modalities, ``(C, D, H, W)``) and
    ``folder/masks/*.npy`` (a binary blob label map): a small 3D set, like MRI with a lesion."""
    root = Path(folder)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    zz, yy, xx = np.mgrid[:size, :size, :size]
    for i in range(n):
        r = rng.integers(size // 6, size // 3)
        c = rng.integers(r, size - r, 3)
        mask = ((zz - c[0]) ** 2 + (yy - c[1]) ** 2 + (xx - c[2]) ** 2 <= r * r).astype(np.int64)
        image = np.stack(
            [mask * (1.0 + k) + rng.normal(0, 0.5, mask.shape) for k in range(channels)]
        ).astype(np.float32)
        for sub, array in (("images", image), ("masks", mask)):
            path = root / sub / f"case_{i:03d}.npy"
            if not path.exists():
                with atomic_path(path) as tmp, open(tmp, "wb") as f:
                    np.save(f, array)
    return root


BRATS_MODALITIES = ("t1", "t1ce", "t2", "flair")
BRATS_REGIONS = "wt:1,2,3;tc:1,3;et:3"  # whole tumour, tumour core, enhancing tumour


def write_brats_like(
    folder: str | Path,
    n: int = 12,
    shape: tuple[int, int, int] = (40, 40, 20),
    spacing: tuple[float, float, float] = (1.0, 1.0, 2.0),
    seed: int = 0,
) -> Path:
    """A BraTS-shaped set, generated: ``folder/cases/<case>/<case>_{t1,t1ce,t2,flair}.nii.gz``
    (four MRI modalities, anisotropic voxels of ``spacing`` mm), ``<case>_seg.nii.gz`` with
    BraTS 2023's nested labels (1 necrotic core, 2 oedema around it, 3 enhancing rim), and
    ``folder/cases.csv`` of ``image,mask`` rows listing each case's modalities. Each modality
    shows the regions as in real scans: FLAIR and T2 bright in oedema, T1ce bright in the
    enhancing rim, T1 dark in the core; zero outside an ellipsoidal head. Returns the CSV.

    >>> import tempfile; csv = write_brats_like(tempfile.mkdtemp(), n=1, shape=(16, 16, 8))
    >>> csv.read_text().splitlines()[0]
    'image,mask'
    """
    import nibabel as nib

    root = Path(folder)
    rng = np.random.default_rng(seed)
    affine = np.diag([*spacing, 1.0])
    # World coordinates (mm), so that the structures are round in space, not in voxels.
    xx, yy, zz = (np.mgrid[: shape[0], : shape[1], : shape[2]].astype(np.float32).T * spacing).T
    extent = np.array(shape) * np.array(spacing)
    head = (
        sum(((g - e / 2) / (0.45 * e)) ** 2 for g, e in zip((xx, yy, zz), extent, strict=True)) <= 1
    )
    contrast = {  # background, core, oedema, enhancing, healthy tissue
        "t1": (0.0, 0.3, 0.8, 0.9, 1.0),
        "t1ce": (0.0, 0.3, 0.9, 2.0, 1.0),
        "t2": (0.0, 1.6, 1.8, 1.2, 1.0),
        "flair": (0.0, 1.0, 2.0, 1.3, 1.0),
    }
    rows = ["image,mask"]
    for i in range(n):
        case = f"case_{i:03d}"
        centre = extent / 2 + rng.uniform(-0.12, 0.12, 3) * extent
        d = np.sqrt(sum((g - c) ** 2 for g, c in zip((xx, yy, zz), centre, strict=True)))
        r = rng.uniform(0.12, 0.2) * extent.min()
        labels = np.zeros(shape, dtype=np.uint8)
        labels[d <= 2.0 * r] = 2  # oedema
        labels[d <= 1.0 * r] = 3  # the enhancing rim ...
        labels[d <= 0.6 * r] = 1  # ... around a necrotic core
        labels[~head] = 0
        folder_case = root / "cases" / case
        folder_case.mkdir(parents=True, exist_ok=True)
        files = []
        for modality in BRATS_MODALITIES:
            table = np.array(contrast[modality], dtype=np.float32)
            tissue = np.where(head, table[4], table[0]).astype(np.float32)
            tissue = np.where(labels > 0, table[[0, 1, 2, 3]][labels], tissue)
            volume = (tissue + rng.normal(0, 0.15, shape) * head).astype(np.float32) * 100
            files.append(folder_case / f"{case}_{modality}.nii.gz")
            _save_nifti(nib.Nifti1Image(volume, affine), files[-1])
        mask = folder_case / f"{case}_seg.nii.gz"
        _save_nifti(nib.Nifti1Image(labels, affine), mask)
        rows.append(
            ";".join(str(f.relative_to(root)) for f in files) + f",{mask.relative_to(root)}"
        )
    csv_path = root / "cases.csv"
    with atomic_path(csv_path) as tmp:
        tmp.write_text("\n".join(rows) + "\n")
    return csv_path


def _save_nifti(image: Any, path: Path) -> None:
    if path.exists():
        return  # a rerun keeps what was written (each file atomically)
    import nibabel as nib

    with atomic_path(path) as tmp:
        staged = tmp.with_name(tmp.name + ".nii.gz")
        nib.save(image, str(staged))
        staged.replace(tmp)


# Clouds' classes, each drawn as its own texture: horizontal stripes, dots, vertical stripes
# and a plain bright patch.
CLOUD_CLASSES = ("Fish", "Flower", "Gravel", "Sugar")


def _cloud_texture(name: str, height: int, width: int) -> np.ndarray:
    yy, xx = np.mgrid[:height, :width]
    if name == "Fish":
        return (yy // 2 % 2 == 0).astype(np.float32)  # horizontal stripes
    if name == "Flower":
        return ((yy // 2 % 2 == 0) & (xx // 2 % 2 == 0)).astype(np.float32)  # dots
    if name == "Gravel":
        return (xx // 2 % 2 == 0).astype(np.float32)  # vertical stripes
    return np.full((height, width), 0.6, dtype=np.float32)  # Sugar: a plain bright patch


def write_clouds_like(
    folder: str | Path,
    n: int = 48,
    height: int = 64,
    width: int = 96,
    seed: int = 0,
    n_test: int = 8,
) -> Path:
    """An Understanding-Clouds-shaped competition: ``train.csv`` in the ``Image_Label,
    EncodedPixels`` layout over ``train_images/*.jpg``, and unlabelled ``test_images/``. Each
    image holds up to four textured rectangles, one per class present, which may overlap (a
    pixel can be Fish and Sugar). Existing files are rewritten alike (the same seed).

    >>> import tempfile; d = write_clouds_like(tempfile.mkdtemp(), n=2, n_test=1)
    >>> (d / "train.csv").read_text().splitlines()[0]
    'Image_Label,EncodedPixels'
    """
    import csv

    from PIL import Image

    from bigbatch.segmentation.rle import rle_encode

    root = Path(folder)
    rng = np.random.default_rng(seed)
    rows: list[tuple[str, str]] = []
    for split, count in (("train_images", n), ("test_images", n_test)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image = rng.normal(0.3, 0.05, (height, width)).astype(np.float32)
            name = f"{split.removesuffix('_images')}_{i:04d}.jpg"
            for c in CLOUD_CLASSES:
                mask = np.zeros((height, width), dtype=bool)
                if rng.random() < 0.6:
                    h, w = (
                        int(rng.integers(height // 4, height // 2)),
                        int(rng.integers(width // 4, width // 2)),
                    )
                    top, left = int(rng.integers(0, height - h)), int(rng.integers(0, width - w))
                    mask[top : top + h, left : left + w] = True
                    texture = _cloud_texture(c, height, width)
                    image[mask] = 0.5 * image[mask] + 0.5 * texture[mask]
                rows.append((f"{name}_{c}", rle_encode(mask)))
            rgb = (np.clip(image, 0, 1) * 255).astype(np.uint8)
            with atomic_path(root / split / name) as tmp:
                Image.fromarray(np.stack([rgb] * 3, -1)).save(tmp, format="JPEG", quality=95)
        if split == "train_images":
            with atomic_path(root / "train.csv") as tmp, tmp.open("w", newline="") as f:
                csv.writer(f).writerows([("Image_Label", "EncodedPixels"), *rows])
    return root
