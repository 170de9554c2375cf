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

import pytest

pytest.importorskip("nnunetv2")

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


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset through nnU-Net's fingerprint, planner and preprocessing (3d_fullres)."""
    root = tmp_path_factory.mktemp("nnunet")
    _run(root, str(SCENARIOS), str(root), "prepare")
    return root


def test_the_trainers_update_is_nnunets_own_batch_update(root: Path) -> None:
    """In float64, with and without batch_dice, with deep supervision: micro-batches of 1 and
    an uneven 2 + 1 give nnU-Net's own gradient to 1e-12; ``loss / N`` does not. nnU-Net's Dice
    sums in float32 whatever its inputs: as shipped, the split is judged against the round-off
    of nnU-Net's own update (its float32 sums against float64)."""
    out = json.loads(_run(root, str(SCENARIOS), str(root), "exact").strip().splitlines()[-1])
    for plan in ("sample_dice", "batch_dice"):
        assert out[plan]["micro_1"] < 1e-12 and out[plan]["micro_2"] < 1e-12, out[plan]
        assert out[plan]["naive_2"] > 1e-4, out[plan]  # loss / N: not the batch's update
    shipped = out["sample_dice_float32_sums"]
    assert shipped["micro_2"] <= 100 * shipped["own_round_off"], shipped
    assert shipped["naive_2"] >= 1e4 * shipped["own_round_off"], shipped


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


def test_bigbatch_nnunet_plans_and_trains_under_a_budget(root: Path) -> None:
    """``bigbatch nnunet plan`` predicts each configuration's peak on a card from a CPU;
    ``bigbatch nnunet train`` plans the micro-batch under the budget, says so in nnU-Net's log,
    and trains and validates the fold as nnU-Net does (a micro-batch of 1 is the exactness
    test's)."""
    rows = json.loads(
        _run(root, "-m", "bigbatch", "nnunet", "plan", "987", "--budget", "t4", "--json")
    )
    by_configuration = {r["configuration"]: r for r in rows}
    assert set(by_configuration) == {"2d", "3d_fullres"}
    for row in rows:
        assert row["fits"] and 1 <= row["micro_batch"] <= row["batch_size"]
        assert row["budget_bytes"] == 15 * 2**30  # a T4 as its driver reports it
    argv = ["-m", "bigbatch", "nnunet", "train", "987", "3d_fullres", "1", "--device", "cpu"]
    _run(root, *argv, "--epochs", "1", "--iterations-per-epoch", "2", "--budget", "3GB")
    fold = root / "results/Dataset987_Example/nnUNetTrainerBigBatch__nnUNetPlans__3d_fullres/fold_1"
    log = "".join(p.read_text() for p in fold.glob("training_log_*.txt"))
    assert "bigbatch: batch 2 in micro-batches of 2, predicted peak" in log
    # nnU-Net's own outputs, as nnUNetv2_train writes them.
    assert (fold / "checkpoint_final.pth").is_file()
    assert (fold / "validation" / "summary.json").is_file()
