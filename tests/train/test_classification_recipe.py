"""Classification a Kaggle practitioner would choose: images as stored (16-bit, DICOM), the
model's own data config, torchmetrics' metrics in monitor=, class weights, Mixup over the window."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from bigbatch.images import UnreadableImageError, probe, read_pixels
from bigbatch.train.config import load_config
from bigbatch.train.loop import train
from bigbatch.train.tasks.classification.metrics import ClassificationMetrics
from tiny_runs import base_overrides, write_images


def quiet(_: str) -> None:
    pass


def write_16bit(folder: Path, n: int = 12, size: int = 16) -> Path:
    """Two classes that differ only above 255: 8-bit clipping makes them identical."""
    rng = np.random.default_rng(0)
    for name, low in (("dim", 1000), ("bright", 3000)):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = rng.integers(low, low + 1000, (size, size)).astype(np.uint16)
            Image.fromarray(pixels).save(folder / name / f"{name}_{i}.png")
    return folder


def test_16_bit_images_are_read_without_clipping_and_16_bit_colour_is_refused(
    tmp_path: Path,
) -> None:
    write_16bit(tmp_path / "d", n=1)
    path = tmp_path / "d" / "bright" / "bright_0.png"
    info = probe(path)
    assert (info.grey, info.depth) == (True, "high") and 3000 <= info.peak < 4000
    pixels = read_pixels(path, scale=4095.0, grey=True)
    raw = np.asarray(Image.open(path), dtype=np.float32) / 4095.0
    assert pixels.shape == (1, 16, 16) and np.array_equal(pixels[0], raw)  # not 255 / 255
    # A 16-bit colour PNG: PIL would read it as 8-bit, silently.
    rgb16 = tmp_path / "rgb16.png"
    png = (
        b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dIHDR" + (1).to_bytes(4, "big") * 2 + bytes([16, 2, 0, 0, 0])
    )  # fmt: skip
    rgb16.write_bytes(png + b"\x00" * 8)
    with pytest.raises(UnreadableImageError, match="16-bit colour PNG"):
        probe(rgb16)


@pytest.mark.slow
def test_two_classes_that_differ_only_above_255_train_to_high_accuracy(
    tmp_path: Path, tiny_model: str
) -> None:
    data = write_16bit(tmp_path / "xray", n=16)
    lines: list[str] = []
    cfg = load_config(overrides=[*base_overrides(data, tiny_model), "epochs=4", "lr=0.05",
                                 "valid_pct=0.25", "batch=8"])  # fmt: skip
    result = train(cfg, tmp_path / "run", log=lines.append, progress=False)
    assert any("read as floats (/4095)" in line for line in lines), lines
    # Clipped at 255 (PIL's convert("RGB")), both classes are white: accuracy 0.5 at best.
    assert result.history[-1]["accuracy"] >= 0.9, result.history
    info = json.loads((tmp_path / "run" / "task.json").read_text())
    # A model= factory builds its own 3-channel stem: the grey values are repeated.
    assert info["format"] == {"grey": False, "wide": True, "scale": 4095.0, "window": None}


def test_greyscale_data_gives_a_timm_model_one_input_channel(tmp_path: Path) -> None:
    from bigbatch.train.tasks.classification.task import ClassificationTask

    data = write_16bit(tmp_path / "xray", n=2)
    cfg = load_config(overrides=[f"data={data}", "arch=resnet10t", "size=16", "valid_pct=0.5"])
    task = ClassificationTask(cfg)
    task.prepare(quiet)
    assert task.format.channels == 1 and task.input_shape() == (1, 16, 16)
    assert task.model_factory()().conv1[0].in_channels == 1


def _dicom(path: Path, *, window: bool) -> np.ndarray:
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.SOPClassUID, ds.SOPInstanceUID = SecondaryCaptureImageStorage, generate_uid()
    ds.Rows = ds.Columns = 8
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    stored = (np.arange(64).reshape(8, 8) * 64).astype(np.uint16)  # 0 .. 4032: 12-bit
    ds.PixelData = stored.tobytes()
    ds.RescaleSlope, ds.RescaleIntercept = 1, -1024  # CT: stored values to Hounsfield units
    if window:
        ds.WindowCenter, ds.WindowWidth = 40, 400
    ds.save_as(str(path), enforce_file_format=True)
    return stored


def test_a_12_bit_dicom_is_pydicoms_rescaled_and_windowed_array(tmp_path: Path) -> None:
    import pydicom
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    for window in (False, True):
        path = tmp_path / f"ct_{window}.dcm"
        _dicom(path, window=window)
        ds = pydicom.dcmread(str(path))
        hu = apply_modality_lut(ds.pixel_array, ds)
        if window:
            out = apply_voi_lut(hu, ds)
            low, high = apply_voi_lut(np.array([-1e12, 1e12]), ds)
        else:
            out, (low, high) = hu, apply_modality_lut(np.array([0, 4095]), ds)
        expected = ((out - low) / (high - low)).astype(np.float32)
        got = read_pixels(path, grey=True)
        assert got.shape == (1, 8, 8) and np.allclose(got[0], expected, rtol=0, atol=1e-6)
        assert probe(path).depth == "dicom"
    # window= overrides the header's: soft tissue (40, 400) against bone (500, 2000).
    bone = read_pixels(tmp_path / "ct_True.dcm", grey=True, window=(500.0, 2000.0))
    assert not np.allclose(bone, read_pixels(tmp_path / "ct_True.dcm", grey=True))


def test_f1_macro_and_kappa_match_scikit_learn() -> None:
    from sklearn.metrics import cohen_kappa_score, f1_score, roc_auc_score

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(60, 4, generator=g)
    targets = torch.randint(0, 4, (60,), generator=g)
    m = ClassificationMetrics(classes=["a", "b", "c", "d"])
    for lo, t in zip(logits.split([7, 30, 23]), targets.split([7, 30, 23]), strict=True):
        m.update(lo, t)
    row = m.as_dict()
    pred = logits.argmax(1).numpy()
    assert row["f1_macro"] == pytest.approx(f1_score(targets, pred, average="macro"), abs=1e-6)
    assert row["f1_micro"] == pytest.approx(f1_score(targets, pred, average="micro"), abs=1e-6)
    kappa = cohen_kappa_score(targets, pred, weights="quadratic")
    assert row["kappa"] == pytest.approx(kappa, abs=1e-6)
    auroc = roc_auc_score(targets, logits.softmax(1).numpy(), multi_class="ovr", average="macro")
    assert row["auroc"] == pytest.approx(auroc, abs=1e-6)
    assert {"recall_a", "recall_d"} <= set(row)


@pytest.mark.parametrize("monitor", ["f1_macro", "kappa"])
def test_monitor_picks_the_best_epoch_by_a_kaggle_metric(
    monitor: str, image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    cfg = load_config(overrides=[*base_overrides(image_folder, tiny_model), "epochs=3",
                                 f"monitor={monitor}", "class_weights=auto"])  # fmt: skip
    result = train(cfg, tmp_path / "run", log=quiet, progress=False)
    with open(tmp_path / "run" / "history.csv") as f:
        rows = list(csv.DictReader(f))
    best = max(float(r[monitor]) for r in rows)
    assert result.best_metric == pytest.approx(best)
    assert {"f1_macro", "kappa", "auroc", "recall_red"} <= set(rows[0])


def test_class_weights_are_a_per_sample_mean_so_accumulation_stays_exact() -> None:
    from bigbatch.train.tasks.classification.task import ClassificationTask

    cfg = load_config(overrides=["data=x", "class_weights=auto", "label_smoothing=0.1"])
    task = ClassificationTask(cfg)
    task.classes, task.class_weights = ["a", "b"], torch.tensor([0.5, 2.0])
    logits = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 0, 0, 0, 1, 1])
    whole = task.loss(logits, y)
    parts = [task.loss(logits[:1], y[:1]), task.loss(logits[1:], y[1:])]
    # Each micro-batch weighted by its number of samples gives the window's loss exactly.
    assert whole.dtype == torch.float64  # float64 logits keep their precision in the loss
    assert float(((parts[0] * 1 + parts[1] * 5) / 6 - whole).abs()) <= 1e-12 * float(whole)
    # torch's weighted mean (divided by each batch's summed weights) fails the same check: 2.2 %
    # off at these logits (seeded: 39 of 2000 draws fall within 1e-3 by chance).
    weight = task.class_weights.double()

    def torch_mean(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z, t, weight=weight, label_smoothing=0.1)

    split = (torch_mean(logits[:1], y[:1]) * 1 + torch_mean(logits[1:], y[1:]) * 5) / 6
    window = torch_mean(logits, y)
    assert float((split - window).abs()) > 1e-3 * float(window)


def test_mixup_mixes_the_whole_window_before_it_is_split(
    image_folder: Path, tiny_model: str
) -> None:
    from bigbatch.train.tasks.classification.task import ClassificationTask

    cfg = load_config(overrides=[*base_overrides(image_folder, tiny_model), "mixup=0.4"])
    task = ClassificationTask(cfg)
    task.classes = ["a", "b", "c"]
    x, y = torch.randn(7, 3, 4, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0])
    torch.manual_seed(0)
    mixed, soft = task.transform_window((x, y))
    torch.manual_seed(0)
    again, _ = task.transform_window((x, y))
    assert torch.equal(mixed, again)  # replayable from torch's seed
    assert soft.shape == (7, 3) and torch.allclose(soft.sum(1), torch.ones(7))
    assert torch.equal(mixed[6], x[6])  # an odd last sample stays as it is
    # Mixing pairs sample i with sample n-1-i of the window: across micro-batches, as the big
    # batch would (a micro-batch of 2 cannot pair sample 0 with sample 5).
    assert not torch.equal(mixed[0], x[0])


@pytest.mark.slow
def test_pretrained_vit_trains_with_its_own_mean_and_std(tmp_path: Path) -> None:
    import timm

    from helpers import write_hub_cache

    name = "vit_tiny_patch16_224.augreg_in21k"
    weights = timm.create_model(name, num_classes=21843).state_dict()
    write_hub_cache(tmp_path / "hub", f"timm/{name}", weights)
    write_images(tmp_path / "data", n_per_class=4, size=32)
    script = textwrap.dedent(
        f"""
        from bigbatch.train.config import load_config
        from bigbatch.train.loop import train
        cfg = load_config(overrides=["data={tmp_path / "data"}", "arch={name}", "pretrained=true",
            "size=32", "batch=4", "epochs=1", "freeze_epochs=0", "device=cpu", "num_workers=0"])
        train(cfg, "{tmp_path / "run"}", log=lambda _: None, progress=False)
        """
    )
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    env.pop("HF_HOME", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "run" / "task.json").read_text())["data"]
    assert data["mean"] == [0.5, 0.5, 0.5] and data["std"] == [0.5, 0.5, 0.5]  # not ImageNet's
    assert data["interpolation"] == "bicubic"


def test_ema_weights_are_validated_and_saved(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    cfg = load_config(overrides=[*base_overrides(image_folder, tiny_model), "ema=0.5"])
    train(cfg, tmp_path / "run", log=quiet, progress=False)
    saved = load_file(tmp_path / "run" / "last.safetensors")
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    for name, w in saved.items():
        assert torch.equal(w, state["ema"][name]), name  # the average is what is saved ...
    assert any(not torch.equal(w, state["model"][n]) for n, w in saved.items())  # ... not the raw
