"""A new task is one folder plus one registry line: ``toy_boxes/`` (box regression with a list
of boxes per image, a loss averaged over boxes) trains through ``train()``, is planned on its
own step, and accumulates exactly: the window's update at any split equals the big batch's in
float64, where weighing micro-batches equally (``loss / N``) does not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_boxes
from toy_boxes.task import box_l1_sum, generate

import bigbatch.train.registry as registry
import bigbatch.train.tasks as tasks
from bigbatch.train.config import load_config
from bigbatch.train.loop import train
from bigbatch.train.planning import plan_for
from bigbatch.train.tasks import Placement
from helpers import window_gradients


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))  # for this test only
    toy_boxes.register()


def _cfg(*overrides: str) -> Any:
    base = ["task=toy_boxes", "data=generated", "batch=8", "epochs=4", "lr=0.01"]
    return load_config(overrides=[*base, "device=cpu", "num_workers=0", *overrides])


@pytest.mark.slow
def test_the_toy_task_trains_from_its_folder(registered: None, tmp_path: Path) -> None:
    # Windows of 8 in micro-batches of 3 (3, 3, 2): the boxes lists split with their images.
    cfg = _cfg("micro_batch=3", "monitor=box_l1", "max_boxes=2")  # max_boxes: the task's own
    assert cfg.options.max_boxes == 2 and "max_boxes" in cfg.to_dict()
    result = train(cfg, tmp_path / "run", log=lambda _: None)
    errors = [row["box_l1"] for row in result.history]
    assert errors[-1] < errors[0]  # it learns
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["box_l1"] == min(errors)  # lower is better, as registered
    assert json.loads((tmp_path / "run" / "task.json").read_text())["task"] == "toy_boxes"


def test_the_plan_traces_the_tasks_own_step(registered: None) -> None:
    cfg = _cfg("budget=1GB", "overhead=0")  # the step alone: not this process's size
    task = tasks.task_for(cfg)
    task.prepare(lambda _: None)
    seen: list[int] = []
    step = task.step

    def counted(model: Any, micro: Any, where: Placement) -> Any:
        seen.append(len(micro[1]))  # the example batch's boxes list reached the step
        return step(model, micro, where)

    task.step = counted  # type: ignore[method-assign]
    micro, *_ = plan_for(cfg, task.model_factory(), torch.device("cpu"), "fp32", print, task=task)
    assert seen and 1 <= micro <= cfg.batch


def _window(n: int = 7) -> tuple[torch.Tensor, list[torch.Tensor]]:
    images, boxes = generate(n, seed=3)
    assert len({len(b) for b in boxes}) > 1  # images carry different numbers of boxes
    return images.double(), [b.double() for b in boxes]


def _grads(micro_batch: int | None, equal_weights: bool = False) -> list[torch.Tensor]:
    """The window's gradient: at once (``None``), or through ``run_window`` at ``micro_batch``
    with the task's split and step (or, ``equal_weights``, each micro-batch's mean weighed the
    same: ``loss / N``)."""
    cfg = _cfg()
    task = tasks.task_for(cfg)
    torch.manual_seed(0)
    model = task.model_factory()().double()
    window, where = _window(), Placement(torch.device("cpu"))
    if micro_batch is None:
        images, boxes = window
        (box_l1_sum(model(images), boxes) / sum(len(b) for b in boxes)).backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return window_gradients(
        model,
        window,
        lambda m: task.step(model, m, where),
        micro_batch,
        split=task.split,
        equal_weights=equal_weights,
    )


def _max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("micro_batch", [1, 2, 3, 7])
def test_the_box_weighted_window_equals_the_big_batch(registered: None, micro_batch: int) -> None:
    assert _max_error(_grads(micro_batch), _grads(None)) < 1e-12


def test_weighing_micro_batches_equally_is_not_the_big_batch(registered: None) -> None:
    assert _max_error(_grads(3, equal_weights=True), _grads(None)) > 1e-4


def test_the_tasks_own_key_is_checked_by_the_task(registered: None) -> None:
    from bigbatch.train.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"max_boxes must be in 1..3 \(the model's slots\), got 4"
    ):
        _cfg("max_boxes=4")
    with pytest.raises(ConfigError, match=r"max_boxes .* is a key of task=toy_boxes"):
        load_config(overrides=["data=x", "max_boxes=2"])  # a classification run


def test_a_task_that_is_not_a_task_subclass_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))
    monkeypatch.setattr(registry, "_LOADED", {})
    tasks.register_task("duck", lambda cfg: object(), metrics=("m",))
    from bigbatch.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"not a bigbatch Task: subclass it"):
        tasks.task_for(load_config(overrides=["task=duck", "data=x"]))


def test_bigbatch_predict_runs_the_runs_task_through_the_registry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bigbatch.cli.main import main

    seen: list[tasks.PredictRequest] = []

    def predict(request: tasks.PredictRequest) -> str:
        seen.append(request)
        return f"boxes for {request.inputs.name}"

    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))
    monkeypatch.setattr(registry, "_LOADED", {})
    tasks.register_task("toy_boxes", toy_boxes.ToyBoxes, metrics=("box_l1",), predict=predict)
    run = tmp_path / "run"
    run.mkdir()
    (run / "task.json").write_text('{"task": "toy_boxes"}')
    for name in ("config.json", "done.json"):  # a finished run folder bigbatch train wrote
        (run / name).write_text("{}")
    assert main(["predict", str(run), str(tmp_path / "images"), "--patch", "8"]) == 0
    assert capsys.readouterr().out.strip() == "boxes for images"
    assert seen[0].options == {"patch": 8} and seen[0].run_dir == run


def test_an_option_the_runs_task_does_not_take_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bigbatch.cli.main import main

    (tmp_path / "run").mkdir()  # no task.json: a classification run
    for name in ("config.json", "done.json"):
        (tmp_path / "run" / name).write_text("{}")
    assert main(["predict", str(tmp_path / "run"), str(tmp_path), "--overlap", "0.25"]) == 2
    err = capsys.readouterr().err
    assert "--overlap is not an option of a classification run's prediction" in err
