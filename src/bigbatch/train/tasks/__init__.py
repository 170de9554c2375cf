"""What a training task owns, apart from the loop: its data, model, loss, metrics and report.

:func:`bigbatch.train.loop.train` is the loop (plan, exact accumulation, OOM back-off,
checkpoints, history, progress); a task fills in the rest. Two tasks exist, chosen by the
``task`` key: :class:`~bigbatch.train.tasks.classification.ClassificationTask` and
:class:`~bigbatch.train.tasks.segmentation.SegmentationTask`. A third implements
:class:`Task`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from bigbatch.train.config import TrainConfig

__all__ = ["Metrics", "Task", "task_for"]

Log = Callable[[str], None]


class Metrics(Protocol):
    """Validation metrics accumulated over batches by count (never a mean of batch means)."""

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None: ...

    def as_dict(self) -> dict[str, float]: ...


class Task(Protocol):
    name: str
    classes: list[str]

    def prepare(self, log: Log, data: Any = None) -> tuple[Any, Any]:
        """Scan and check the data: (training items, validation items), each with ``len()``."""
        ...

    def model_factory(self) -> Callable[[], nn.Module]: ...

    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape, for planning."""
        ...

    def datasets(self, train_items: Any, valid_items: Any) -> tuple[Any, Any]: ...

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss: a mean of per-sample terms (so that accumulation is exact)."""
        ...

    def metrics(self) -> Metrics: ...

    def scores(self, row: dict[str, Any]) -> str:
        """The validation part of an epoch's log line."""
        ...

    def run_info(self) -> dict[str, Any]:
        """What ``predict`` needs besides config.json (written as task.json)."""
        ...


def task_for(cfg: TrainConfig) -> Task:
    if cfg.task == "segmentation":
        from bigbatch.train.tasks.segmentation import SegmentationTask

        return SegmentationTask(cfg)
    from bigbatch.train.tasks.classification import ClassificationTask

    return ClassificationTask(cfg)
