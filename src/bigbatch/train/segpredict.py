"""Masks from a trained segmentation run, with test-time augmentation by flips.

Each input is predicted whole (a U-Net is fully convolutional): a 2D image at the run's size,
the mask resized back to the image's own size; a 3D volume at its own size, padded to a multiple
of the U-Net's stride and cropped back. Probabilities are averaged over ``tta`` passes (the
input, then flipped along its last, second-last ... spatial axis). Masks are written with the
input's geometry: PNG label maps for images, ``.npy`` for ``.npy`` volumes, NIfTI (with the
input's affine and header) for NIfTI volumes; each file atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bigbatch.io import atomic_path
from bigbatch.train.checkpoint import load_weights_file
from bigbatch.train.config import ConfigError, config_from_json
from bigbatch.train.data import IMAGE_SUFFIXES, DataError, images_to_predict
from bigbatch.train.segdata import (
    VOLUME_SUFFIXES as VOLUMES,
)
from bigbatch.train.segdata import (
    image_input,
    read_image,
    standardise,
    volume_suffix,
)

__all__ = ["is_segmentation_run", "predict_masks"]


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
) -> list[Path]:
    """Write a mask for every image or volume under ``folder`` into ``out``; return their paths."""
    from bigbatch.train.loop import resolve_device
    from bigbatch.train.tasks.segmentation import UNET_DEPTH, build_seg_model

    if isinstance(tta, bool) or not isinstance(tta, int) or tta < 1:
        raise ConfigError(f"tta is a number of passes >= 1, got {tta!r}")
    run_dir, folder, out = Path(run_dir), Path(folder), Path(out)
    cfg = config_from_json((run_dir / "config.json").read_text(), str(run_dir / "config.json"))
    info = json.loads((run_dir / "task.json").read_text())
    dims, channels, classes = int(info["dims"]), int(info["channels"]), int(info["num_classes"])
    files = _inputs(folder, dims)
    weights = run_dir / f"{checkpoint}.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{weights} does not exist: the run has not finished an epoch yet")
    cfg.pretrained = False
    model = build_seg_model(cfg, channels, classes, dims)()
    load_weights_file(model, weights)
    dev = resolve_device(device, "--device")
    model.to(dev).eval()
    stride = 2**UNET_DEPTH
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
        probs = torch.zeros(0)
        with torch.no_grad():
            flips = list(range(x.dim() - 1, 1, -1))  # the spatial axes, last first
            for k in range(tta):
                # Pass 0: the input; then one flip per pass, each along another spatial axis.
                axes = [] if k == 0 else [flips[(k - 1) % len(flips)]]
                logits = model(x.flip(axes).to(dev) if axes else x.to(dev)).float().cpu()
                logits = logits.flip(axes) if axes else logits
                p = torch.sigmoid(logits) if classes == 1 else torch.softmax(logits, 1)
                probs = p if k == 0 else probs + p
        probs = probs / tta
        if dims == 2:
            probs = F.interpolate(probs, size=spatial, mode="bilinear")
        else:
            probs = probs[(slice(None), slice(None), *[slice(0, s) for s in spatial])]
        mask = (probs[0, 0] > 0.5).long() if classes == 1 else probs[0].argmax(0)
        written.append(_write_mask(mask.numpy(), f, folder, out))
    return written


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
