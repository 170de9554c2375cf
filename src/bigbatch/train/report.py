"""history.csv and the training-curves plot, rewritten atomically after every epoch."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from bigbatch.io import atomic_write_csv, atomic_write_figure
from bigbatch.train.registry import TaskEntry, task_entry

__all__ = ["plot_history", "write_history"]


def write_history(rows: list[dict[str, Any]], path: str | Path) -> None:
    if not rows:
        return
    atomic_write_csv(path, list(rows[-1]), rows)


log = logging.getLogger("bigbatch")
_SAID = False  # whether the missing matplotlib was reported (once a process)


def plot_history(
    rows: list[dict[str, Any]], path: str | Path, task: str = "", title: str = ""
) -> None:
    """``history.png``: the losses by epoch, then the ``task``'s metrics as its registry entry
    declares them (:class:`bigbatch.train.registry.TaskEntry`): fractions of 1 (accuracy, Dice)
    together on a 0..1 axis, with their per-class columns (``dice_<class>``) as thin lines, and
    each other metric (a distance, an error in the targets' units) in a panel of its own,
    marked where lower is better. Without matplotlib, the ``plot`` extra, none: said once per
    process; ``history.csv`` has the numbers."""
    global _SAID
    try:
        # A bare Figure, not pyplot's: drawn on a thread of its own (io.BackgroundWriter), with no
        # global figure list or backend to share with the caller's plots. matplotlib itself
        # first: the plot extra installed or not.
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        if not _SAID:
            log.warning(
                "bigbatch: no history.png without matplotlib: pip install 'bigbatch[plot]' "
                "(history.csv holds the same numbers)"
            )
            _SAID = True
        return

    last = rows[-1]
    entry = _entry(task)
    metrics = [m for m in (entry.metrics if entry else ()) if m in last]
    fractions = [m for m in metrics if entry and m in entry.fractions]
    others = [m for m in metrics if m not in fractions]
    fig = Figure(figsize=(5 * (1 + bool(fractions) + len(others)), 4))
    axes = fig.subplots(1, 1 + bool(fractions) + len(others), squeeze=False)
    panels = list(axes[0])
    epochs = [r["epoch"] for r in rows]
    ax_loss = panels.pop(0)
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train loss")
    if "valid_loss" in last:  # absent without a validation set: the losses alone
        ax_loss.plot(epochs, [r["valid_loss"] for r in rows], marker="o", label="valid loss")
    _finish(ax_loss, "loss")
    if fractions:
        ax = panels.pop(0)
        for key in fractions:
            ax.plot(epochs, [r[key] for r in rows], marker="o", label=key.replace("_", " "))
            for part in (k for k in last if k.startswith(f"{key}_") and k not in metrics):
                ax.plot(epochs, [r[part] for r in rows], linewidth=0.8, alpha=0.6, label=part)
        ax.set_ylim(0, 1)
        _finish(ax, "")
    for key, ax in zip(others, panels, strict=True):
        ax.plot(epochs, [r[key] for r in rows], marker="s", color="grey", label=key)
        lower = entry is not None and key in entry.lower_is_better
        _finish(ax, f"{key} ({'lower' if lower else 'higher'} is better)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    atomic_write_figure(fig, path, dpi=100)


def _finish(ax: Any, ylabel: str) -> None:
    ax.set_xlabel("epoch")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.legend(loc="best", fontsize="small")
    ax.grid(True, alpha=0.3)


def _entry(task: str) -> TaskEntry | None:
    """The task's registry entry; None for none or one not registered here (losses only)."""
    if not task:
        return None
    try:
        return task_entry(task)
    except (KeyError, ValueError):
        return None
