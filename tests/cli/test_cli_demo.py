"""`bigbatch demo`: the whole job on the bundled digits (one epoch here, to stay fast)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bigbatch.cli.main import main


# Builds and installs two packages and trains: minutes alone, several times that beside another
# job on the 2 cores (seen past pytest-timeout's default 300 s there).
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_wheel_installs_and_runs_the_demo_outside_the_checkout(tmp_path: Path) -> None:
    """.ci/install_check.sh: the wheel and sdist build (the sdist carries the tests), the wheel
    with [train] runs `bigbatch demo --epochs 1` from another folder, a core install's commands
    that need an extra exit 2 naming it. The demo's output is checked here."""
    root = Path(__file__).parents[2]
    done = subprocess.run(
        ["bash", str(root / ".ci" / "install_check.sh"), str(tmp_path)],
        capture_output=True, text=True, timeout=1400, env={**os.environ, "DEV_PYTHON": sys.executable},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "core install's commands that need an extra exit 2" in done.stdout
    out = (tmp_path / "demo.log").read_text()
    # Each member's budget is derived on this machine from the calibrated predictions (midway
    # between micro-batch 64 and 128) and covers the planner's calibration steps: 2 x 64,
    # calibrated at every size, wherever the test runs.
    assert out.count("plan: target batch 128 = 2 micro-batch(es) of 64") == 2 and "ensemble" in out
    assert "calibrated" not in out, out
    assert "/site-packages/bigbatch" in done.stdout  # the wheel's, not the checkout's
    submission = (tmp_path / "runs" / "submission.csv").read_text().splitlines()
    assert submission[0] == "image_id,label" and len(submission) == 1 + 197
    assert all(row.split(",")[1] in {str(d) for d in range(10)} for row in submission[1:])
    for member in ("resnet10t", "convnext"):
        assert (tmp_path / "runs" / member / "history.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two trainings, 2D and 3D: past 300 s beside another job
def test_segmentation_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--task", "segmentation", "--out", str(tmp_path), "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "validation Dice: 2d" in out and "3d" in out
    # Each budget is less than the whole batch needs (derived here, as for the digits): the plan
    # splits the batch. Into how many parts depends on this CPU's kernel workspaces.
    for batch in (32, 4):
        steps = re.search(rf"plan: target batch {batch} = (\d+) micro-batch", out)
        assert steps is not None and int(steps.group(1)) >= 2, out
    for run in ("dynunet2d", "dynunet3d"):
        assert (tmp_path / "runs" / run / "history.png").is_file()
        assert len(list((tmp_path / "runs" / run / "masks").iterdir())) == 4
    # A rerun keeps the finished runs; one with another option is refused, never answered with
    # the earlier runs.
    assert main(["demo", "--task", "segmentation", "--out", str(tmp_path), "--epochs", "1"]) == 0
    assert capsys.readouterr().out.count("finished earlier (1 epoch(s), best dice") == 2
    assert main(["demo", "--task", "segmentation", "--out", str(tmp_path), "--epochs", "2"]) == 2
    refused = capsys.readouterr()
    assert "different config (epochs: 1 -> 2); choose another --out folder" in refused.err
    assert "finished earlier" not in refused.out


@pytest.mark.slow
def test_brats_demo_trains_at_micro_batch_1_and_scores_each_region(tmp_path: Path) -> None:
    import nibabel as nib

    from bigbatch.train.demo import run_brats_demo

    lines: list[str] = []
    dice = run_brats_demo(tmp_path, epochs=1, log=lines.append, cases=6)
    assert set(dice) == {"wt", "tc", "et"}
    assert any("micro-batch 1" in line for line in lines)
    history = (tmp_path / "runs" / "brats" / "history.csv").read_text().splitlines()[0]
    assert {"dice_wt", "dice_tc", "dice_et", "hd95"} <= set(history.split(","))
    masks = sorted((tmp_path / "runs" / "brats" / "masks").rglob("*.nii.gz"))
    assert [m.name for m in masks] == ["case_000.nii.gz", "case_001.nii.gz"]
    source = nib.load(str(tmp_path / "brats_test" / "cases" / "case_000" / "case_000_t1.nii.gz"))
    written = nib.load(str(masks[0]))
    assert written.shape == source.shape and (written.affine == source.affine).all()


def test_brats_demo_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import bigbatch.train.demo

    seen = {}

    def fake(out: Path, epochs: int) -> dict[str, float]:
        seen["epochs"] = epochs
        return {"wt": 0.9, "tc": 0.8, "et": 0.7}

    monkeypatch.setattr(bigbatch.train.demo, "run_brats_demo", fake)
    assert main(["demo", "--task", "brats", "--out", str(tmp_path)]) == 0
    assert seen["epochs"] == 10  # brats' own default
    assert "wt 0.900, tc 0.800, et 0.700" in capsys.readouterr().out


@pytest.mark.slow
def test_clouds_demo_from_csv_to_submission(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("albumentations")
    from bigbatch.segmentation.rle import read_rle_csv

    assert main(["demo", "--task", "clouds", "--epochs", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "validation Dice per class with the tuned rules" in out
    run = tmp_path / "runs" / "clouds"
    submission = read_rle_csv(run / "submission.csv")
    assert submission.layout == "image_label" and len(submission.masks) == 8
    assert submission.classes == ["Fish", "Flower", "Gravel", "Sugar"]
    header = (run / "history.csv").read_text().splitlines()[0].split(",")
    assert {"dice_Fish", "dice_Sugar"} <= set(header)
