"""What a training task owns, apart from the loop: its data, model, loss, metrics and report.

:func:`bigbatch.train.loop.train` is the loop (plan, exact accumulation, OOM back-off,
checkpoints, history, progress); a task fills in the rest, and the loop never asks which task it
runs. Tasks are chosen by the ``task`` key from a registry: ``classification``
(:class:`~bigbatch.train.tasks.classification.task.ClassificationTask`) and ``segmentation``
(:class:`~bigbatch.train.tasks.segmentation.task.SegmentationTask`) are registered here; a new task
is a folder with a subclass of :class:`~bigbatch.train.tasks.base.Task` plus one
:func:`register_task` call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bigbatch.train.tasks.base import Log, Metrics, Placement, Task
from bigbatch.train.tasks.classification.options import ClassificationOptions
from bigbatch.train.tasks.options import TaskOptions
from bigbatch.train.tasks.segmentation.options import SegmentationOptions

if TYPE_CHECKING:  # config imports this registry to check task= and monitor=
    from bigbatch.train.config import TrainConfig

__all__ = [
    "Log",
    "Metrics",
    "Placement",
    "PredictRequest",
    "Task",
    "TaskEntry",
    "lower_is_better",
    "read_task_info",
    "register_task",
    "run_task_name",
    "task_entry",
    "task_for",
    "task_names",
]


@dataclass(frozen=True)
class PredictRequest:
    """What ``bigbatch predict`` asks of a trained run: its inputs (a folder, or a CSV a task
    reads), where to write (None: the task's default inside the run), TTA passes, which
    checkpoint, the device, and the task's own options (segmentation's ``patch``, ``overlap``),
    given only when the user set them."""

    run_dir: Path
    inputs: Path
    out: Path | None = None
    tta: int = 2
    checkpoint: str = "best"
    device: str = "cpu"
    options: Mapping[str, Any] = field(default_factory=dict)

    def refuse_options(self, task: str, allowed: tuple[str, ...] = ()) -> None:
        """ValueError naming an option this task's prediction does not take."""
        for name in self.options:
            if name not in allowed:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} is not an option of a {task} run's prediction; drop it")


@dataclass(frozen=True)
class TaskEntry:
    """A registered task: how to build it, the validation metrics ``monitor=`` may name, and how
    ``bigbatch predict`` runs a trained run of it (a one-line summary back)."""

    build: Callable[[TrainConfig], Task]
    metrics: tuple[str, ...]
    lower_is_better: frozenset[str] = frozenset()  # the metrics where less is better
    predict: Callable[[PredictRequest], str] | None = None
    options: type[TaskOptions] = TaskOptions  # its own configuration keys (a dataclass)


_TASKS: dict[str, TaskEntry] = {}


def register_task(
    name: str,
    build: Callable[[TrainConfig], Task],
    *,
    metrics: tuple[str, ...],
    lower_is_better: tuple[str, ...] = (),
    predict: Callable[[PredictRequest], str] | None = None,
    options: type[TaskOptions] = TaskOptions,
) -> None:
    """Make ``task=name`` build ``build(cfg)``; ``metrics`` are the names its
    :meth:`Metrics.as_dict` returns that ``monitor=`` may choose; ``predict`` is what
    ``bigbatch predict`` calls for a run of it; ``options``, the dataclass of its own
    configuration keys (:mod:`bigbatch.train.tasks.options`), reached as ``cfg.options``.

    >>> "classification" in task_names()
    True
    """
    if name in _TASKS:
        raise ValueError(f"task {name!r} is registered already")
    unknown = set(lower_is_better) - set(metrics)
    if unknown:
        raise ValueError(f"lower_is_better names metrics the task does not have: {sorted(unknown)}")
    _TASKS[name] = TaskEntry(build, tuple(metrics), frozenset(lower_is_better), predict, options)


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
    task = task_entry(cfg.task).build(cfg)
    if not isinstance(task, Task):
        kind = type(task).__name__
        raise TypeError(
            f"task={cfg.task} built a {kind}, which is not a bigbatch Task: subclass it, "
            f"`class {kind}(bigbatch.train.tasks.Task)`, for the defaults the loop relies on"
        )
    return task


def read_task_info(run_dir: str | Path) -> dict[str, Any]:
    """A run folder's ``task.json`` (what its task needs to predict, and the task's name); a
    run without one is a classification run (that file came later). A damaged file is a
    ValueError with the fix."""
    path = Path(run_dir) / "task.json"
    if not path.is_file():
        return {"task": "classification"}
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{path} is damaged ({type(exc).__name__}: {str(exc)[:80]}): bigbatch train writes "
            "it; restore it from a copy, or train the run again"
        ) from None
    if not isinstance(info, dict) or not isinstance(info.get("task"), str):
        raise ValueError(f"{path} is not a bigbatch task file: restore it, or train again")
    return info


def run_task_name(run_dir: str | Path) -> str:
    """The task a run folder was trained for (:func:`read_task_info`)."""
    return str(read_task_info(run_dir)["task"])


# The built-in tasks' modules load timm, PIL and friends: imported when the task is chosen.
def _classification(cfg: TrainConfig) -> Task:
    from bigbatch.train.tasks.classification.task import ClassificationTask

    return ClassificationTask(cfg)


def _segmentation(cfg: TrainConfig) -> Task:
    from bigbatch.train.tasks.segmentation.kaggle import KaggleSegmentationTask
    from bigbatch.train.tasks.segmentation.rle_data import is_rle_csv
    from bigbatch.train.tasks.segmentation.task import SegmentationTask

    # A Kaggle RLE CSV (told by its header) is read as the competitions ship it.
    return KaggleSegmentationTask(cfg) if is_rle_csv(cfg.data) else SegmentationTask(cfg)


def _predict_classification(request: PredictRequest) -> str:
    from bigbatch.train.tasks.classification.predict import predict_request

    return predict_request(request)


def _predict_segmentation(request: PredictRequest) -> str:
    from bigbatch.train.tasks.segmentation.predict import predict_request

    return predict_request(request)


register_task(
    "classification",
    _classification,
    metrics=("accuracy", "error_rate", "top5", "f1_macro", "f1_micro", "auroc", "kappa"),
    lower_is_better=("error_rate",),
    predict=_predict_classification,
    options=ClassificationOptions,
)
register_task(
    "segmentation",
    _segmentation,
    metrics=("dice", "jaccard", "hd95"),
    lower_is_better=("hd95",),
    predict=_predict_segmentation,
    options=SegmentationOptions,
)
