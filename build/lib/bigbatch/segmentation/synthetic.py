"""Small synthetic segmentation sets, generated (never downloaded): 2D shapes and 3D blobs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bigbatch.io import atomic_path

__all__ = ["write_blobs_3d", "write_shapes_2d"]


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
