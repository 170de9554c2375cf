"""``bigbatch ensemble EXPERIMENTS.toml``: several members trained from one experiments file, then
their predictions averaged, as the members' task does it (its registry entry's ``experiments``),
with bigbatch's training loop handed in (a task never imports the loop)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bigbatch.train.config import ConfigError, TrainConfig, read_toml
from bigbatch.train.loop import train
from bigbatch.train.registry import task_entry

__all__ = ["run_ensemble"]


def run_ensemble(
    experiments: str | Path,
    out_dir: str | Path,
    *,
    log: Any = print,
    overrides: list[str] | None = None,
) -> Any:
    """Train the experiments file's members into ``out_dir`` and ensemble them, through the
    task its ``[common]`` table names (the default task otherwise); the task's result (its
    ``summary(out_dir)`` is what the command prints)."""
    common = read_toml(Path(experiments), "experiments file").get("common", {})
    task = str(common.get("task", TrainConfig.task))
    try:
        entry = task_entry(task)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{experiments}: {exc.args[0]}") from None
    try:
        run = entry.experiments_fn()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if run is None:
        raise ConfigError(
            f"task={task} has no ensemble of experiments: train its runs with bigbatch train, "
            "then ensemble them with bigbatch ensemble RUN RUN ... --images DIR"
        )
    return run(experiments, out_dir, train=train, log=log, overrides=overrides)
