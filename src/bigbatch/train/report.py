"""history.csv and the training-curves plot, rewritten atomically after every epoch."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from bigbatch.io import atomic_write_csv, atomic_write_figure

__all__ = ["plot_history", "write_history"]


def write_history(rows: list[dict[str, Any]], path: str | Path) -> None:
    if not rows:
        return
    atomic_write_csv(path, list(rows[-1]), rows)


log = logging.getLogger("bigbatch")
_SAID = False  # whether the missing matplotlib was reported (once a process)


def plot_history(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """``history.png``: the losses and the task's scores by epoch (without matplotlib, the
    ``plot`` extra, none: said once per process; ``history.csv`` has the numbers)."""
    global _SAID
    try:
        import matplotlib
    except ModuleNotFoundError:
        if not _SAID:
            log.warning(
                "bigbatch: no history.png without matplotlib: pip install 'bigbatch[plot]' "
                "(history.csv holds the same numbers)"
            )
            _SAID = True
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="train loss")
    if "valid_loss" in rows[-1]:  # absent without a validation set: the losses alone
        ax_loss.plot(epochs, [r["valid_loss"] for r in rows], marker="o", label="valid loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_loss.grid(True, alpha=0.3)
    # Classification's scores, or segmentation's (per-class Dice as thin lines).
    shown = [(k, c) for k, c in (("accuracy", "green"), ("error_rate", "red")) if k in rows[-1]]
    shown += [(k, c) for k, c in (("dice", "green"), ("jaccard", "purple")) if k in rows[-1]]
    if shown:
        for key, color in shown:
            label = key.replace("_", " ")
            ax_metric.plot(epochs, [r[key] for r in rows], marker="o", color=color, label=label)
        for key in (k for k in rows[-1] if k.startswith("dice_")):
            ax_metric.plot(epochs, [r[key] for r in rows], linewidth=0.8, alpha=0.6, label=key)
        ax_metric.set_xlabel("epoch")
        ax_metric.set_ylim(0, 1)
        ax_metric.legend(loc="lower left")
        ax_metric.grid(True, alpha=0.3)
        if "hd95" in rows[-1]:  # a distance, not a 0..1 score: its own axis
            ax_hd = ax_metric.twinx()
            ax_hd.plot(epochs, [r["hd95"] for r in rows], marker="s", color="grey", label="hd95")
            ax_hd.set_ylabel("hd95 (lower is better)")
            ax_hd.legend(loc="lower right")
    else:
        ax_metric.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    atomic_write_figure(fig, path, dpi=100)
