"""Decoding and augmenting training images on the device (``decode=gpu``, and ``auto``'s measured
choice), simulated on the CPU: torchvision decodes JPEG there too, through the same calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import bigbatch.train.decode_choice as decode_choice_module
import bigbatch.train.tasks.device_images as device_images
from bigbatch.train.config import ConfigError, load_config
from bigbatch.train.data import SeededSamples
from bigbatch.train.decode_choice import DecodeChoice, decode_choice
from bigbatch.train.loop import train
from bigbatch.train.tasks import task_for
from bigbatch.train.tasks.device_images import DeviceAugment, EncodedImages, collate_encoded
from bigbatch.train.tasks.images import ImageDataset, build_transforms
from tiny_runs import CLASSES, base_overrides

CPU = torch.device("cpu")


def photos(folder: Path, n: int = 4, grey: bool = False) -> list[Path]:
    """JPEGs of different sizes with smooth content (JPEG's round-off stays small), one PNG."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for k in range(n):
        small = rng.integers(0, 255, (6, 8) if grey else (6, 8, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((80 + 8 * k, 60 + 4 * k), Image.BILINEAR)
        files.append(folder / f"{k}.jpg")
        image.save(files[-1], quality=95)
    image.save(folder / "last.png")
    return [*files, folder / "last.png"]


def levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image, the largest difference in 8-bit levels (the normalisation undone)."""
    std = torch.tensor([0.229, 0.224, 0.225][: a.shape[1]]).view(1, -1, 1, 1)
    return ((a - b).abs() * std * 255).amax(dim=(1, 2, 3))


def both_paths(files: list[Path], seeds: list[int], grey: bool = False) -> tuple[Any, Any]:
    channels = 1 if grey else 3
    from bigbatch.train.tasks.images import ImageFormat

    fmt = ImageFormat(grey=grey)
    data = {"mean": (0.485, 0.456, 0.406)[:channels], "std": (0.229, 0.224, 0.225)[:channels]}
    data |= {"interpolation": "bilinear", "crop_pct": 0.875}
    transform = build_transforms(32, "squish", train=True, augment=True, data=data, fmt=fmt)
    cpu = SeededSamples(ImageDataset(files, list(range(len(files))), transform, fmt))
    gpu = SeededSamples(EncodedImages(files, list(range(len(files))), grey=grey))
    augment = DeviceAugment(32, channels, mean=data["mean"], std=data["std"]).on(CPU)
    keys = list(zip(seeds, range(len(files)), strict=True))
    on_cpu = torch.stack([cpu[k][0] for k in keys])
    on_device, targets = augment(collate_encoded([gpu[k] for k in keys]))
    assert targets.tolist() == list(range(len(files)))
    return on_cpu, on_device


@pytest.mark.parametrize("grey", [False, True])
def test_the_device_path_draws_the_cpu_paths_crops_and_flips(tmp_path: Path, grey: bool) -> None:
    """A seeded sample gets the same random crop and flip from both paths: the pixels differ by
    at most one 8-bit level (decoding and resampling round-off). Negative control: the CPU path
    with other seeds (other crops) is tens of levels away."""
    files = photos(tmp_path, grey=grey)
    seeds = [1000 + i for i in range(len(files))]
    on_cpu, on_device = both_paths(files, seeds, grey)
    assert on_device.shape == on_cpu.shape == (len(files), 1 if grey else 3, 32, 32)
    assert levels(on_cpu, on_device).max() <= 1.0 + 1e-3
    other_cpu, _ = both_paths(files, [7 + i for i in range(len(files))], grey)
    assert levels(on_cpu, other_cpu).min() > 10


def test_photos_the_gpu_cannot_decode_as_stored_are_decoded_by_the_worker(tmp_path: Path) -> None:
    """A photo with an EXIF rotation, a PNG and a greyscale JPEG in a colour set are decoded by
    the worker (upright, as colour); plain colour JPEGs go to the device as bytes."""
    files = photos(tmp_path)
    rotated = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: stored 80 x 60, seen 60 x 80
    Image.open(files[0]).save(rotated, exif=exif)
    grey = tmp_path / "grey.jpg"
    Image.open(files[0]).convert("L").save(grey)
    images = EncodedImages([files[0], rotated, files[-1], grey], [0, 1, 2, 3])
    samples = [images[i] for i in range(4)]
    assert [s[1] for s in samples] == [True, False, False, False]
    assert samples[1][2] == (80, 60) and tuple(samples[1][0].shape) == (3, 80, 60)
    assert samples[3][0].shape[0] == 3
    x, _ = DeviceAugment(32).on(CPU)(collate_encoded(samples))
    assert x.shape == (4, 3, 32, 32) and torch.isfinite(x).all()


def test_a_window_travels_from_the_worker_as_one_tensor(tmp_path: Path) -> None:
    """A worker hands each tensor over through shared memory of its own: a window's payloads
    come as one flat tensor, and each sample's is a view of it, the file's bytes or the
    worker's pixels exactly."""
    from bigbatch.train.data import make_loader

    files = photos(tmp_path, n=3)
    images = EncodedImages(files, [0] * 4)
    loader = make_loader(
        images, 4, shuffle=False, seed=0, num_workers=1, collate_fn=collate_encoded
    )
    (batch,) = list(loader)
    assert batch.data.dim() == 1 and batch.data.dtype == torch.uint8
    assert batch.encoded == [True, True, True, False] and len(batch) == 4
    for k in range(3):
        assert bytes(batch.payload(k).numpy()) == files[k].read_bytes()
        assert (
            batch.payload(k).untyped_storage().data_ptr() == batch.data.untyped_storage().data_ptr()
        )
    assert torch.equal(batch.payload(3), images[3][0])


def test_large_windows_are_decoded_in_groups_and_a_failed_batch_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window's JPEGs are decoded in groups under the byte limit (never all of a window of
    large photos at once), and a batched decode that fails is done image by image on the CPU:
    the pixels are the same either way."""
    import torchvision.io

    files = photos(tmp_path, n=5)
    batch = collate_encoded([EncodedImages(files, [0] * 6)[i] for i in range(6)])
    whole = dict(device_images.decode_on(batch, CPU))
    calls: list[int] = []
    real = torchvision.io.decode_jpeg

    def counting(data: Any, **kwargs: Any) -> Any:
        calls.append(len(data) if isinstance(data, list) else 1)
        return real(data, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", counting)
    monkeypatch.setattr(device_images, "DECODE_GROUP_BYTES", 30_000)  # 2, 2 and 1 photos
    grouped = dict(device_images.decode_on(batch, CPU))
    assert calls == [2, 2, 1]
    assert whole.keys() == grouped.keys() == set(range(6))
    assert all(torch.equal(whole[k], grouped[k]) for k in whole)

    def fails_batched(data: Any, **kwargs: Any) -> Any:
        if isinstance(data, list):
            raise RuntimeError("nvjpeg: unsupported JPEG")
        return real(data, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", fails_batched)
    fallback = dict(device_images.decode_on(batch, CPU))
    assert all(torch.equal(whole[k], fallback[k]) for k in whole)


def jpeg_folder(root: Path, n_per_class: int = 8) -> Path:
    rng = np.random.default_rng(0)
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(n_per_class):
            pixels = rng.integers(0, 80, (4, 4, 3))
            pixels[..., c] += 150
            image = Image.fromarray(pixels.astype(np.uint8)).resize((24, 20), Image.BILINEAR)
            image.save(root / name / f"{i}.jpg", quality=95)
    return root


def test_decode_gpu_says_where_it_cannot_apply(tmp_path: Path, tiny_model: str) -> None:
    """decode=gpu on a device without a JPEG decoder, under torchrun, or with images or
    augmentation the device path does not do: one line each, with the fix."""
    data = jpeg_folder(tmp_path / "train")
    cases = [
        ([], CPU, 1, "cpu has no JPEG decoder"),
        ([], torch.device("cuda"), 2, "under torchrun"),
        (["augment=false"], torch.device("cuda"), 1, "augment=false"),
        (["auto_augment=rand-m9-mstd0.5"], torch.device("cuda"), 1, "auto_augment"),
    ]
    for extra, device, world, why in cases:
        cfg = load_config(overrides=[*base_overrides(data, tiny_model), "decode=gpu", *extra])
        task = task_for(cfg)
        train_items, valid_items = task.prepare(lambda _: None)
        train_ds, _ = task.datasets(train_items, valid_items)
        with pytest.raises(ConfigError, match=f"decode=gpu cannot apply: .*{why}.*decode=auto"):
            decode_choice(cfg, task, train_ds, device, world, print)
        auto = cfg.__class__(**{**cfg.__dict__, "decode": "auto"})
        assert not decode_choice(auto, task, train_ds, device, world, print).pending


def test_auto_switches_to_the_device_where_its_expected_rate_beats_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The choice from the measured figures: the step and the decoding share the device (their
    times add), the workers' rate is what they delivered; the device path must beat it by the
    margin. Each outcome is said with its figures."""
    lines: list[str] = []
    choice = DecodeChoice(CPU, pending=True, log=lines.append)
    monkeypatch.setattr(DecodeChoice, "decode_seconds", lambda self: 1 / 3000)
    choice.choose(cpu_rate=800.0, step_seconds=1 / 4000)  # the GPU path: 1714 images/s
    assert choice.on_device and not choice.pending
    assert "decoded on the GPU from the next epoch" in lines[-1] and "1714 images/s" in lines[-1]
    choice = DecodeChoice(CPU, pending=True, log=lines.append)
    choice.choose(cpu_rate=1600.0, step_seconds=1 / 4000)  # 1714 < 1.1 x 1600
    assert not choice.on_device and "stay with the CPU workers" in lines[-1]
    assert "so about 1714 images/s on the GPU" in lines[-1]

    def not_started(self: DecodeChoice) -> float:
        raise AssertionError("the decoder was timed where the workers kept up")

    monkeypatch.setattr(DecodeChoice, "decode_seconds", not_started)
    choice = DecodeChoice(CPU, pending=True, log=lines.append)
    choice.choose(cpu_rate=2470.0, step_seconds=1 / 2526)  # the H100's resnet50 at 256 px
    assert not choice.on_device and "the workers keep up" in lines[-1]


def test_the_gpu_paths_first_epoch_is_judged_against_the_workers() -> None:
    """auto's switch is a trial: the GPU path's first epoch is measured as the workers' was,
    and the run goes back to them where it took windows more slowly."""
    lines: list[str] = []
    choice = DecodeChoice(CPU, on_device=True, trial=True, cpu_rate=1508.0, log=lines.append)
    choice.epochs = 3
    assert choice.measures(1) and not choice.measures(2)  # the last epoch is not measured
    choice.judge(1400.0)  # the H100's ViT-B: the estimate said 1660
    assert not choice.on_device and not choice.trial and not choice.measures(1)
    assert lines[-1] == (
        "decode: JPEGs go back to the CPU workers from the next epoch "
        "(1400 images/s on the GPU, 1508 from the CPU workers)"
    )
    choice = DecodeChoice(CPU, on_device=True, trial=True, cpu_rate=500.0, log=lines.append)
    choice.judge(720.0)
    assert choice.on_device and not choice.trial
    assert (
        lines[-1]
        == "decode: JPEGs stay on the GPU (720 images/s on the GPU, 500 from the CPU workers)"
    )


def test_auto_goes_back_to_the_workers_where_the_gpu_epoch_was_slower(
    tmp_path: Path, tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end (the device simulated by the CPU): epoch 1 on the workers switches, epoch 2
    on the device is judged slower (the workers' rate set beyond reach), epoch 3 is the
    workers' again, its loader made anew; the losses follow the CPU path's throughout."""
    data = jpeg_folder(tmp_path / "train")
    monkeypatch.setattr(decode_choice_module, "decodes_jpeg", lambda device: True)
    monkeypatch.setattr(decode_choice_module, "MARGIN", 0.0)
    choose = DecodeChoice.choose

    def unbeatable_workers(self: DecodeChoice, cpu_rate: float, step_seconds: float) -> None:
        choose(self, cpu_rate, step_seconds)
        self.cpu_rate = float("inf")

    monkeypatch.setattr(DecodeChoice, "choose", unbeatable_workers)
    base = [*base_overrides(data, tiny_model), "valid_pct=0", "epochs=3", "num_workers=1",
            "batch=6", "micro_batch=3"]  # fmt: skip
    runs = {}
    lines: list[str] = []
    for decode in ("cpu", "auto"):
        cfg = load_config(overrides=[*base, f"decode={decode}"])
        log = lines.append if decode == "auto" else print
        history = train(cfg, tmp_path / decode, log=log).history
        runs[decode] = [r["train_loss"] for r in history]
    said = [line for line in lines if line.startswith("decode:")]
    assert len(said) == 2 and "decoded on the GPU from the next epoch" in said[0]
    assert "go back to the CPU workers from the next epoch" in said[1]
    np.testing.assert_allclose(runs["auto"], runs["cpu"], rtol=1e-3)


@pytest.mark.slow
def test_auto_measures_the_first_epoch_then_trains_on_the_device(
    tmp_path: Path, tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end (the device simulated by the CPU): decode=auto measures epoch 1 with the
    workers and, where the device path wins, epoch 2 decodes there; its loss is the CPU path's
    up to round-off. decode=gpu decodes there from the start."""
    data = jpeg_folder(tmp_path / "train")
    monkeypatch.setattr(decode_choice_module, "decodes_jpeg", lambda device: True)
    monkeypatch.setattr(decode_choice_module, "MARGIN", 0.0)  # the device path always wins
    # One worker: each sample's draws seeded by (seed, index), as on a GPU machine. Windows of
    # 6: an epoch measures from its second window's arrival on.
    base = [*base_overrides(data, tiny_model), "valid_pct=0", "epochs=2", "num_workers=1",
            "batch=6", "micro_batch=3"]  # fmt: skip
    runs, said = {}, {}
    for decode in ("cpu", "auto", "gpu"):
        lines: list[str] = []
        cfg = load_config(overrides=[*base, f"decode={decode}"])
        runs[decode] = [
            r["train_loss"] for r in train(cfg, tmp_path / decode, log=lines.append).history
        ]
        said[decode] = [line for line in lines if line.startswith("decode:")]
    assert not said["cpu"] and not said["gpu"]
    one_epoch = load_config(overrides=[*base, "decode=auto", "epochs=1"])
    lines = []
    train(one_epoch, tmp_path / "one", log=lines.append)
    assert not [line for line in lines if line.startswith("decode:")]  # nothing left to use it
    assert len(said["auto"]) == 1 and "decoded on the GPU from the next epoch" in said["auto"][0]
    np.testing.assert_allclose(runs["gpu"], runs["cpu"], rtol=1e-3)  # the same crops and flips
    assert runs["auto"][0] == runs["cpu"][0]  # epoch 1: the workers' path, measured


@pytest.mark.slow  # a subprocess with loader workers: about 10 s
def test_the_handover_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/encoded_handover.py, tiny: both handovers measured, the ratios printed (no
    figure asserted: they are the machine's)."""
    root = Path(__file__).resolve().parents[2]
    args = ["--images", "32", "--side", "64", "--batch", "8", "--workers", "1", "--epochs", "1"]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "encoded_handover.py"), *args, "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(root / "src"), TMPDIR=str(tmp_path)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert set(result["per_window"]) == {"one_tensor", "per_sample"}
    assert result["process_cpu_ratio"] > 0 and result["wall_ratio"] > 0
