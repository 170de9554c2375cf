"""Masks from a trained segmentation run, with test-time augmentation by flips.

Each input is predicted whole (a U-Net is fully convolutional): a 2D image at the run's size,
the mask resized back to the image's own size; a 3D volume at its own size, padded to a multiple
of the U-Net's stride and cropped back. A volume too large for memory is predicted in
overlapping windows instead (``patch``, or the training patch size after an out-of-memory
error), blended with a Gaussian weight. Probabilities are averaged over ``tta`` passes (the
input, then flipped along its last, second-last ... spatial axis). Masks are written with the
input's geometry: PNG label maps for images, ``.npy`` for ``.npy`` volumes, NIfTI (with the
input's affine and header) for NIfTI volumes; each file atomically.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bigbatch.io import atomic_path
from bigbatch.memory.oom import is_oom
from bigbatch.train.checkpoint import load_weights_file
from bigbatch.train.config import ConfigError, config_from_json
from bigbatch.train.data import IMAGE_SUFFIXES, DataError, images_to_predict
from bigbatch.train.runtime import resolve_device
from bigbatch.train.tasks.segmentation.data import (
    VOLUME_SUFFIXES as VOLUMES,
)
from bigbatch.train.tasks.segmentation.data import (
    image_input,
    read_image,
    standardise,
    volume_suffix,
)
from bigbatch.train.tasks.segmentation.task import UNET_DEPTH, build_seg_model

__all__ = ["is_segmentation_run", "predict_masks", "sliding_window"]

log = logging.getLogger("bigbatch")


def is_segmentation_run(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "task.json").read_text()).get("task") == "segmentation"
    except (OSError, json.JSONDecodeError):
        return False


def _inputs(folder: Path, dims: int) -> list[Path]:
    if dims == 2:
        return images_to_predict(folder)  # the classification check: every image readable
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder of volumes to predict")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and volume_suffix(p) in VOLUMES)
    if not files:
        raise DataError(
            f"{folder} holds no volumes (.npy, .nii, .nii.gz): this run segments volumes"
        )
    return files


def predict_masks(
    run_dir: str | Path,
    folder: str | Path,
    out: str | Path,
    *,
    tta: int = 2,
    checkpoint: str = "best",
    device: str = "cpu",
    patch: int = 0,
) -> list[Path]:
    """Write a mask for every image or volume under ``folder`` into ``out``; return their paths.

    Volumes are predicted whole unless ``patch`` (a multiple of the U-Net's stride) asks for
    overlapping ``patch``^3 windows; a whole volume that runs out of memory is predicted again
    in windows of the training patch size, with a warning.
    """

    if isinstance(tta, bool) or not isinstance(tta, int) or tta < 1:
        raise ConfigError(f"tta is a number of passes >= 1, got {tta!r}")
    run_dir, folder, out = Path(run_dir), Path(folder), Path(out)
    cfg = config_from_json((run_dir / "config.json").read_text(), str(run_dir / "config.json"))
    info = json.loads((run_dir / "task.json").read_text())
    dims, channels, classes = int(info["dims"]), int(info["channels"]), int(info["num_classes"])
    stride = 2**UNET_DEPTH
    if patch and (dims == 2 or patch < 0 or patch % stride):
        raise ConfigError(
            "--patch is for volumes (2D images are predicted whole at the run's size)"
            if dims == 2
            else f"--patch {patch}: the U-Net halves it {UNET_DEPTH} times, so it must be a "
            f"positive multiple of {stride}; try {max(stride, patch // stride * stride)}"
        )
    files = _inputs(folder, dims)
    weights = run_dir / f"{checkpoint}.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{weights} does not exist: the run has not finished an epoch yet")
    cfg.pretrained = False
    model = build_seg_model(cfg, channels, classes, dims)()
    load_weights_file(model, weights)
    dev = resolve_device(device, "--device")
    model.to(dev).eval()

    def probabilities(x: torch.Tensor) -> torch.Tensor:
        logits = model(x.to(dev)).float().cpu()
        return torch.sigmoid(logits) if classes == 1 else torch.softmax(logits, 1)

    written = []
    for f in files:
        image = torch.from_numpy(read_image((f,), dims))
        if image.shape[0] != channels:
            raise DataError(
                f"{f} has {image.shape[0]} channel(s); the run was trained on {channels}"
            )
        spatial = tuple(image.shape[1:])
        if dims == 2:
            x = image_input(image, cfg.size)[None]  # as in training
        else:
            pad: list[int] = []
            for s in reversed(spatial):
                pad += [0, -s % stride]
            x = F.pad(standardise(image), pad)[None]
        with torch.no_grad():
            probs = _volume_probs(probabilities, x, tta, patch, cfg.size, f)
        if dims == 2:
            probs = F.interpolate(probs, size=spatial, mode="bilinear")
        else:
            probs = probs[(slice(None), slice(None), *[slice(0, s) for s in spatial])]
        mask = (probs[0, 0] > 0.5).long() if classes == 1 else probs[0].argmax(0)
        written.append(_write_mask(mask.numpy(), f, folder, out))
    return written


Probabilities = Callable[[torch.Tensor], torch.Tensor]


def _with_tta(probabilities: Probabilities, x: torch.Tensor, tta: int) -> torch.Tensor:
    """The mean over ``tta`` passes: the input, then one flip per pass, each along another
    spatial axis (last first)."""
    flips = list(range(x.dim() - 1, 1, -1))
    total = torch.zeros(0)
    for k in range(tta):
        axes = [] if k == 0 else [flips[(k - 1) % len(flips)]]
        p = probabilities(x.flip(axes)).flip(axes) if axes else probabilities(x)
        total = p if k == 0 else total + p
    return total / tta


def _volume_probs(
    probabilities: Probabilities, x: torch.Tensor, tta: int, patch: int, train_size: int, f: Path
) -> torch.Tensor:
    if patch:
        return _with_tta(lambda v: sliding_window(probabilities, v, patch), x, tta)
    try:
        return _with_tta(probabilities, x, tta)
    except Exception as exc:
        if x.dim() != 5 or not is_oom(exc):
            raise
        failure = f"{type(exc).__name__}: {str(exc)[:120]}"
    # Out of the except block: the exception and the failed pass's activations are dropped.
    log.warning(
        "%s: predicting the whole %s volume ran out of memory (%s); predicting it in "
        "overlapping %d^3 windows, the training patch size (choose with --patch)",
        f.name,
        "x".join(map(str, x.shape[2:])),
        failure,
        train_size,
    )
    return _with_tta(lambda v: sliding_window(probabilities, v, train_size), x, tta)


def _starts(size: int, window: int, step: int) -> list[int]:
    if size <= window:
        return [0]
    return sorted({*range(0, size - window, step), size - window})


def _gaussian(shape: tuple[int, ...]) -> torch.Tensor:
    """A window's centre is trusted over its edges, which see less context (nnU-Net's choice
    of sigma: an eighth of the window); never zero, so every voxel has a weight."""
    weight = torch.ones(())
    for n in shape:
        axis = torch.exp(-0.5 * ((torch.arange(n) - (n - 1) / 2) / (n / 8)) ** 2)
        weight = weight[..., None] * axis
    return weight.clamp_min(1e-3)


def sliding_window(
    probabilities: Probabilities, x: torch.Tensor, patch: int, *, overlap: float = 0.5
) -> torch.Tensor:
    """Class probabilities of ``x`` (1, C, *spatial) from ``patch``-sized windows (an axis no
    longer than ``patch`` is taken whole) overlapping by ``overlap``, blended with a Gaussian
    weight. ``probabilities`` maps a window (1, C, *window) to (1, K, *window).

    >>> import torch
    >>> x = torch.rand(1, 2, 20, 12, 9)
    >>> torch.allclose(sliding_window(lambda w: w.softmax(1), x, 8), x.softmax(1))
    True
    """
    if not 0 <= overlap < 1:
        raise ValueError(f"overlap is a fraction in [0, 1), got {overlap}")
    spatial = tuple(x.shape[2:])
    window = tuple(min(patch, n) for n in spatial)
    step = max(1, int(patch * (1 - overlap)))
    weight = _gaussian(window)
    total = norm = torch.zeros(0)
    for corner in itertools.product(
        *(_starts(n, w, step) for n, w in zip(spatial, window, strict=True))
    ):
        where = tuple(slice(c, c + w) for c, w in zip(corner, window, strict=True))
        p = probabilities(x[(slice(None), slice(None), *where)])
        if not total.numel():
            total = torch.zeros((*p.shape[:2], *spatial), dtype=p.dtype)
            norm, weight = torch.zeros(spatial, dtype=p.dtype), weight.to(p.dtype)
        total[(slice(None), slice(None), *where)] += p * weight
        norm[where] += weight
    return total / norm


def _write_mask(mask: np.ndarray, source: Path, folder: Path, out: Path) -> Path:
    suffix = volume_suffix(source)
    target = out / source.relative_to(folder)
    if suffix in IMAGE_SUFFIXES:
        from PIL import Image

        target = target.with_suffix(".png")
        with atomic_path(target) as tmp:
            Image.fromarray(mask.astype(np.uint8)).save(tmp, format="PNG")
    elif suffix == ".npy":
        with atomic_path(target) as tmp, open(tmp, "wb") as fh:
            np.save(fh, mask.astype(np.int64))
    else:
        import nibabel as nib

        src: Any = nib.load(str(source))
        img = nib.Nifti1Image(mask.astype(np.uint8), src.affine, src.header)
        img.set_data_dtype(np.uint8)
        with atomic_path(target) as tmp:
            nib.save(img, str(tmp.with_name(tmp.name + suffix)))
            tmp.with_name(tmp.name + suffix).replace(tmp)
    return target
