"""What a training task owns, apart from the loop: its data, model, loss, metrics and report.

:func:`bigbatch.train.loop.train` is the loop (plan, exact accumulation, OOM back-off,
checkpoints, history, progress); a task fills in the rest, and the loop never asks which task it
runs. Tasks are chosen by the ``task`` key from :mod:`bigbatch.train.registry` (classification,
segmentation, regression; installed plug-ins; ``module:Class``); a new task is a folder with a
subclass of :class:`~bigbatch.train.tasks.base.Task` plus one registry entry.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bigbatch.io import read_json
from bigbatch.train.registry import (
    DEFAULT_TASK,
    TaskEntry,
    lower_is_better,
    register_task,
    task_entry,
    task_names,
)
from bigbatch.train.tasks.base import Log, Metrics, Placement, Task, ValidShape

if TYPE_CHECKING:
    from bigbatch.train.config import TrainConfig

__all__ = [
    "EnsembleRequest",
    "Log",
    "Metrics",
    "Placement",
    "PredictRequest",
    "Task",
    "TaskEntry",
    "ValidShape",
    "check_declared_metrics",
    "check_finished",
    "lower_is_better",
    "planned_eval_batch",
    "prepare_data",
    "read_task_info",
    "register_task",
    "run_task_entry",
    "run_task_name",
    "task_entry",
    "task_for",
    "task_names",
]


@dataclass(frozen=True, kw_only=True)
class _RunRequest:
    """What prediction and ensembles share: where to write (None: the task's default), TTA
    passes, which checkpoint, the device, and the task's own options, given only when the
    user set them (segmentation's ``patch``, ``overlap``, ``mask_size``)."""

    out: Path | None = None
    tta: int = 2
    checkpoint: str = "best"
    device: str = "auto"  # a GPU where there is one (cuda, then mps), else the CPU
    options: Mapping[str, Any] = field(default_factory=dict)
    budget: str = ""  # memory for prediction's forward passes ("": the run's planned batch)

    def refuse_options(self, task: str, allowed: tuple[str, ...] = ()) -> None:
        """ValueError naming an option this task does not take here."""
        for name in self.options:
            if name not in allowed:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} is not an option of {self.what(task)}; drop it")

    def what(self, task: str) -> str:
        return f"a {task} run's prediction"


@dataclass(frozen=True)
class EnsembleRequest(_RunRequest):
    """What ``bigbatch ensemble RUN RUN ... --images DIR`` asks of finished runs of one task:
    their predictions of the images, averaged as the task averages them (probabilities,
    values, masks).

    >>> request = EnsembleRequest(runs=(Path("runs/a"), Path("runs/b")), images=Path("test"))
    >>> len(request.runs), request.tta
    (2, 2)
    """

    runs: tuple[Path, ...]
    images: Path

    def what(self, task: str) -> str:
        return f"a {task} ensemble"


@dataclass(frozen=True)
class PredictRequest(_RunRequest):
    """What ``bigbatch predict`` asks of a trained run: its inputs (a folder, or a CSV a task
    reads). A task's ``predict`` function takes it, writes its files and returns the line the
    command prints; ``refuse_options`` refuses the options it does not take.

    >>> request = PredictRequest(run_dir=Path("runs/a"), inputs=Path("test"), options={"patch": 64})
    >>> request.refuse_options("tags")
    Traceback (most recent call last):
    ...
    ValueError: --patch is not an option of a tags run's prediction; drop it
    """

    run_dir: Path
    inputs: Path


def task_for(cfg: TrainConfig) -> Task:
    """The task ``cfg.task`` names, built for ``cfg``; ConfigError with the fix where what it
    builds is no :class:`Task`."""
    from bigbatch.train.config import ConfigError  # the configuration imports no task

    try:
        task = task_entry(cfg.task).build(cfg)
    except ValueError as exc:  # a reference in its entry that does not load
        if isinstance(exc, ConfigError) or type(exc) is not ValueError:
            raise
        raise ConfigError(str(exc)) from exc
    if not isinstance(task, Task):
        kind = type(task).__name__
        raise ConfigError(
            f"task={cfg.task} built a {kind}, which is not a bigbatch Task: subclass it, "
            f"`class {kind}(bigbatch.train.tasks.Task)`, for the defaults the loop relies on"
        )
    task.name = cfg.task  # known by the name it was chosen under (task.json, predict)
    return task


def prepare_data(task: Task, log: Log, data: Any = None) -> tuple[Any, Any]:
    """``task.prepare``, where the data is scanned and checked: a plain ValueError raised there
    is the data's fault (a plug-in that did not raise :class:`~bigbatch.train.data.DataError`),
    so every command says it in one line, the same under ``train`` and ``plan``.

    >>> class Broken(Task):
    ...     def prepare(self, log, data=None):
    ...         raise ValueError("tags.csv line 3: no tags")
    >>> task = Broken(); task.name = "tags"
    >>> prepare_data(task, print)
    Traceback (most recent call last):
    ...
    bigbatch.train.data.DataError: task=tags: tags.csv line 3: no tags
    """
    from bigbatch.train.data import DataError

    try:
        return task.prepare(log, data)
    except ValueError as exc:
        if isinstance(exc, DataError) or type(exc) is not ValueError:
            raise
        raise DataError(f"task={task.name}: {exc}") from exc


def check_declared_metrics(task: str, monitor: str, scores: Mapping[str, Any]) -> None:
    """What ``monitor=`` names (one of the metrics the registry declares for ``task``) is
    among what its validation returned: a task whose ``as_dict`` lacks it (a variant of the
    task that computes fewer, a plug-in's slip) is said at the first validation, with what it
    did return, not as a KeyError."""
    if monitor not in scores:
        from bigbatch.train.config import ConfigError  # the configuration imports no task

        returned = [k for k in scores if k not in ("epoch", "phase", "train_loss")]
        raise ConfigError(
            f"monitor={monitor}: task={task}'s validation on this data returned "
            f"{', '.join(returned) or 'nothing'}, not {monitor}: set monitor= to one of them"
        )


def read_task_info(run_dir: str | Path) -> dict[str, Any]:
    """A run folder's ``task.json`` (what its task needs to predict, and the task's name); a
    run without one is a classification run (that file came later). A damaged file is a
    ValueError with the fix."""
    path = Path(run_dir) / "task.json"
    if not path.is_file():
        return {"task": DEFAULT_TASK}
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


def run_task_entry(run_dir: str | Path) -> TaskEntry:
    """The registry entry of the task a run folder was trained for; ValueError with the fix
    where that task is not here (a plug-in not installed on this machine: the package its
    ``task.json`` recorded is named) or does not load.

    >>> run_task_entry("no/such/run").name  # a folder without task.json: classification
    'classification'
    """
    info = read_task_info(run_dir)
    name = str(info["task"])
    try:
        return task_entry(name)
    except KeyError:
        package = str(info.get("package") or "")
        if package:
            fix = f"install its plug-in here: pip install {package}"
        elif ":" in name:
            fix = f"run from the folder that holds {name.partition(':')[0]}.py, or install it"
        else:
            fix = f"install the package whose plug-in registers task {name!r}"
        raise ValueError(
            f"{run_dir} was trained with task={name}, which is not installed here: {fix}"
        ) from None


def check_finished(run_dir: str | Path, *, unfinished: bool = False) -> str:
    """Refuse to predict from a run that has not finished (ValueError naming how to finish it
    and how to use it anyway), unless ``unfinished``; returns a note for what is printed ('' for
    a finished run). A finished run has ``done.json``: its task's last step (a segmentation
    run's tuned thresholds) ran.

    >>> check_finished("no/such/run", unfinished=True)
    ''
    """
    run_dir = Path(run_dir)
    if (run_dir / "done.json").is_file() or not (run_dir / "config.json").is_file():
        return ""  # finished, or no run at all: opening it says so
    history = run_dir / "history.csv"
    epochs = max(len(history.read_text().splitlines()) - 1, 0) if history.is_file() else 0
    where = f"it stopped after epoch {epochs}" if epochs else "it has finished no epoch"
    if not unfinished:
        raise ValueError(
            f"{run_dir} is an unfinished run ({where}): `bigbatch train --resume {run_dir}` "
            "finishes it; or add --unfinished to use its best epoch so far as it is (a task's "
            "last step, such as a segmentation run's tuned thresholds, is then missing)"
        )
    return f"note: {run_dir} is unfinished ({where}); its best epoch so far was used"


def planned_eval_batch(run_dir: Path, device: torch.device, default: int = 64) -> int:
    """The batch the run planned for its validation (``valid_batch`` in plan.json), where it
    was planned for this kind of device and for the inputs prediction meets; else ``default``.
    Prediction backs off on OOM either way (:func:`bigbatch.backoff.infer_fitting`)."""
    path = run_dir / "plan.json"
    if not path.is_file():
        return default
    plan = read_json(path, "delete it: prediction then uses its default batch")
    planned = plan.get("valid_batch") if isinstance(plan, dict) else None
    where = str(plan.get("device", "")) if isinstance(plan, dict) else ""
    if not isinstance(planned, int) or planned < 1 or not where:
        return default
    return planned if torch.device(where).type == device.type else default
