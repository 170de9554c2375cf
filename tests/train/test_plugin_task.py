"""A task outside the source tree, plugged in the public ways, is used from the ``bigbatch``
command like a built-in: trained, resumed, predicted and ensembled, with no file under ``src/``
naming it. Two ways in: an installed package's entry point (group ``bigbatch.tasks``, made here
as a ``.dist-info`` folder on the import path, as pip installs one), and ``task=module:Class``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import bigbatch.train.registry as registry
from bigbatch.cli.main import main

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """toy_boxes installed as a plug-in: a distribution whose entry point names its ENTRY."""
    site = tmp_path / "site"
    info = site / "toy_boxes_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-boxes-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[bigbatch.tasks]\ntoy_boxes = toy_boxes:ENTRY\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))  # nothing registered by hand
    monkeypatch.setattr(registry, "_LOADED", {})
    registry._entry_points.cache_clear()
    yield
    registry._entry_points.cache_clear()


def _train(run: Path, task: str, *extra: str) -> int:
    argv = ["train", f"task={task}", "data=generated", "batch=8", "epochs=2", "lr=0.01"]
    return main([*argv, "device=cpu", "num_workers=0", *extra, "--out", str(run), "--no-progress"])


@pytest.mark.slow
def test_an_installed_task_trains_resumes_predicts_and_ensembles_from_the_command(
    installed: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "toy_boxes" in registry.task_names()
    from bigbatch.train.config import help_for  # the command's help, from the registry

    assert "toy_boxes (boxes of generated squares)" in help_for("task")
    assert "toy_boxes: box_l1" in help_for("monitor")
    one, two = tmp_path / "one", tmp_path / "two"
    assert _train(one, "toy_boxes", "monitor=box_l1", "max_boxes=2") == 0
    assert json.loads((one / "task.json").read_text())["task"] == "toy_boxes"
    assert json.loads((one / "best.json").read_text())["box_l1"] > 0  # lower is better
    assert _train(two, "toy_boxes", "seed=1") == 0
    # Planned the way train plans it (its own step on its example batches), from the command.
    capsys.readouterr()
    plan = ["plan", "task=toy_boxes", "data=generated", "batch=8", "budget=1GB", "overhead=0"]
    assert main([*plan, "device=cpu", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert planned["task"] == "toy_boxes" and planned["micro_batch"] == 8
    (one / "done.json").unlink()  # as if killed after its last checkpoint
    assert main(["train", "--resume", str(one), "--no-progress"]) == 0  # from its config.json
    assert len((one / "history.csv").read_text().splitlines()) == 1 + 2  # nothing redone
    capsys.readouterr()
    assert main(["predict", str(one), str(tmp_path)]) == 0
    assert "boxes in" in capsys.readouterr().out and (one / "boxes.json").is_file()
    out = tmp_path / "ens"
    assert main(["ensemble", str(one), str(two), "--images", str(tmp_path), "--out", str(out)]) == 0
    assert "2 runs averaged" in capsys.readouterr().out
    assert len(json.loads((out / "boxes.json").read_text())) == 4
    # No file under src/ names the task.
    named = [p for p in SRC.rglob("*.py") if "toy_boxes" in p.read_text()]
    assert not named, named


@pytest.mark.slow
def test_task_module_class_needs_no_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))
    monkeypatch.setattr(registry, "_LOADED", {})
    run = tmp_path / "run"
    assert _train(run, "toy_boxes.task:ToyBoxes", "monitor=box_l1") == 0
    # Known by the name it was chosen under: predict finds it the same way.
    assert json.loads((run / "task.json").read_text())["task"] == "toy_boxes.task:ToyBoxes"
    assert main(["predict", str(run), str(tmp_path)]) == 0


def test_a_plug_in_that_does_not_load_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site = tmp_path / "site"
    info = site / "broken-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[bigbatch.tasks]\nbroken = no_such_module:ENTRY\n")
    monkeypatch.syspath_prepend(str(site))
    registry._entry_points.cache_clear()
    try:
        assert _train(tmp_path / "run", "broken") == 2
        err = capsys.readouterr().err
        assert "task=broken: its plug-in (no_such_module:ENTRY" in err
        assert "fix or uninstall that package" in err and "Traceback" not in err
        assert _train(tmp_path / "run", "nomodule:Nothing") == 2
        assert "task=nomodule:Nothing: importing 'nomodule' failed" in capsys.readouterr().err
    finally:
        registry._entry_points.cache_clear()


def test_a_monitor_its_validation_does_not_return_is_said_at_once() -> None:
    from bigbatch.train.config import ConfigError
    from bigbatch.train.tasks import check_declared_metrics

    check_declared_metrics("regression", "r2", {"valid_loss": 1.0, "mae": 1, "rmse": 1, "r2": 0})
    with pytest.raises(ConfigError, match=r"monitor=r2: task=regression's validation on this"):
        check_declared_metrics("regression", "r2", {"valid_loss": 1.0, "mae": 1, "rmse": 1})


@pytest.mark.parametrize(
    ("task", "metrics"),
    [
        ("classification", "bigbatch.train.tasks.classification.metrics:ClassificationMetrics"),
        ("regression", "bigbatch.train.tasks.regression.task:RegressionMetrics"),
    ],
)
def test_the_registry_declares_what_each_tasks_metrics_return(task: str, metrics: str) -> None:
    """Declared twice (the registry, for monitor= and the plot; as_dict, at run time): the
    same names."""
    import torch

    kind = registry.load_ref(metrics)
    if task == "classification":
        tally = kind(6, list("abcdef"))  # top5 from 6 classes on
        tally.update(torch.randn(6, 6), torch.tensor([0, 1, 2, 3, 4, 5]))
    else:
        tally = kind(torch.nn.functional.mse_loss, torch.zeros(2), torch.ones(2))
        tally.update(torch.randn(4, 2), torch.randn(4, 2))
    returned = set(tally.as_dict())
    assert set(registry.task_entry(task).metrics) <= returned, returned
