"""The plug-in boundary as an outsider meets it: every mistake a plug-in author (or the user of
a plug-in's runs) makes is one line naming the fix through the command line, never a
traceback, and nothing a plug-in does is silently replaced by something else. Each test here
failed on the code before its fix."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import bigbatch.train.registry as registry
from bigbatch.cli.main import main
from bigbatch.train.config import ConfigError, help_for, load_config
from bigbatch.train.tasks import task_for

# Tasks a plug-in author might write, each with one mistake (or none), on toy_boxes' data.
PLUGIN = '''
from bigbatch.train.registry import TaskEntry
from bigbatch.train.tasks import Task
from toy_boxes.task import ToyBoxes


class Plain(Task):
    """A task with no __init__ of its own."""

    metric_names = ("m",)
    fraction_names = ("m",)


class Duck:
    """Not a Task."""

    metric_names = ("m",)


class BadData(ToyBoxes):
    """Its data reading raises a plain ValueError."""

    def prepare(self, log, data=None):
        raise ValueError("tags.csv line 3: no tags")


class NoMetrics(ToyBoxes):
    metric_names = ()
    lower_is_better_names = ()


class BuggyPredict(ToyBoxes):
    @staticmethod
    def predict_run(request):
        return {}["tags"]  # the plug-in's own bug


TYPO = TaskEntry("typo", "toy_boxes.task:ToyBox", ("box_l1",))
SHADOW = TaskEntry("regression", "toy_boxes.task:ToyBoxes", ("box_l1",))
TOY = TaskEntry(
    "toy", "toy_boxes.task:ToyBoxes", ("box_l1",), frozenset({"box_l1"}),
    predict="toy_boxes.task:predict_run", options="toy_boxes.task:ToyBoxesOptions",
)
'''


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``plugmod`` importable, and a distribution ``tags-plugin`` whose entry points are the
    given names (see :func:`_install`); the registry's caches emptied before and after."""
    (tmp_path / "plugmod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("plugmod", None)
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))
    monkeypatch.setattr(registry, "_LOADED", {})
    registry._entry_points.cache_clear()
    yield tmp_path
    registry._entry_points.cache_clear()


def _install(site: Path, **entries: str) -> None:
    info = site / "tags_plugin-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tags-plugin\nVersion: 0.1\n")
    lines = "".join(f"{name} = {ref}\n" for name, ref in entries.items())
    (info / "entry_points.txt").write_text(f"[bigbatch.tasks]\n{lines}")
    registry._entry_points.cache_clear()


def _train(run: Path, task: str, *extra: str) -> int:
    argv = ["train", f"task={task}", "data=generated", "batch=8", "epochs=1", "lr=0.01"]
    return main([*argv, "device=cpu", "num_workers=0", *extra, "--out", str(run), "--no-progress"])


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_task_without_its_own_init_is_built_with_the_config(plugins: Path) -> None:
    task = task_for(load_config(overrides=["task=plugmod:Plain", "data=x"]))
    assert task.cfg is not None and task.cfg.task == "plugmod:Plain"
    # What a module:Class task declares of its plot is read, as a registry entry says it.
    assert registry.task_entry("plugmod:Plain").fractions == frozenset({"m"})


def test_a_class_that_is_no_task_is_one_line(
    plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(plugins / "run", "plugmod:Duck") == 2
    line = _one_line(capsys.readouterr().err)
    assert "is a Duck, not a bigbatch Task: write `class Duck(bigbatch.train.tasks.Task)`" in line


def test_module_class_is_found_in_the_working_directory_under_the_executable(
    plugins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The `bigbatch` executable's sys.path has its bin folder first, not the working directory.
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "cwdtask.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path / "here")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    sys.modules.pop("cwdtask", None)
    assert registry.task_entry("cwdtask:Plain").metrics == ("m",)


def test_a_plain_value_error_from_the_data_is_one_line_under_train_and_plan(
    plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(plugins / "run", "plugmod:BadData") == 2
    trained = _one_line(capsys.readouterr().err)
    keys = ["task=plugmod:BadData", "data=generated", "batch=8", "device=cpu"]
    assert main(["plan", *keys]) == 2
    planned = _one_line(capsys.readouterr().err)
    said = "task=plugmod:BadData: tags.csv line 3: no tags"
    assert trained.endswith(said) and planned.endswith(said)


def test_a_task_declaring_no_metrics_says_so_for_monitor(plugins: Path) -> None:
    with pytest.raises(ConfigError, match=r"task=plugmod:NoMetrics declares no metrics"):
        load_config(overrides=["task=plugmod:NoMetrics", "data=generated", "monitor=f2"])
    with pytest.raises(ConfigError, match=r"use valid_loss or box_l1$"):
        load_config(overrides=["task=plugmod:BadData", "data=generated", "monitor=f2"])


def test_a_typo_in_a_task_entry_is_said_when_the_task_is_chosen(
    plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _install(plugins, typo="plugmod:TYPO")
    assert "typo (not usable here: `bigbatch train task=typo` says why)" in help_for("task")
    assert _train(plugins / "run", "typo") == 2
    line = _one_line(capsys.readouterr().err)
    assert "task=typo: its task='toy_boxes.task:ToyBox' does not load (AttributeError" in line
    assert "fix that reference in the task's TaskEntry (package tags-plugin)" in line


def test_a_plug_in_named_like_a_built_in_task_is_refused_not_shadowed(
    plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _install(plugins, regression="plugmod:SHADOW")
    assert _train(plugins / "run", "regression") == 2
    line = _one_line(capsys.readouterr().err)
    assert "task=regression is two tasks here: the built-in one and the plug-in plugmod:SHADOW" in (
        line
    )
    assert "rename that entry point" in line


def test_a_plug_ins_own_key_error_is_its_traceback_not_an_unregistered_task(
    plugins: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(overrides=["task=plugmod:BuggyPredict", "data=generated"])
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "task.json").write_text(json.dumps({"task": "plugmod:BuggyPredict"}))
    (run / "done.json").write_text("{}")
    with pytest.raises(KeyError, match="tags"):
        main(["predict", str(run), str(tmp_path)])


def test_a_predict_options_help_names_its_task_once() -> None:
    from bigbatch.cli import task_help

    assert task_help("multilabel", "multilabel: the threshold") == "multilabel: the threshold"
    assert task_help("multilabel", "the threshold") == "multilabel: the threshold"


@pytest.mark.slow
def test_a_plug_ins_run_resumes_with_keys_and_says_what_is_missing_elsewhere(
    plugins: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One installed plug-in's run through the edges a user meets: predicting from it before it
    finished, resuming it with a key given, and opening it where the plug-in is not installed."""
    _install(plugins, toy="plugmod:TOY")
    run = tmp_path / "run"
    assert _train(run, "toy", "epochs=2") == 0
    assert json.loads((run / "task.json").read_text())["package"] == "tags-plugin"
    (run / "done.json").unlink()  # as if killed after its last checkpoint
    capsys.readouterr()
    assert main(["predict", str(run), str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{run} is an unfinished run (it stopped after epoch 2)" in line
    assert f"`bigbatch train --resume {run}` finishes it; or add --unfinished" in line
    assert main(["predict", str(run), str(tmp_path), "--unfinished"]) == 0
    assert "is unfinished (it stopped after epoch 2); its best epoch so far" in (
        capsys.readouterr().out
    )
    # Keys given with --resume apply to the run's own config, not to the defaults.
    assert main(["train", "--resume", str(run), "num_workers=0", "log_every=0"]) == 0
    assert json.loads((run / "config.json").read_text())["task"] == "toy"
    # Where the plug-in is not installed, its runs name the package to install.
    (plugins / "tags_plugin-0.1.dist-info" / "entry_points.txt").write_text("")
    registry._entry_points.cache_clear()
    registry._LOADED.clear()
    capsys.readouterr()
    assert main(["predict", str(run), str(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "trained with task=toy, which is not installed here: install its plug-in here: " in line
    assert line.endswith("pip install tags-plugin")
