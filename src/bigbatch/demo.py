"""The demo's data: scikit-learn's bundled digits, written out as a small image competition.

``train/<digit>/*.png`` (1,600 images), ``test/*.png`` (197, unlabelled), a
``sample_submission.csv`` in Kaggle's layout, and ``experiments.toml``: two small timm models,
each planned into a small memory budget, TTA, a weighted ensemble. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bigbatch.io import atomic_path, atomic_write_csv, atomic_write_text

__all__ = ["write_digits_competition"]

EXPERIMENTS = """\
# The demo ensemble: two small timm models (random init: no download), each planned into the
# same memory budget for the training step's tensors, trained, predicted with TTA and averaged.
[common]
data = "train"
valid_pct = 0.2
size = {size}
batch = 128          # target batch: samples per optimizer step
budget = "{budget}"  # memory for the training step's tensors (overhead below is 0)
overhead = "0"
epochs = {epochs}
freeze_epochs = 0
mode = "fit"
lr = 0.004
device = "cpu"
num_workers = 0
seed = 42

[ensemble]
test = "test"
sample_submission = "sample_submission.csv"
tta = 2

[[member]]
name = "resnet10t"
arch = "resnet10t"
item_transform = "squish"
weight = 1.0

[[member]]
name = "convnext"     # LayerNorm, no BatchNorm: its accumulation is exact
arch = "convnext_atto"
item_transform = "crop"
weight = 0.5
"""


def write_digits_competition(
    out: str | Path, *, size: int = 32, budget: str = "120MiB", epochs: int = 4
) -> Path:
    """Write the digits competition under ``out``; returns the experiments file."""
    from PIL import Image
    from sklearn.datasets import load_digits

    out = Path(out)
    digits = load_digits()
    images = (digits.images / 16.0 * 255).astype(np.uint8)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(images))
    n_train = 1600
    for rank, i in enumerate(order):
        if rank < n_train:
            path = out / "train" / str(digits.target[i]) / f"digit_{i:04d}.png"
        else:
            path = out / "test" / f"digit_{i:04d}.png"
        if path.exists():
            continue  # a rerun; each file was written atomically, so it is whole
        im = Image.fromarray(images[i]).resize((size, size), Image.Resampling.BILINEAR)
        with atomic_path(path) as tmp:
            im.convert("RGB").save(tmp, format="PNG")
    atomic_write_csv(
        out / "sample_submission.csv",
        ["image_id", "label"],
        ([f"digit_{i:04d}.png", ""] for i in sorted(order[n_train:])),
    )
    experiments = out / "experiments.toml"
    atomic_write_text(experiments, EXPERIMENTS.format(size=size, budget=budget, epochs=epochs))
    return experiments
