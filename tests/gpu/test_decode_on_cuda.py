"""On a real NVIDIA GPU (`pytest -m cuda tests/gpu`): decoding and augmenting training JPEGs on
the GPU (nvJPEG through torchvision) against the CPU workers' PIL path. Skipped without one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bigbatch.train.config import load_config
from bigbatch.train.data import SeededSamples
from bigbatch.train.loop import train
from bigbatch.train.tasks.device_images import DeviceAugment, EncodedImages, collate_encoded
from bigbatch.train.tasks.images import ImageDataset, build_transforms

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]

CUDA = torch.device("cuda")


def photos(folder: Path, classes: int = 1, per_class: int = 8, side: int = 96) -> list[Path]:
    rng = np.random.default_rng(0)
    files = []
    for c in range(classes):
        (folder / f"c{c}").mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            small = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
            small[..., c % 3] = 255
            image = Image.fromarray(small).resize((side + 4 * k, side), Image.BILINEAR)
            files.append(folder / f"c{c}" / f"{k}.jpg")
            image.save(files[-1], quality=92)
    return files


def test_nvjpeg_gives_the_cpu_paths_crops_and_flips(tmp_path: Path) -> None:
    """The same seeded crops and flips as the CPU's PIL path, pixels within nvJPEG's and the
    resampling's round-off of it (on an H100: 0.71 levels on average, 12 at most, at colour
    edges, where nvJPEG's chroma upsampling differs from libjpeg-turbo's); other seeds (other
    crops) are far further."""
    files = photos(tmp_path)
    labels = list(range(len(files)))
    transform = build_transforms(64, "squish", train=True, augment=True)
    cpu = SeededSamples(ImageDataset(files, labels, transform))
    gpu = SeededSamples(EncodedImages(files, labels))
    augment = DeviceAugment(64).on(CUDA)
    keys = [(500 + i, i) for i in range(len(files))]
    on_cpu = torch.stack([cpu[k][0] for k in keys])
    on_gpu = augment(collate_encoded([gpu[k] for k in keys]))[0].cpu()
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    levels = (on_cpu - on_gpu).abs() * std * 255
    print(f"nvJPEG path vs PIL path: max {levels.max():.2f}, mean {levels.mean():.3f} levels")
    assert levels.mean() <= 1.0 and levels.max() <= 24.0
    other = torch.stack([cpu[(7 + i, i)][0] for i in range(len(files))])
    assert ((on_cpu - other).abs() * std * 255).mean() > 5 * max(float(levels.mean()), 1.0)


def test_decode_gpu_trains_as_the_cpu_path_does(tmp_path: Path) -> None:
    """bigbatch train with decode=gpu on the card: the CPU path's losses up to round-off."""
    data = tmp_path / "train"
    photos(data, classes=3, per_class=16)
    base = [f"data={data}", "arch=resnet10t", "size=64", "batch=16", "epochs=2", "mode=fit"]
    base += ["device=cuda", "precision=fp32", "num_workers=2", "valid_pct=0", "log_every=0"]
    losses = {}
    for decode in ("cpu", "gpu"):
        cfg = load_config(overrides=[*base, f"decode={decode}"])
        history = train(cfg, tmp_path / decode, log=lambda _: None, progress=False).history
        losses[decode] = [row["train_loss"] for row in history]
    print(f"train losses: {losses}")
    np.testing.assert_allclose(losses["gpu"], losses["cpu"], rtol=0.05)
