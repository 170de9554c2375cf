"""The demo's data: the bundled UCI digits, written out as a small image competition.

``train/<digit>/*.png`` (1,600 images), ``test/*.png`` (197, unlabelled), a
``sample_submission.csv`` in Kaggle's layout, and ``experiments.toml``: two small timm models,
each planned into a small memory budget, TTA, a weighted ensemble. Nothing is downloaded.
"""

from __future__ import annotations

import csv
import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from bigbatch.device import torch_threads
from bigbatch.io import atomic_path, atomic_write_csv, atomic_write_text
from bigbatch.memory.calibrate import calibrate, calibration_need
from bigbatch.memory.plan import DEFAULT_MARGIN
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec
from bigbatch.models import timm_factory
from bigbatch.segmentation.networks import build_network
from bigbatch.segmentation.synthetic import (
    BRATS_REGIONS,
    write_blobs_3d,
    write_brats_like,
    write_shapes_2d,
)
from bigbatch.train.config import load_config
from bigbatch.train.loop import train
from bigbatch.train.runtime import training_threads
from bigbatch.train.tasks.segmentation.predict import predict_masks

__all__ = ["write_digits_competition"]

EXPERIMENTS = """\
# The demo ensemble: two small timm models (random init: no download), each planned into the
# same memory budget for the training step's tensors, trained, predicted with TTA and averaged.
[common]
data = "train"
valid_pct = 0.2
size = {size}
batch = 128          # target batch: samples per optimizer step
overhead = "0"       # each member's budget is for its training step's tensors alone
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
budget = "{budget_resnet10t}"

[[member]]
name = "convnext"     # LayerNorm, no BatchNorm: its accumulation is exact
arch = "convnext_atto"
item_transform = "crop"
weight = 0.5
budget = "{budget_convnext_atto}"
"""


MEMBERS = ("resnet10t", "convnext_atto")


def demo_budget(arch: str, size: int, batch: int = 128) -> str:
    """A budget that holds half the target batch but not all of it, on this machine.

    CPU kernels' workspaces differ between CPUs (oneDNN's convolution backward takes 72 MiB for
    resnet10t at 32 px on one AMD EPYC, far less elsewhere), so a fixed budget would plan 1 x 128
    on one machine and fail on another. The planner's own calibrated prediction, midway between
    micro-batch ``batch // 2`` and ``batch``, plans 2 x 64 everywhere.
    """

    spec = StepSpec(timm_factory(arch, num_classes=10, img_size=size), (3, size, size), 2)
    return midway_budget(spec, batch)


def midway_budget(spec: Any, batch: int) -> str:
    """The budget midway between the calibrated peaks at micro-batch ``batch // 2`` (the second
    holding the first's gradients) and ``batch``: the planner then chooses 2 x ``batch // 2``
    (see :func:`demo_budget`). It is never below what the planner's calibration steps up to
    half the batch need, so the plan is calibrated there."""

    # Measured with the threads the training run will take (`bigbatch train` gives torch every
    # core here), not this process's: oneDNN's convolution workspaces grow with the threads, and
    # under OMP_NUM_THREADS=1 a budget calibrated on 1 thread planned resnet10t at 10 x 13
    # instead of 2 x 64 (72 MiB of workspace more on 2 threads).
    with torch_threads(training_threads()):
        calibration = calibrate(spec)
        half, full = (
            predict_peak(spec.with_batch(b).in_window(batch), calibration=calibration).peak_bytes
            for b in (batch // 2, batch)
        )
        # Calibration's real steps run at micro-batch 1, 2 and 4, those below half the batch.
        usable = max((half + full) / 2, calibration_need(spec.with_batch(min(4, batch // 2))))
    return f"{math.ceil(usable / (1 - DEFAULT_MARGIN) / 2**20)}MiB"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The UCI handwritten digits (1797 greyscale 8 x 8 images, values 0-16, and their labels
    0-9), as scikit-learn bundles them; shipped with bigbatch (45 KB), so no scikit-learn.

    >>> images, labels = load_digits()
    >>> images.shape, int(images.max()), labels[:5].tolist()
    ((1797, 8, 8), 16, [0, 1, 2, 3, 4])
    """
    from importlib.resources import files

    with (files("bigbatch") / "data" / "digits.npz").open("rb") as f, np.load(f) as data:
        return data["images"], data["target"]


def write_digits_competition(
    out: str | Path, *, size: int = 32, budget: str = "auto", epochs: int = 4
) -> Path:
    """Write the digits competition under ``out``; returns the experiments file.

    ``budget="auto"`` gives each member :func:`demo_budget`; a size gives both that budget."""
    from PIL import Image

    out = Path(out)
    digits, target = load_digits()
    images = (digits / 16.0 * 255).astype(np.uint8)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(images))
    n_train = 1600
    for rank, i in enumerate(order):
        if rank < n_train:
            path = out / "train" / str(target[i]) / f"digit_{i:04d}.png"
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
    budgets = {
        f"budget_{arch}": demo_budget(arch, size) if budget == "auto" else budget
        for arch in MEMBERS
    }
    atomic_write_text(experiments, EXPERIMENTS.format(size=size, epochs=epochs, **budgets))
    return experiments


# MONAI's DynUNet (nnU-Net's network), three levels: small data, small network. On these
# generated sets it learned fastest of MONAI's networks (3 epochs of 3D blobs: Dice 0.86,
# against 0.37 for its UNet at the same learning rate).
ARCH, WIDTHS = "dynunet", (16, 32, 64)


def train_or_keep(cfg: Any, run_dir: Path, log: Any) -> None:
    """Train ``cfg`` into ``run_dir``; a rerun keeps a finished run and resumes a broken one,
    each as ``bigbatch train --resume`` does: a rerun with other options (``--epochs``) is
    refused in one line, never answered with the earlier run."""
    train(cfg, run_dir, resume=(run_dir / "config.json").is_file(), log=log)


def run_segmentation_demo(out: Path, epochs: int = 3, log: Any = print) -> dict[str, float]:
    """Segmentation end to end on generated data: MONAI's DynUNet in 2D on 96 images of shapes
    (3 classes) and in 3D on 12 two-channel volumes with a blob, each planned into a budget that holds
    half its batch, trained with exact accumulation, scored by Dice/Jaccard, and its masks
    predicted for a held-out set. Returns the final validation Dice of each."""

    scores = {}
    jobs: tuple[tuple[str, Any, dict[str, int], int, int, int, int], ...] = (
        ("2d", write_shapes_2d, {"n": 96, "size": 64}, 64, 32, 3, 2),
        ("3d", write_blobs_3d, {"n": 12, "size": 32, "channels": 2}, 32, 4, 2, 3),
    )
    for name, write, kwargs, size, batch, channels, dims in jobs:
        data = write(out / f"seg{name}", **kwargs)
        test = write(out / f"seg{name}_test", seed=1, **{**kwargs, "n": 4})
        classes = 3 if dims == 2 else 1
        spec = StepSpec(
            functools.partial(
                build_network, ARCH, channels, classes, dims=dims, size=size, widths=WIDTHS
            ),
            (channels, *[size] * dims),
            2,
        )
        budget = midway_budget(spec, batch)
        log(
            f"\n== segmentation {name}: {data} (budget {budget}: less than a batch of {batch} needs)"
        )
        cfg = load_config(
            overrides=[
                f"data={data}",
                "task=segmentation",
                f"arch={ARCH}",
                "widths=" + ",".join(map(str, WIDTHS)),
                f"size={size}",
                f"batch={batch}",
                f"budget={budget}",
                "overhead=0",
                f"epochs={epochs if dims == 2 else max(1, epochs - 1)}",
                "lr=3e-3",
                "monitor=dice",
                "schedule=plateau",
            ]
        )
        run_dir = out / "runs" / f"{ARCH}{name}"
        train_or_keep(cfg, run_dir, log)
        masks = predict_masks(run_dir, test / "images", run_dir / "masks", tta=2)
        with open(run_dir / "history.csv", newline="") as f:
            scores[name] = float(list(csv.DictReader(f))[-1]["dice"])
        log(f"{len(masks)} predicted masks in {run_dir / 'masks'}; history in {run_dir}")
    return scores


def run_regression_demo(out: Path, epochs: int = 4, log: Any = print) -> dict[str, float]:
    """Image regression end to end on the bundled digits: two targets per image, the share of
    its pixels that are ink (%) and the digit's value read as a number, in a CSV of
    ``file,ink,value``; resnet10t at 32 px planned into a budget that holds half its batch,
    trained with exact accumulation on standardised targets, scored by MAE/RMSE/R2 in the
    targets' units, and predicted for held-out images with a horizontal-flip TTA
    (``predictions.csv`` in the CSV's layout). Returns the last epoch's validation scores."""
    from PIL import Image

    from bigbatch.train.tasks.regression.predict import predict_files, save_values

    digits, target = load_digits()
    data = out / "regression"
    rows = []
    for i, (image, value) in enumerate(zip(digits, target, strict=True)):
        name = f"{'test' if i >= 1600 else 'images'}/digit_{i:04d}.png"
        path = data / name
        if not path.exists():  # a rerun keeps what was written (atomically)
            pixels = Image.fromarray((image / 16.0 * 255).astype(np.uint8)).convert("RGB")
            with atomic_path(path) as tmp:
                pixels.resize((32, 32), Image.Resampling.BILINEAR).save(tmp, format="PNG")
        if i < 1600:
            rows.append([name, f"{100 * float((image > 8).mean()):.2f}", str(int(value))])
    atomic_write_csv(data / "train.csv", ["file", "ink", "value"], rows)
    budget = demo_budget("resnet10t", 32, 128)
    log(f"\n== regression: {data / 'train.csv'} (budget {budget}: less than a batch of 128 needs)")
    cfg = load_config(
        overrides=[
            f"data={data / 'train.csv'}",
            "task=regression",
            "arch=resnet10t",
            "size=32",
            "batch=128",
            f"budget={budget}",
            "overhead=0",  # the budget is the step's, as the other demos' are
            f"epochs={epochs}",
            "lr=3e-3",
            "monitor=mae",
        ]
    )
    run_dir = out / "runs" / "regression"
    train_or_keep(cfg, run_dir, log)
    test = sorted((data / "test").glob("*.png"))
    values, names = predict_files(run_dir, test, tta=2)
    _, csv_path = save_values(test, values, names, run_dir / "predictions")
    log(f"{len(test)} held-out images predicted: {csv_path}")
    with open(run_dir / "history.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    return {k: float(last[k]) for k in ("mae", "rmse", "r2")}


def run_brats_demo(
    out: Path, epochs: int = 3, log: Any = print, cases: int = 16
) -> dict[str, float]:
    """A BraTS-shaped run: ``cases`` (16) generated cases of four MRI modalities (NIfTI, 1 x 1 x 2 mm
    voxels, listed in a CSV), resampled to 1 mm, MONAI's SegResNet trained at micro-batch 1
    with exact accumulation to batches of 4, scored per case and per region (whole tumour,
    tumour core, enhancing tumour), and masks predicted for 2 held-out cases in their own
    geometry. Returns the last epoch's mean Dice per region."""
    data = write_brats_like(out / "brats", n=cases)
    test = write_brats_like(out / "brats_test", n=2, seed=1)
    log(f"\n== BraTS-shaped: {data} (4 modalities per case, 1 x 1 x 2 mm voxels)")
    cfg = load_config(
        overrides=[
            f"data={data}",
            "task=segmentation",
            "arch=segresnet",
            "widths=8,16,32",
            "spacing=1,1,1",
            "size=32",
            "batch=4",
            "micro_batch=1",
            f"regions={BRATS_REGIONS}",
            f"epochs={epochs}",
            "lr=2e-3",
            "monitor=dice",
            "valid_pct=0.25",
            "schedule=cosine",
        ]
    )
    run_dir = out / "runs" / "brats"
    train_or_keep(cfg, run_dir, log)
    masks = predict_masks(run_dir, test, run_dir / "masks", tta=2)  # the CSV lists each case
    log(f"{len(masks)} predicted masks (in each input's geometry) in {run_dir / 'masks'}")
    with open(run_dir / "history.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    return {region: float(last[f"dice_{region}"]) for region in ("wt", "tc", "et")}


def run_clouds_demo(out: Path, epochs: int = 8, log: Any = print) -> dict[str, float]:
    """A Kaggle RLE competition end to end: generated images in Understanding Clouds' layout
    (``train.csv`` of ``Image_Label,EncodedPixels``, four classes that overlap), a U-Net from
    segmentation_models_pytorch on a timm encoder trained at full resolution with exact
    accumulation (micro-batches of 4 to batches of 8), the per-class thresholds and smallest
    components tuned on validation, and a submission for the test images at half size whose
    RLE is read back. Returns each class's tuned validation Dice and their mean."""
    from bigbatch.segmentation.rle import read_rle_csv
    from bigbatch.segmentation.synthetic import write_clouds_like
    from bigbatch.train.tasks.segmentation.submit import write_submission

    data = write_clouds_like(out / "clouds", n=96, height=64, width=96, n_test=8)
    log(f"\n== Kaggle RLE segmentation: {data / 'train.csv'} (4 overlapping classes)")
    cfg = load_config(
        overrides=[
            f"data={data / 'train.csv'}",
            f"image_root={data / 'train_images'}",
            "task=segmentation",
            "arch=unet",
            "encoder=resnet10t",
            "batch=8",
            "micro_batch=4",
            f"epochs={epochs}",
            "lr=3e-3",
            "valid_pct=0.25",
            "mask_size=32x48",
            "schedule=cosine",
        ]
    )
    run_dir = out / "runs" / "clouds"
    train_or_keep(cfg, run_dir, log)
    target, rows, note = write_submission(
        [run_dir], data / "test_images", run_dir / "submission.csv"
    )
    back = read_rle_csv(target)  # the submission reads back in the competition's layout
    log(
        f"submission: {rows} rows ({len(back.masks)} images x {len(back.classes)} classes), {note}: {target}"
    )
    rules = json.loads((run_dir / "postprocess.json").read_text())["classes"]
    dice = {name: float(rule["valid_dice"]) for name, rule in rules.items()}
    return dice | {"mean": sum(dice.values()) / len(dice)}
