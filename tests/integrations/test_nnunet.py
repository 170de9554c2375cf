"""nnU-Net v2 with exact micro-batches, on a CPU, through nnU-Net's own planning, preprocessing,
training and validation of a tiny generated dataset (a few 3D cases, two labels). Each scenario
runs in its own process (``nnunet_scenarios.py``): nnU-Net reads its folders from the
environment when first imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nnunetv2")
nib = pytest.importorskip("nibabel")

SCENARIOS = Path(__file__).with_name("nnunet_scenarios.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env |= {f"nnUNet_{n}": str(root / n) for n in ("raw", "preprocessed", "results")}
    env["nnUNet_n_proc_DA"] = "1"  # one augmentation worker: CI has two cores
    return env


def _run(root: Path, *argv: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env=_env(root) | env,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _fails(root: Path, *argv: str) -> str:
    """A command refused: exit status 2 and one line, no traceback (also none from nnU-Net's
    data workers); that line."""
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=_env(root), timeout=300
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset through nnU-Net's fingerprint, planner and preprocessing (3d_fullres)."""
    root = tmp_path_factory.mktemp("nnunet")
    _run(root, str(SCENARIOS), str(root), "prepare")
    return root


def test_the_trainers_update_is_nnunets_own_batch_update(root: Path) -> None:
    """In float64, with and without batch_dice, with deep supervision (nnU-Net's planned
    network at a quarter of its width, for time): micro-batches of 1 and
    an uneven 2 + 1 give nnU-Net's own gradient to 1e-12, and its own optimizer's steps;
    ``loss / N`` does not. nnU-Net's Dice
    sums in float32 whatever its inputs: as shipped, the split is judged against the round-off
    of nnU-Net's own update (its float32 sums against float64)."""
    out = json.loads(_run(root, str(SCENARIOS), str(root), "exact").strip().splitlines()[-1])
    for plan in ("sample_dice", "batch_dice"):
        assert out[plan]["micro_1"] < 1e-12 and out[plan]["micro_2"] < 1e-12, out[plan]
        assert out[plan]["naive_2"] > 1e-4, out[plan]  # loss / N: not the batch's update
    # An ignore label held unevenly: the cross-entropy, a mean over the voxels not ignored,
    # weighed by their share; weighed by samples alone (the control), the update is not the
    # batch's. With batch_dice, gradient caching runs nnU-Net's loss on the whole batch.
    for plan in ("ignore_sample_dice", "ignore_batch_dice"):
        row = out[plan]
        assert row["micro_1"] < 1e-12 and row["micro_2"] < 1e-12, (plan, row)
        assert row["naive_2"] > 1e-4, (plan, row)
    assert out["ignore_sample_dice"]["samples_2"] > 1e-4, out["ignore_sample_dice"]
    # And three steps of nnU-Net's optimizer, clipping active, with the ignore label: every
    # parameter, and the same ones left without a gradient; both controls miss.
    row = out["steps_ignore_sample_dice"]
    assert row["steps"] == 3 and min(row["grad_norms"]) > 11.9, row
    assert row["no_grad_params"] == 2, row
    for name in ("micro_1", "micro_2"):
        assert row[name] < 1e-12 and row[f"{name}_same_none_grads"], (name, row)
    assert row["naive_2"] > 1e-4 and row["samples_2"] > 1e-4, row
    shipped = out["sample_dice_float32_sums"]
    assert shipped["micro_2"] <= 100 * shipped["own_round_off"], shipped
    assert shipped["naive_2"] >= 1e4 * shipped["own_round_off"], shipped
    # Three steps of nnU-Net's own optimizer (SGD, Nesterov, weight decay), clipping at 12
    # active, against nnU-Net's own train_step: every parameter to 1e-12, and the same weights
    # without a gradient at every step (deep supervision's unused output: gradient caching
    # gave them zeros, which weight decay and momentum then moved).
    for plan in ("steps_sample_dice", "steps_batch_dice"):
        row = out[plan]
        assert row["steps"] == 3 and min(row["grad_norms"]) > 11.9, row  # clipped each step
        assert row["no_grad_params"] == 2, row  # seg_layers.0's weight and bias
        for name in ("micro_1", "micro_2"):
            assert row[name] < 1e-12 and row[f"{name}_same_none_grads"], (plan, name, row)
        assert row["naive_2"] > 1e-4, row  # loss / N


def test_nnunets_step_is_predicted_as_this_cpu_runs_it(root: Path) -> None:
    """The planner's prediction of nnU-Net's own step (its network, deep supervision, DC+CE,
    SGD with momentum) at its batch, against the measured peak of that step on this CPU: within
    the CPU benchmark's accuracy (benchmarks/memory_accuracy.py)."""
    out = json.loads(_run(root, str(SCENARIOS), str(root), "memory").strip().splitlines()[-1])
    assert abs(out["predicted"] - out["measured"]) <= 0.03 * out["measured"], out


def test_bigbatchs_planner_sizes_the_plan_by_the_prediction(root: Path) -> None:
    """nnUNetPlannerBigBatch writes its plans beside nnU-Net's: the same network and patch here
    (the patch is the whole image), its batch what the prediction fits (capped, as nnU-Net's,
    at 5 % of the dataset)."""
    folder = root / "preprocessed" / "Dataset987_Example"
    ours = json.loads((folder / "nnUNetBigBatchPlans.json").read_text())["configurations"]
    theirs = json.loads((folder / "nnUNetPlans.json").read_text())["configurations"]
    for name in ("2d", "3d_fullres"):
        assert ours[name]["patch_size"] == theirs[name]["patch_size"]
        assert ours[name]["batch_size"] >= 2
    # Every chosen batch fits by the predictor's own figure (the batch was extrapolated from
    # batches 1 and 2: an 8 GB plan's 2d batch of 183 was predicted at 9.97 GiB of 6.02).
    out = json.loads(_run(root, str(SCENARIOS), str(root), "planner_fits").strip().splitlines()[-1])
    for name in ("2d", "3d_fullres"):
        assert out[name]["peak"] <= out["usable"], (name, out)
    # A split batch-Dice plan leaves room for the whole batch's outputs and their gradients.
    assert out["cache"]["held"] >= out["cache"]["outputs_and_gradients"], out["cache"]


def test_bigbatch_nnunet_plans_and_trains_under_a_budget(root: Path) -> None:
    """``bigbatch nnunet plan`` predicts each configuration's peak on a card from a CPU;
    ``bigbatch nnunet train`` plans the micro-batch under the budget, says so in nnU-Net's log,
    and trains and validates the fold as nnU-Net does (a micro-batch of 1 is the exactness
    test's)."""
    before = set((root / "results").rglob("*"))
    rows = json.loads(
        _run(root, "-m", "bigbatch", "nnunet", "plan", "987", "--budget", "t4", "--json")
    )
    # Planning writes nothing into nnUNet_results (it made a trainer folder and log per plan).
    assert set((root / "results").rglob("*")) == before
    by_configuration = {r["configuration"]: r for r in rows}
    assert set(by_configuration) == {"2d", "3d_fullres"}
    for row in rows:
        assert row["fits"] and 1 <= row["micro_batch"] <= row["batch_size"]
        assert row["budget_bytes"] == 15 * 2**30  # a T4 as its driver reports it
    argv = ["-m", "bigbatch", "nnunet", "train", "987", "3d_fullres", "1", "--device", "cpu"]
    _run(root, *argv, "--epochs", "1", "--iterations-per-epoch", "2", "--budget", "3GB",
         "--log", "tensorboard")  # fmt: skip
    fold = root / "results/Dataset987_Example/nnUNetTrainerBigBatch__nnUNetPlans__3d_fullres/fold_1"
    log = "".join(p.read_text() for p in fold.glob("training_log_*.txt"))
    assert "bigbatch: batch 2 in micro-batches of 2, predicted peak" in log
    # --log: the epoch's losses and Dice at its optimizer step, each step's loss (TensorBoard's
    # own reader on the fold's event files).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(fold / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val_losses")] == [2]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    # nnU-Net's own outputs, as nnUNetv2_train writes them.
    assert (fold / "checkpoint_final.pth").is_file()
    assert (fold / "validation" / "summary.json").is_file()
    # nnU-Net's own prediction command uses the fold ("Unable to locate trainer class
    # nnUNetTrainerBigBatch" before: its checkpoint names nnU-Net's class, whose network it is).
    # Images larger than the patch (16^3), so that the sliding window has many windows.
    images = root / "larger"
    images.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(2):
        volume = rng.normal(size=(28, 24, 20)).astype(np.float32)
        nib.save(nib.Nifti1Image(volume, np.eye(4)), images / f"big_{i:03d}_0000.nii.gz")
    own = root / "predicted_by_nnunet"
    predict = ["-c", "from nnunetv2.inference.predict_from_raw_data import predict_entry_point; predict_entry_point()"]  # fmt: skip
    _run(
        root, *predict, "-i", str(images), "-o", str(own),
        "-d", "987", "-c", "3d_fullres", "-f", "1", "-tr", "nnUNetTrainerBigBatch",
        "-device", "cpu", "-npp", "1", "-nps", "1", "--disable_progress_bar",
        "--save_probabilities",
    )  # fmt: skip
    # bigbatch nnunet predict: the same masks (up to float16's ties), the windows' patches in
    # batches planned under the budget (nnU-Net runs them one at a time).
    ours = root / "predicted_by_bigbatch"
    argv = ["-m", "bigbatch", "nnunet", "predict", "987", "3d_fullres", "-i", str(images)]
    said = _run(
        root, *argv, "-o", str(ours), "--folds", "1", "--device", "cpu", "--budget", "2GB",
        "--save-probabilities",
    )  # fmt: skip
    assert "predicted 2 case(s)" in said
    masks = sorted(own.glob("big_*.nii.gz"))
    assert len(masks) == 2
    for path in masks:
        # Both sum the windows' logits in float16: a patch computed in a batch of several has
        # another float32 round-off, which moves a sum by an ulp of float16 and can flip the
        # class of a voxel whose two best classes were within it (a tie in one, not the other).
        # The masks agree wherever the two best are further apart than the two predictions.
        stem = path.name.removesuffix(".nii.gz")
        theirs_p = np.load(own / f"{stem}.npz")["probabilities"]
        spread = np.abs(np.load(ours / f"{stem}.npz")["probabilities"] - theirs_p).max()
        assert spread <= 8 * np.finfo(np.float16).eps, (path.name, spread)  # an ulp or two
        best_two = np.sort(theirs_p, axis=0)[-2:]
        margin = (best_two[1] - best_two[0]).T  # (z, y, x) -> the mask's (x, y, z)
        decided = margin > 2 * spread
        assert decided.mean() > 0.9, (path.name, decided.mean())
        theirs = np.asarray(nib.load(path).dataobj)
        mine = np.asarray(nib.load(ours / path.name).dataobj)
        assert np.array_equal(mine[decided], theirs[decided]), path.name
    # The rest of nnU-Net's workflow on the fold: its best configuration and its ensembling.
    best = _run(
        root, "-c", "from nnunetv2.evaluation.find_best_configuration import "
        "find_best_configuration_entry_point as f; f()",
        "987", "-c", "3d_fullres", "-tr", "nnUNetTrainerBigBatch", "-f", "1", "-np", "1",
    )  # fmt: skip
    assert "*Best*: nnUNetTrainerBigBatch__nnUNetPlans__3d_fullres" in best
    _run(
        root, "-c", "from nnunetv2.ensembling.ensemble import entry_point_ensemble_folders as f; f()",
        "-i", str(own), str(ours), "-o", str(root / "ensembled"), "-np", "1",
    )  # fmt: skip
    assert len(list((root / "ensembled").glob("big_*.nii.gz"))) == 2
    # Its checkpoint as --pretrained-weights: read with weights_only=True (numpy's scalars in
    # nnU-Net's logs were refused), every weight but the segmentation outputs taken.
    taken = _run(root, str(SCENARIOS), str(root), "pretrained", str(fold / "checkpoint_final.pth"))
    assert int(taken.strip().splitlines()[-1]) > 0


def test_a_dataset_of_regions_is_planned_with_or_without_an_ignore_label(root: Path) -> None:
    """Datasets of regions (sigmoid outputs: BraTS's), their plans copied and their
    dataset.json naming them, with and without an ignore label: planned, where the trace
    failed (its example labels were one channel of classes, and nnU-Net hands its loss the
    regions one-hot); with an ignore label it was refused before (the trainer weighs the
    binary cross-entropy's mean over the voxels kept exactly: test_nnunet_memory.py)."""
    source = root / "preprocessed" / "Dataset987_Example"
    for number, ignore in ((988, True), (989, False)):
        target = root / "preprocessed" / f"Dataset{number}_Regions"
        target.mkdir(exist_ok=True)
        plans = json.loads((source / "nnUNetPlans.json").read_text())
        plans["dataset_name"] = target.name
        (target / "nnUNetPlans.json").write_text(json.dumps(plans))
        dataset = json.loads((source / "dataset.json").read_text())
        top = max(dataset["labels"].values())
        labels = {"background": 0, "whole": list(range(1, top + 1)), "top": top}
        dataset["labels"] = labels | ({"ignore": top + 1} if ignore else {})
        dataset["regions_class_order"] = list(range(1, top + 1))[-2:]
        (target / "dataset.json").write_text(json.dumps(dataset))
        said = _run(root, "-m", "bigbatch", "nnunet", "plan", str(number), "--budget", "t4")
        assert "3d_fullres" in said, said


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["train", "987", "3d_fullres", "0", "--micro-batch", "-1"],
         "--micro-batch is a number of samples >= 1 (0: planned), got -1"),
        (["train", "987", "3d_fullres", "0", "--val", "--epochs", "2"],
         "--epochs: for training, and --val only validates the fold's final checkpoint"),
        (["predict", "987", "3d_fullres", "-i", "in", "-o", "out", "--folds", "0", "x"],
         "--folds takes fold numbers (0 1 2 3 4) or all, got 'x'"),
    ],
)  # fmt: skip
def test_a_flags_mistake_is_refused_before_nnunet_loads(
    flags: list[str],
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A negative micro-batch, training's flags with --val (which only validates), a fold that
    is none: each refused in one line before nnU-Net and torch load, which took 8 s of a
    refusal here; nnU-Net cannot load in this test, so a refusal that needed it fails."""
    import bigbatch.integrations
    from bigbatch.cli.main import main

    for name in ("raw", "preprocessed", "results"):
        monkeypatch.setenv(f"nnUNet_{name}", str(tmp_path))
    monkeypatch.setitem(sys.modules, "bigbatch.integrations.nnunet", None)
    monkeypatch.delattr(bigbatch.integrations, "nnunet", raising=False)
    assert main(["nnunet", *flags]) == 2
    assert said in capsys.readouterr().err.strip().splitlines()[-1]
