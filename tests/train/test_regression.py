"""task=regression: a CSV of file,target[,target2]; exact against the big batch in float64
(``loss / N`` misses), metrics in the targets' units, and train -> predict -> ensemble from the
command, writing the CSV's layout."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bigbatch.cli.main import main
from bigbatch.train.config import load_config
from bigbatch.train.data import DataError
from bigbatch.train.tasks import Placement, task_for
from bigbatch.train.tasks.regression.task import RegressionMetrics
from helpers import window_gradients


def write_targets(folder: Path, n: int = 24, seed: int = 0, size: int = 16) -> Path:
    """Images whose brightness and bright area are the two targets; their CSV."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        level, side = rng.uniform(0.2, 1.0), int(rng.integers(3, size))
        pixels = rng.integers(0, 30, (size, size, 3))
        pixels[:side, :side] += int(200 * level)
        name = f"images/img_{i}.png"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / name)
        rows.append([name, f"{100 * level:.3f}", str(side * side)])
    path = folder / "train.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["file", "brightness", "area"], *rows])
    return path


def _cfg(csv_path: Path, *extra: str) -> object:
    base = [f"data={csv_path}", "task=regression", "model=tinymodel:tiny", "size=16"]
    return load_config(overrides=[*base, "batch=8", "device=cpu", "num_workers=0", *extra])


def _grads(task: object, micro: int | None, equal: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 2)).double()
    x = torch.randn(7, 3, 16, 16, dtype=torch.float64)
    y = torch.randn(7, 2, dtype=torch.float64)
    where = Placement(torch.device("cpu"))
    if micro is None:
        task.loss(model(x), y).backward()  # type: ignore[attr-defined]
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    step = lambda m: task.step(model, m, where)  # type: ignore[attr-defined]  # noqa: E731
    return window_gradients(model, (x, y), step, micro, equal_weights=equal)


@pytest.mark.parametrize("loss", ["mse", "huber", "l1"])
def test_the_window_equals_the_big_batch_in_float64(
    tmp_path: Path, tiny_model: str, loss: str
) -> None:
    task = task_for(_cfg(write_targets(tmp_path, n=6), f"loss={loss}"))
    big = _grads(task, None)
    for micro in (1, 3, 7):
        err = max(float((a - b).abs().max()) for a, b in zip(_grads(task, micro), big, strict=True))
        assert err < 1e-12, (micro, err)
    naive = _grads(task, 3, equal=True)  # micro-batches of 3, 3, 1 weighed the same: loss / N
    assert max(float((a - b).abs().max()) for a, b in zip(naive, big, strict=True)) > 1e-4


def test_metrics_are_in_the_targets_units_and_summed_by_sample() -> None:
    mean, std = torch.tensor([10.0, 0.0]), torch.tensor([2.0, 1.0])
    metrics = RegressionMetrics(torch.nn.functional.mse_loss, mean, std)
    pred = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.5, -1.0]])
    true = torch.tensor([[0.5, 0.0], [1.0, 2.0], [-0.5, -1.0]])
    metrics.update(pred[:1], true[:1])  # batches of unequal sizes
    metrics.update(pred[1:], true[1:])
    got = metrics.as_dict()
    p, t = (pred * std + mean).double().numpy(), (true * std + mean).double().numpy()
    assert math.isclose(got["mae"], float(np.abs(p - t).mean(0).mean()), rel_tol=1e-12)
    assert math.isclose(got["rmse"], float(np.sqrt(((p - t) ** 2).mean(0)).mean()), rel_tol=1e-12)
    r2 = 1 - ((p - t) ** 2).sum(0) / ((t - t.mean(0)) ** 2).sum(0)
    assert math.isclose(got["r2"], float(r2.mean()), rel_tol=1e-12)
    assert math.isclose(got["valid_loss"], float(((pred - true) ** 2).mean()), rel_tol=1e-6)


def test_bad_targets_are_refused_with_the_row(tmp_path: Path, tiny_model: str) -> None:
    path = write_targets(tmp_path, n=4)
    text = path.read_text().splitlines()
    path.write_text("\n".join([*text[:2], "images/img_1.png,bright,3", *text[3:]]) + "\n")
    task = task_for(_cfg(path))
    with pytest.raises(DataError, match=r"line 3: a target is not a number"):
        task.prepare(print)
    with pytest.raises(DataError, match=r"has no column 'size'; its columns are brightness, area"):
        task_for(_cfg(write_targets(tmp_path / "b", n=4), "targets=size")).prepare(print)


def test_a_regression_csv_read_as_classes_is_refused_with_the_fix(
    tmp_path: Path, tiny_model: str
) -> None:
    path = write_targets(tmp_path, n=6)
    cfg = load_config(overrides=[f"data={path}", "model=tinymodel:tiny", "size=16", "device=cpu"])
    with pytest.raises(
        DataError, match=r"a regression target, not classes: train it with task=regression"
    ):
        task_for(cfg).prepare(print)


@pytest.mark.slow
def test_train_predict_and_ensemble_write_the_csvs_layout(
    tmp_path: Path, tiny_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_targets(tmp_path, n=24)
    argv = ["train", f"data={path}", "task=regression", "model=tinymodel:tiny", "size=16"]
    argv += ["batch=8", "micro_batch=3", "epochs=2", "lr=0.01", "device=cpu", "num_workers=0"]
    for name, seed in (("one", 0), ("two", 1)):
        assert (
            main(
                [
                    *argv,
                    f"seed={seed}",
                    "monitor=mae",
                    "--out",
                    str(tmp_path / name),
                    "--no-progress",
                ]
            )
            == 0
        )
    out = capsys.readouterr().out
    assert "MAE" in out and "R2" in out
    history = (tmp_path / "one" / "history.csv").read_text().splitlines()
    assert history[0].split(",")[:6] == [
        "epoch",
        "phase",
        "train_loss",
        "valid_loss",
        "mae",
        "rmse",
    ]
    predict = ["predict", str(tmp_path / "one"), str(tmp_path / "images"), "--tta", "2"]
    assert main([*predict, "--budget", "8GB"]) == 0  # its batch planned for this device
    rows = list(csv.reader((tmp_path / "one" / "predictions.csv").read_text().splitlines()))
    assert rows[0] == ["file", "brightness", "area"] and len(rows) == 1 + 24
    assert all(math.isfinite(float(v)) for row in rows[1:] for v in row[1:])
    ens = tmp_path / "ens"
    argv = ["ensemble", str(tmp_path / "one"), str(tmp_path / "two"), "--images"]
    assert main([*argv, str(tmp_path / "images"), "--out", str(ens)]) == 0
    averaged = list(csv.reader((ens / "predictions.csv").read_text().splitlines()))
    first = {r[0]: float(r[1]) for r in rows[1:]}
    assert averaged[0] == rows[0] and len(averaged) == len(rows)
    assert any(abs(float(r[1]) - first[r[0]]) > 0 for r in averaged[1:])  # two runs, averaged


@pytest.mark.slow
def test_bigbatch_plan_plans_the_tasks_own_run(
    tmp_path: Path, tiny_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bigbatch plan`` with train's keys plans what train would: the task's step and its
    validation, on the data's shapes; for a GPU from any machine."""
    import json

    path = write_targets(tmp_path, n=10)
    keys = ["task=regression", f"data={path}", "model=tinymodel:tiny", "size=16", "batch=8"]
    # overhead=0: the step alone, whatever this process holds (a suite's process grows).
    assert main(["plan", *keys, "budget=1GB", "overhead=0", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["task"] == "regression" and plan["target_batch"] == 8
    assert plan["valid_shape"] == [3, 16, 16] and plan["valid_batch"] >= 16
    cuda = [*keys, "budget=t4", "device=cuda"]
    assert main(["plan", *cuda, "precision=fp16"]) == 0
    assert "plan: target batch 8" in capsys.readouterr().out
    # A card named: device=auto and precision=auto are what train takes on it (fp16 on a T4).
    assert main(["plan", *keys, "budget=t4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "planned as bigbatch train runs on the T4: device=cuda precision=fp16" in err
    one = json.loads(out.strip().splitlines()[-1])
    assert one["target_batch"] == 8 and one["world_size"] == 1 and one["held_bytes"] == 0
    # Kaggle's two T4s under torchrun: each rank's share of the window, beside DDP's buckets.
    assert main(["plan", *keys, "budget=t4", "--world-size", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert "distributed: 2 ranks x 4 samples per window = target batch 8" in out
    two = json.loads(out.strip().splitlines()[-1])
    assert (two["world_size"], two["rank_batch"], two["micro_batch"]) == (2, 4, 4)
    assert two["held_bytes"] > 0
    assert two["usable_bytes"] == one["usable_bytes"] - two["held_bytes"]
    assert main(["plan", *keys, "budget=t4", "--world-size", "1,2"]) == 2
    assert "a training run's plan is for one number of ranks" in capsys.readouterr().err
    # grad_checkpointing=true: traced as trained (a timm model's own switch), or refused.
    assert main(["plan", *keys, "budget=t4", "grad_checkpointing=true"]) == 2
    assert "grad_checkpointing=true: Sequential has no activation checkpointing" in (
        capsys.readouterr().err
    )
    peaks = []
    for checkpointed in ("false", "true"):
        timm_keys = [*keys[:2], "arch=test_vit", "size=64", "batch=64", "budget=t4"]
        assert main(["plan", *timm_keys, f"grad_checkpointing={checkpointed}", "--json"]) == 0
        peaks.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert peaks[1]["predicted_peak_bytes"] < peaks[0]["predicted_peak_bytes"]
    if not torch.cuda.is_available():  # a size: which card, and so which precision, is unknown
        assert main(["plan", *keys, "budget=15GB", "device=cuda"]) == 2
        assert "precision=auto on a cuda this machine does not have" in capsys.readouterr().err
