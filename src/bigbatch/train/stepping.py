"""One window of ``bigbatch train``: its micro-batches with the OOM back-off (through gradient
caching when the task's loss couples the samples), then the EMA's update."""

from __future__ import annotations

from typing import Any

import torch

from bigbatch.backoff import run_coupled_window, run_window
from bigbatch.train.state import Phase, Run

__all__ = ["step_window"]


def step_window(run: Run, ph: Phase, window: Any) -> Any:
    """One window with the OOM back-off: through gradient caching when the task's loss couples
    the samples (a batch Dice), else micro-batch by micro-batch; then the EMA's update."""
    task, model, acc, where = run.task, ph.model, ph.acc, run.where
    if task.couples_samples:
        x, y = window

        def encode(inputs: torch.Tensor) -> torch.Tensor:
            with where.autocast():
                return model(where.inputs(inputs))

        pair = (x, where.targets(y))
        result = run_coupled_window(
            acc, pair, encode, task.loss, run.backoff, device=where.device, model=model
        )
    else:
        result = run_window(
            acc,
            window,
            lambda micro: task.step(model, micro, where),
            run.backoff,
            split=task.split,
            device=where.device,
            model=model,
        )
    if run.ema is not None and not result.skipped:
        run.ema.update(run.core, step=acc.optimizer_step)
    return result
