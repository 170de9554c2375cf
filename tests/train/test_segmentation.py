"""task=segmentation end to end: 2D images and 3D volumes train, validate with Dice/Jaccard,
predict masks with the input's geometry, refuse bad input by name, and resume bit-identically."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_resume_mid_epoch import _train as train_in_subprocess

from bigbatch.cli.main import main
from bigbatch.segmentation.synthetic import write_blobs_3d, write_shapes_2d
from bigbatch.train.config import load_config
from bigbatch.train.data import DataError
from bigbatch.train.loop import train
from bigbatch.train.tasks.segmentation.data import scan_segmentation

COMMON = ["task=segmentation", "arch=unet", "num_workers=0", "threads=1", "device=cpu", "lr=3e-3"]


@pytest.mark.slow
def test_2d_trains_scores_and_predicts_masks_at_the_images_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_shapes_2d(tmp_path / "shapes", n=20, size=32)
    cfg = load_config(
        overrides=[f"data={data}", *COMMON, "size=32", "batch=8", "micro_batch=4", "epochs=2",
                   "monitor=dice", "schedule=plateau"]
    )  # fmt: skip
    result = train(cfg, tmp_path / "run", progress=False, log=lambda _: None)
    with open(tmp_path / "run" / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"valid_loss", "dice", "jaccard", "hd95", "dice_1", "dice_2"} <= set(rows[0])
    assert result.best_metric == max(float(r["dice"]) for r in rows)  # best by dice
    assert (tmp_path / "run" / "history.png").stat().st_size > 0
    assert json.loads((tmp_path / "run" / "task.json").read_text())["num_classes"] == 3

    # A test image of another size gets a mask of its own size, with the 3 classes' labels.
    from PIL import Image

    test = tmp_path / "test"
    test.mkdir()
    Image.fromarray(np.zeros((40, 48, 3), dtype=np.uint8)).save(test / "odd.png")
    assert main(["predict", str(tmp_path / "run"), str(test), "--tta", "2"]) == 0
    mask = np.asarray(Image.open(tmp_path / "run" / "masks" / "odd.png"))
    assert mask.shape == (40, 48) and set(np.unique(mask)) <= {0, 1, 2}
    assert main(["predict", str(tmp_path / "run"), str(test), "--patch", "16"]) == 2
    assert main(["predict", str(tmp_path / "run"), str(test), "--overlap", "0.25"]) == 2
    assert "--overlap is for volumes" in capsys.readouterr().err

    # An ensemble of two runs averages their probabilities into one mask per image.
    other = load_config(
        overrides=[f"data={data}", *COMMON, "size=32", "batch=8", "micro_batch=4", "epochs=1",
                   "seed=1"]
    )  # fmt: skip
    train(other, tmp_path / "run2", progress=False, log=lambda _: None)
    runs = [str(tmp_path / "run"), str(tmp_path / "run2")]
    # An --out that cannot be written is refused before any run predicts, as predict's is.
    (tmp_path / "a_file").write_text("")
    capsys.readouterr()
    assert main(["ensemble", *runs, "--images", str(test), "--out", str(tmp_path / "a_file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["ensemble", *runs, "--images", str(test), "--out", str(tmp_path / "ens")]) == 0
    averaged = np.asarray(Image.open(tmp_path / "ens" / "masks" / "odd.png"))
    assert averaged.shape == (40, 48) and set(np.unique(averaged)) <= {0, 1, 2}


@pytest.mark.slow
def test_3d_volumes_train_and_predict_npy_and_nifti(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trained with activation checkpointing; predicted as npy and NIfTI, whole and in
    windows, in the input's geometry."""
    import nibabel as nib

    data = write_blobs_3d(tmp_path / "blobs", n=6, size=16, channels=2)
    # Checkpointed in training (MONAI's U-Net blocks in torch's wrapper); its weights load into
    # the plain network that predict builds.
    cfg = load_config(
        overrides=[f"data={data}", *COMMON, "size=16", "batch=4", "micro_batch=2", "epochs=1",
                   "valid_pct=0.34", "grad_checkpointing=true"]
    )  # fmt: skip
    train(cfg, tmp_path / "run", progress=False, log=lambda _: None)
    info = json.loads((tmp_path / "run" / "task.json").read_text())
    assert (info["dims"], info["channels"], info["num_classes"]) == (3, 2, 1)

    test = tmp_path / "test"
    test.mkdir()
    volume = np.random.default_rng(0).normal(size=(2, 12, 20, 10)).astype(np.float32)
    np.save(test / "a.npy", volume)  # not a multiple of the U-Net's stride: padded, cropped back
    affine = np.diag([1.5, 1.5, 2.0, 1.0])
    nib.save(nib.Nifti1Image(volume[0], affine), str(test / "b.nii.gz"))
    # b holds one modality, but the run was trained on 2 channels: refused by name.
    assert main(["predict", str(tmp_path / "run"), str(test)]) == 2
    assert "b.nii.gz has 1 channel(s)" in capsys.readouterr().err
    (test / "b.nii.gz").unlink()
    # The same two modalities in one NIfTI, last (X, Y, Z, C), as the standard stores them; and
    # as ITK writes a vector image, (X, Y, Z, 1, C).
    last = np.moveaxis(volume, 0, -1)
    nib.save(nib.Nifti1Image(last, affine), str(test / "c.nii.gz"))
    nib.save(nib.Nifti1Image(last[:, :, :, None], affine), str(test / "d.nii.gz"))
    assert main(["predict", str(tmp_path / "run"), str(test), "--tta", "3"]) == 0
    mask = np.load(tmp_path / "run" / "masks" / "a.npy")
    assert mask.shape == (12, 20, 10) and set(np.unique(mask)) <= {0, 1}
    for name in ("c.nii.gz", "d.nii.gz"):
        nifti = nib.load(str(tmp_path / "run" / "masks" / name))
        assert nifti.shape == (12, 20, 10) and np.allclose(nifti.affine, affine)  # same geometry
        assert np.array_equal(np.asarray(nifti.dataobj), mask)  # the channels read as in a.npy

    # In overlapping 24^3 windows (another size than training's): the same geometry.
    windows = tmp_path / "windows"
    assert (
        main(["predict", str(tmp_path / "run"), str(test), "--patch", "24", "--out", str(windows)])
        == 0
    )
    assert np.load(windows / "a.npy").shape == (12, 20, 10)
    assert nib.load(str(windows / "c.nii.gz")).shape == (12, 20, 10)
    assert main(["predict", str(tmp_path / "run"), str(test), "--patch", "12"]) == 2
    assert "a multiple of 8, at least 16; try 16" in capsys.readouterr().err


TIGHT_UNET = """
import torch
from bigbatch.segmentation.models import UNet


class Tight(UNet):
    # As a GPU would: more than two training volumes at a time do not fit.
    def forward(self, x):
        if self.training and x.shape[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x)


def build(in_channels, num_classes):
    return Tight(in_channels, num_classes, dims=3, width=8)
"""


@pytest.mark.slow
def test_a_3d_run_out_of_memory_shrinks_its_micro_batch_and_keeps_the_update(
    tmp_path: Path,
) -> None:
    data = write_blobs_3d(tmp_path / "blobs", n=10, size=16, channels=1)
    factory = tmp_path / "tight.py"
    factory.write_text(TIGHT_UNET)

    def run(
        name: str, micro_batch: int, lr: str = "lr=3e-3"
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        cfg = load_config(
            overrides=[f"data={data}", *COMMON, f"model={factory}:build", "size=16", "batch=8",
                       f"micro_batch={micro_batch}", "epochs=2", "valid_pct=0.2", "optimizer=sgd",
                       lr]
        )  # fmt: skip
        train(cfg, tmp_path / name, progress=False, log=lambda _: None)
        with open(tmp_path / name / "history.csv") as f:
            micro = [row["micro_batch"] for row in csv.DictReader(f)]
        return load_file(tmp_path / name / "last.safetensors"), micro

    shrunk, micro = run("oom", 8)  # 8 -> 4 -> 2 on the first window
    assert micro == ["2", "2"]
    clean, _ = run("clean", 2)  # a clean start at the micro-batch it landed on
    for name, w in clean.items():  # the same micro-batches from the first window on: equal
        assert torch.equal(shrunk[name], w), name
    # The check can fail: halving the gradient (under SGD, halving the learning rate), what a
    # wrong normalisation of a window does, moves the weights far from equal.
    halved, _ = run("halved", 2, "lr=1.5e-3")
    assert max((halved[n] - w).abs().max().item() for n, w in clean.items()) > 1e-4


def _pair(root: Path, name: str, image: np.ndarray, mask: np.ndarray) -> None:
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(root / "images" / name)
    Image.fromarray(mask).save(root / "masks" / name)


def test_bad_input_is_refused_by_name_before_training(tmp_path: Path) -> None:
    img = np.zeros((16, 16, 3), dtype=np.uint8)
    ok = np.zeros((16, 16), dtype=np.uint8)

    _pair(tmp_path / "a", "x.png", img, ok)
    (tmp_path / "a" / "images" / "lonely.png").write_bytes(
        (tmp_path / "a" / "images" / "x.png").read_bytes()
    )
    with pytest.raises(DataError, match=r"lonely\.png has no mask"):
        scan_segmentation(tmp_path / "a")

    _pair(tmp_path / "b", "x.png", img, np.zeros((8, 16), dtype=np.uint8))
    with pytest.raises(DataError, match=r"mask .*x.png is \(8, 16\) but its image"):
        scan_segmentation(tmp_path / "b")

    _pair(tmp_path / "c", "x.png", img, np.full((16, 16), 3, dtype=np.uint8))
    with pytest.raises(DataError, match="label 3, outside num_classes=2"):
        scan_segmentation(tmp_path / "c", num_classes=2)

    _pair(tmp_path / "d", "x.png", img, ok)
    (tmp_path / "d" / "images" / "x.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"cannot read .*x\.png"):
        scan_segmentation(tmp_path / "d")

    import nibabel as nib

    e = tmp_path / "e"
    e.mkdir()
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.float32), np.eye(4)), str(e / "t1.nii.gz"))
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 6), np.float32), np.eye(4)), str(e / "t2.nii.gz"))
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.uint8), np.eye(4)), str(e / "seg.nii.gz"))
    (e / "cases.csv").write_text("image,mask\nt1.nii.gz;t2.nii.gz,seg.nii.gz\n")
    with pytest.raises(DataError, match=r"modalities of one case differ.*t2.nii.gz \(8, 8, 6\)"):
        scan_segmentation(e / "cases.csv")

    # Through the command line: one line naming the file, exit code 2, no run started.
    assert (
        main(["train", f"data={tmp_path / 'a'}", "task=segmentation", "--out", str(tmp_path / "r")])
        == 2
    )
    assert not (tmp_path / "r" / "last.pt").exists()


@pytest.mark.slow
def test_segmentation_resume_after_sigkill_mid_epoch_is_bit_identical(tmp_path: Path) -> None:
    write_shapes_2d(tmp_path / "shapes", n=20, size=16)
    keys = ["data=shapes", *COMMON, "size=16", "batch=4", "micro_batch=2", "epochs=2",
            "checkpoint_every=1"]  # fmt: skip
    full = train_in_subprocess(tmp_path, *keys, "--out", "full")
    assert full.returncode == 0, full.stderr[-2000:]
    killed = train_in_subprocess(tmp_path, *keys, "--out", "killed", KILL_AT="7")  # epoch 2
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = train_in_subprocess(tmp_path, "--resume", "killed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "in epoch 2 of 2" in resumed.stdout
    want = load_file(tmp_path / "full" / "last.safetensors")
    got = load_file(tmp_path / "killed" / "last.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "network", [["arch=resnet10t"], ["arch=fpn", "encoder=resnet10t"]], ids=["timm-name", "fpn"]
)
def test_a_timm_encoder_under_an_smp_decoder_trains(tmp_path: Path, network: list[str]) -> None:
    # arch=<timm name> is smp's U-Net on it; arch=fpn encoder=... its FPN (GroupNorm decoder).
    data = write_shapes_2d(tmp_path / "shapes", n=8, size=64)
    lines: list[str] = []
    cfg = load_config(
        overrides=[f"data={data}", *COMMON, *network, "size=64", "batch=4", "micro_batch=2",
                   "epochs=1"]
    )  # fmt: skip
    result = train(cfg, tmp_path / "run", progress=False, log=lines.append)
    assert "dice" in result.history[-1]
    assert any("BatchNorm layer(s)" in line for line in lines)  # the encoder's: said, with remedies
    assert main(["predict", str(tmp_path / "run"), str(data / "images"), "--tta", "1"]) == 0
