"""What a training task owns, apart from the loop: its data, model, loss, metrics and report.

:func:`bigbatch.train.loop.train` is the loop (plan, exact accumulation, OOM back-off,
checkpoints, history, progress); a task fills in the rest, and the loop never asks which task it
runs. Tasks are chosen by the ``task`` key from a registry: ``classification``
(:class:`~bigbatch.train.tasks.classification.ClassificationTask`) and ``segmentation``
(:class:`~bigbatch.train.tasks.segmentation.SegmentationTask`) are registered here; a new task
is a module implementing :class:`Task` plus one :func:`register_task` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:  # config imports this registry to check task= and monitor=
    from bigbatch.train.config import TrainConfig

__all__ = [
    "Metrics",
    "Task",
    "TaskEntry",
    "lower_is_better",
    "register_task",
    "task_entry",
    "task_for",
    "task_names",
]

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


# Optional hooks a task may define (the loop and the planner read them with getattr):
#   valid_batch_size: int              validation batch (0: twice the micro-batch); segmentation
#                                      of whole volumes of different sizes takes 1
#   infer(model, x) -> logits          validation's forward (default model(x)); segmentation
#                                      runs sliding windows over whole volumes
#   couples_samples: bool              the loss couples the samples (a batch Dice): windows run
#                                      through gradient caching (bigbatch.backoff.run_coupled_window)
#   window_cache_bytes(window, precision) -> int, loss_name: str
#                                      with couples_samples: what the window holds besides its
#                                      steps, which the plan leaves room for


@dataclass(frozen=True)
class TaskEntry:
    """A registered task: how to build it, and the validation metrics ``monitor=`` may name."""

    build: Callable[[TrainConfig], Task]
    metrics: tuple[str, ...]
    lower_is_better: frozenset[str] = frozenset()  # the metrics where less is better


_TASKS: dict[str, TaskEntry] = {}


def register_task(
    name: str,
    build: Callable[[TrainConfig], Task],
    *,
    metrics: tuple[str, ...],
    lower_is_better: tuple[str, ...] = (),
) -> None:
    """Make ``task=name`` build ``build(cfg)``; ``metrics`` are the names its
    :meth:`Metrics.as_dict` returns that ``monitor=`` may choose.

    >>> "classification" in task_names()
    True
    """
    if name in _TASKS:
        raise ValueError(f"task {name!r} is registered already")
    unknown = set(lower_is_better) - set(metrics)
    if unknown:
        raise ValueError(f"lower_is_better names metrics the task does not have: {sorted(unknown)}")
    _TASKS[name] = TaskEntry(build, tuple(metrics), frozenset(lower_is_better))


def task_names() -> tuple[str, ...]:
    return tuple(_TASKS)


def task_entry(name: str) -> TaskEntry:
    if name not in _TASKS:
        raise KeyError(f"task={name!r} is not one of {', '.join(_TASKS)}")
    return _TASKS[name]


def lower_is_better(task: str, metric: str) -> bool:
    """Whether a smaller ``metric`` is better (losses always are)."""
    return metric in ("valid_loss", "train_loss") or metric in task_entry(task).lower_is_better


def task_for(cfg: TrainConfig) -> Task:
    return task_entry(cfg.task).build(cfg)


# The built-in tasks' modules load timm, PIL and friends: imported when the task is chosen.
def _classification(cfg: TrainConfig) -> Task:
    from bigbatch.train.tasks.classification import ClassificationTask

    return ClassificationTask(cfg)


def _segmentation(cfg: TrainConfig) -> Task:
    from bigbatch.train.tasks.segmentation import SegmentationTask

    return SegmentationTask(cfg)


register_task(
    "classification",
    _classification,
    metrics=("accuracy", "error_rate", "top5", "f1_macro", "f1_micro", "auroc", "kappa"),
    lower_is_better=("error_rate",),
)
register_task(
    "segmentation", _segmentation, metrics=("dice", "jaccard", "hd95"), lower_is_better=("hd95",)
)
