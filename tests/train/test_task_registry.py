"""A new task is one module plus one register_task call: a toy regression task, defined in this
file alone, trains through `train()` with exact accumulation and picks its best epoch by its own
metric (lower is better)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bigbatch.train.registry as registry
import bigbatch.train.tasks as tasks
from bigbatch.train.config import ConfigError, TrainConfig, load_config
from bigbatch.train.loop import train


class MeanAbsoluteError:
    def __init__(self) -> None:
        self.total, self.count, self.loss = 0.0, 0, 0.0

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.total += float((logits.squeeze(1) - targets).abs().sum())
        self.loss += float(F.mse_loss(logits.squeeze(1), targets, reduction="sum"))
        self.count += len(targets)

    def as_dict(self) -> dict[str, float]:
        return {"valid_loss": self.loss / self.count, "mae": self.total / self.count}


class ToyRegression(tasks.Task):
    """y = x . w on generated data; a linear model learns it."""

    name = "toy_regression"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.classes: list[str] = []

    def prepare(self, log: Callable[[str], None], data: Any = None) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(60, 4, generator=g)
        y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
        return (x[:48], y[:48]), (x[48:], y[48:])

    def model_factory(self) -> Callable[[], nn.Module]:
        return lambda: nn.Linear(4, 1)

    def input_shape(self) -> tuple[int, ...]:
        return (4,)

    def datasets(self, train_items: Any, valid_items: Any) -> tuple[Any, Any]:
        return (
            torch.utils.data.TensorDataset(*train_items),
            torch.utils.data.TensorDataset(*valid_items),
        )

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(logits.squeeze(1), targets)

    def metrics(self) -> MeanAbsoluteError:
        return MeanAbsoluteError()

    def scores(self, row: dict[str, Any]) -> str:
        return f"valid mae {row['mae']:.4f}  "

    def run_info(self) -> dict[str, Any]:
        return {"task": self.name}


@pytest.fixture
def toy_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_TASKS", dict(registry._TASKS))  # registered for this test only
    tasks.register_task("toy_regression", ToyRegression, metrics=("mae",), lower_is_better=("mae",))


def test_a_task_registered_alone_trains_and_monitors_its_own_metric(
    toy_task: None, tmp_path: Path
) -> None:
    cfg = load_config(
        overrides=[
            "task=toy_regression",
            "data=generated",
            "monitor=mae",
            "batch=16",
            "micro_batch=5",  # windows of 5 + 5 + 5 + 1: uneven, exact anyway
            "epochs=4",
            "lr=0.05",
            "schedule=cosine",
            "device=cpu",
            "num_workers=0",
        ]
    )
    result = train(cfg, tmp_path / "run", log=lambda _: None)
    maes = [row["mae"] for row in result.history]
    assert maes[-1] < maes[0]  # it learns
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["mae"] == min(maes)  # lower is better, as registered
    assert json.loads((tmp_path / "run" / "task.json").read_text()) == {"task": "toy_regression"}


def test_unknown_tasks_and_metrics_are_refused(toy_task: None) -> None:
    with pytest.raises(ConfigError, match=r"task=.detection. is not one of .*toy_regression"):
        load_config(overrides=["task=detection", "data=x"])
    with pytest.raises(ConfigError, match="monitor=dice is not a toy_regression metric"):
        load_config(overrides=["task=toy_regression", "data=x", "monitor=dice"])
    with pytest.raises(ValueError, match="registered already"):
        tasks.register_task("toy_regression", ToyRegression, metrics=("mae",))
