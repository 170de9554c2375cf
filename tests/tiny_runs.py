"""Tiny generated image folders and a tiny model, so end-to-end runs take seconds.

A module of its own, not a conftest, so that tests in any folder import it by one name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("red", "green", "blue")

TINY_MODEL = """
import torch
from torch import nn

def tiny(num_classes):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes),
    )

def fixed_size(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, num_classes))

def with_bn(num_classes):
    # BatchNorm1d after pooling: one sample in training is one value per channel, an error.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.BatchNorm1d(8), nn.Linear(8, num_classes),
    )

class Diverges(nn.Module):
    # Trains normally for `after` training forwards, then its output is nan.
    def __init__(self, num_classes, after):
        super().__init__()
        self.net = tiny(num_classes)
        self.after, self.calls = after, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        out = self.net(x)
        return out * float("nan") if self.calls > self.after else out

def diverges_in_epoch_2(num_classes):
    return Diverges(num_classes, after=6)  # epoch 1: 2 windows x 3 micro-batches of 4
"""


def write_images(folder: Path, n_per_class: int = 10, seed: int = 0, size: int = 16) -> None:
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(n_per_class):
            pixels = rng.integers(0, 80, (size, size, 3))
            pixels[..., c] += 150
            Image.fromarray(pixels.astype(np.uint8)).save(folder / name / f"{name}_{i}.png")


def base_overrides(data: Path, model: str) -> list[str]:
    return [
        f"data={data}",
        f"model={model}",
        "size=16",
        "batch=12",
        "micro_batch=4",
        "epochs=2",
        "mode=fit",
        "device=cpu",
        "num_workers=0",
        "lr=0.01",
    ]
