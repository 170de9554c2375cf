"""A finished run, opened for prediction: its config, its task's ``task.json`` and its weights.
The one way every task's ``predict``, ``ensemble`` and submission open a run folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from bigbatch.train.checkpoint import load_weights_file
from bigbatch.train.config import ConfigError, TrainConfig, config_from_json
from bigbatch.train.tasks import read_task_info

__all__ = ["TrainedRun", "check_run_folder"]


def check_run_folder(run_dir: str | Path) -> None:
    """ConfigError with the fix where ``run_dir`` is no run folder ``bigbatch train`` wrote
    (no ``config.json``): before anything is written beside it, such as its predictions.

    >>> check_run_folder("no/such/run")
    Traceback (most recent call last):
    ...
    bigbatch.train.config.ConfigError: no/such/run is not a bigbatch run folder (no config.json); train one first
    """
    if not (Path(run_dir) / "config.json").is_file():
        raise ConfigError(
            f"{run_dir} is not a bigbatch run folder (no config.json); train one first"
        )


@dataclass(frozen=True)
class TrainedRun:
    """A run folder ``bigbatch train`` wrote: ``config`` (its starting weights dropped: the
    run's own replace them), ``info`` (its ``task.json``) and the checkpoint's ``weights``.

    >>> TrainedRun.open("no/such/run")
    Traceback (most recent call last):
    ...
    bigbatch.train.config.ConfigError: no/such/run is not a bigbatch run folder (no config.json); train one first
    """

    run_dir: Path
    config: TrainConfig
    info: dict[str, Any]
    weights: Path

    @classmethod
    def open(cls, run_dir: str | Path, checkpoint: str = "best", task: str = "") -> TrainedRun:
        """The run in ``run_dir`` at ``checkpoint`` (best or last); ConfigError with the fix
        where it is no run, a damaged one, one of another ``task``, or one without weights."""
        run_dir = Path(run_dir)
        check_run_folder(run_dir)
        saved = run_dir / "config.json"
        config = config_from_json(saved.read_text(), str(saved))
        try:
            info = read_task_info(run_dir)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if task and info.get("task") != task:
            raise ConfigError(f"{run_dir} is a task={info.get('task')} run, not a {task} run")
        weights = run_dir / f"{checkpoint}.safetensors"
        if not weights.is_file():
            raise ConfigError(f"{weights} does not exist: the run has not finished an epoch yet")
        config.pretrained, config.weights = False, ""
        return cls(run_dir, config, info, weights)

    def load_into(self, model: nn.Module) -> nn.Module:
        """``model`` (built from :attr:`config`) with the run's weights; ConfigError where they
        do not fit it."""
        try:
            load_weights_file(model, self.weights)
        except Exception as exc:
            raise ConfigError(
                f"cannot load {self.weights}: {type(exc).__name__}: {str(exc)[:200]}; it is "
                "damaged, or the run's config.json names another model"
            ) from exc
        return model
