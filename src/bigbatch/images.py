"""Images as they are stored: 8- and 16-bit greyscale and RGB (PNG, TIFF, JPEG ...), float TIFF
and DICOM, read into floats without clipping.

PIL's ``convert("RGB")`` clips a 16-bit image at 255: a 0..4095 X-ray comes out almost white.
Here an 8-bit image is divided by 255; a 16-bit or float image by the set's own ``scale`` (the
largest value of the training images, rounded up to 2^k - 1 for integers, so 12-bit data is
divided by 4095), saved in the run for prediction; DICOM through pydicom's modality LUT
(rescale slope and intercept) and VOI LUT (``window=`` or the header's window). What PIL cannot read
faithfully (16-bit RGB, whose PNG PIL reads as 8-bit) is refused with the fix.

>>> import tempfile, numpy as np
>>> from PIL import Image
>>> path = Path(tempfile.mkdtemp()) / "xray.png"
>>> Image.fromarray(np.array([[0, 4095]], dtype=np.uint16)).save(path)
>>> info = probe(path); info.grey, info.depth, info.peak
(True, 'high', 4095.0)
>>> read_pixels(path, scale=4095.0, grey=True).tolist()
[[[0.0, 1.0]]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DICOM_SUFFIXES",
    "ImageInfo",
    "UnreadableImageError",
    "exif_orientation",
    "probe",
    "read_pixels",
    "scale_for",
]

DICOM_SUFFIXES = (".dcm", ".dicom")
# PIL modes read as they are: 8-bit (divided by 255) and wider (divided by the set's scale).
_EIGHT_BIT = {"1", "L", "P", "RGB", "RGBA", "LA", "CMYK", "YCbCr", "PA", "La", "RGBa"}
_WIDE = {"I;16", "I;16B", "I;16L", "I;16N", "I", "F"}


class UnreadableImageError(ValueError):
    """An image that cannot be read faithfully; the message names the fix."""


@dataclass(frozen=True)
class ImageInfo:
    """What an image holds: greyscale or colour, 8-bit or wider, and its largest value."""

    grey: bool
    depth: str  # "8bit", "high" (16-bit or float: divided by the set's scale) or "dicom"
    peak: float = 255.0  # the largest stored value (read for "high" images only)


def is_dicom(path: Path) -> bool:
    if path.suffix.lower() in DICOM_SUFFIXES:
        return True
    try:
        with open(path, "rb") as f:
            return f.read(132)[128:132] == b"DICM"  # the DICOM preamble's magic
    except OSError:
        return False


def _png_rgb16(path: Path) -> bool:
    """A PNG of 16-bit colour, which PIL silently reads as 8-bit."""
    try:
        with open(path, "rb") as f:
            head = f.read(26)
    except OSError:
        return False
    return head[:8] == b"\x89PNG\r\n\x1a\n" and head[24] == 16 and head[25] in (2, 6)


def probe(path: Path) -> ImageInfo:
    """How ``path`` is stored (opening it; a wide image's pixels are read for its peak)."""
    if is_dicom(path):
        grey = _dicom_unit(path, None).ndim == 2  # decoded now: a damaged file fails here
        return ImageInfo(grey=grey, depth="dicom")
    if _png_rgb16(path):
        raise UnreadableImageError(
            f"{path} is a 16-bit colour PNG, which PIL (and so bigbatch) reads as 8-bit: save "
            "it as 8-bit RGB, or its channels as 16-bit greyscale images"
        )
    from PIL import Image

    with Image.open(path) as im:
        mode = im.mode
        if mode in _EIGHT_BIT:
            grey = mode in ("1", "L", "LA", "La") or (mode == "P" and _grey_palette(im))
            return ImageInfo(grey=grey, depth="8bit")
        if mode in _WIDE:
            values = np.asarray(im)
            if not np.isfinite(values).all():
                raise UnreadableImageError(f"{path} holds NaN or infinite pixels: fix the image")
            return ImageInfo(grey=True, depth="high", peak=float(np.abs(values).max(initial=0)))
    raise UnreadableImageError(
        f"{path} has PIL mode {mode!r}, which bigbatch cannot read faithfully: save it as 8- or "
        "16-bit greyscale, 8-bit RGB, or a float TIFF"
    )


def exif_orientation(image: Any) -> int:
    """The EXIF orientation a photo's viewers apply to an open PIL image (1: as stored; 6:
    rotated 90 degrees ...; 2-8 flip or rotate), read from its header; 1 where it has none or
    its EXIF block cannot be read. The caller opens the image once, for its size too."""
    try:
        return int(image.getexif().get(0x0112, 1) or 1)  # 0x0112: Orientation
    except Exception:
        return 1


def _grey_palette(im: Any) -> bool:
    palette = im.getpalette() or []
    rgb = np.array(palette[: len(palette) // 3 * 3]).reshape(-1, 3)
    return bool(len(rgb)) and bool((rgb == rgb[:, :1]).all())


def scale_for(peak: float, integer: bool = True) -> float:
    """What a set of wide images is divided by: its peak, rounded up to 2^k - 1 for integer
    data (a 12-bit detector's 0..4095), as it is for floats.

    >>> scale_for(4000.0), scale_for(65535.0), scale_for(2.5, integer=False)
    (4095.0, 65535.0, 2.5)
    """
    if peak <= 0:
        return 1.0
    if not integer:
        return float(peak)
    return float(2 ** max(8, math.ceil(math.log2(peak + 1))) - 1)


def read_pixels(
    path: Path,
    *,
    scale: float = 0.0,
    grey: bool = False,
    window: tuple[float, float] | None = None,
) -> np.ndarray:
    """``(C, H, W)`` float32 in [0, 1] (C = 1 with ``grey``, else 3): 8-bit images divided by
    255, wide ones by ``scale`` (:func:`scale_for` of the set), DICOM windowed."""
    if is_dicom(path):
        array = _dicom_unit(path, window)
        if array.ndim == 3:  # colour DICOM (H, W, 3)
            array = array.mean(-1) if grey else array
        channels = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
        return _to_channels(channels, grey)
    from PIL import Image, ImageOps

    with Image.open(path) as opened:
        # Cameras store the orientation in EXIF: a photo taken upright must train upright.
        im = ImageOps.exif_transpose(opened)
        if im.mode in _WIDE:
            values = np.asarray(im, dtype=np.float32)
            unit = values / (scale or scale_for(float(values.max(initial=0))))
            return _to_channels(unit[None], grey)
        rgb = np.asarray(im.convert("L" if grey else "RGB"), dtype=np.float32) / 255.0
    return rgb[None] if grey else rgb.transpose(2, 0, 1)


def _to_channels(array: np.ndarray, grey: bool) -> np.ndarray:
    if grey and array.shape[0] != 1:
        array = array.mean(0, keepdims=True)
    if not grey and array.shape[0] == 1:
        array = np.repeat(array, 3, axis=0)
    return np.ascontiguousarray(array, dtype=np.float32)


def _dcmread(path: Path, header_only: bool = False) -> Any:
    try:
        import pydicom
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"{path} is DICOM, which needs pydicom: pip install 'bigbatch[dicom]'", name="pydicom"
        ) from exc
    try:
        return pydicom.dcmread(str(path), stop_before_pixels=header_only)
    except Exception as exc:
        raise UnreadableImageError(f"cannot read DICOM {path}: {exc}") from exc


def _dicom_unit(path: Path, window: tuple[float, float] | None) -> np.ndarray:
    """pydicom's modality LUT (rescale slope and intercept: Hounsfield units for CT), then its
    VOI LUT with the window ``(centre, width)`` (``window=``, else the header's), mapped from the
    window's output range to [0, 1]; without a window, the stored bit depth's whole range.
    MONOCHROME1 (dark is high) is inverted."""
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    ds = _dcmread(path)
    try:
        stored = ds.pixel_array
    except Exception as exc:
        raise UnreadableImageError(f"cannot decode the pixels of DICOM {path}: {exc}") from exc
    values = np.asarray(apply_modality_lut(stored, ds), dtype=np.float64)
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = window
    if "WindowCenter" in ds and "WindowWidth" in ds:
        out = np.asarray(apply_voi_lut(values, ds), dtype=np.float64)
        # The window's output range, as pydicom maps values far outside it.
        low, high = np.asarray(apply_voi_lut(np.array([-1e12, 1e12]), ds), dtype=np.float64)
    else:
        bits = int(getattr(ds, "BitsStored", 16))
        signed = int(getattr(ds, "PixelRepresentation", 0)) == 1
        ends = np.array([-(2 ** (bits - 1)), 2 ** (bits - 1) - 1] if signed else [0, 2**bits - 1])
        low, high = np.asarray(apply_modality_lut(ends, ds), dtype=np.float64)
        out = values
    unit = np.clip((out - low) / (high - low), 0.0, 1.0) if high > low else np.zeros_like(out)
    if getattr(ds, "PhotometricInterpretation", "") == "MONOCHROME1":
        unit = 1.0 - unit
    return unit.astype(np.float32)
