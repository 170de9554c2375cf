"""Image regression's own configuration keys (``cfg.options``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bigbatch.train.tasks.options import TaskOptions, option

__all__ = ["RegressionOptions"]


@dataclass
class RegressionOptions(TaskOptions):
    loss: str = option(
        "mse",
        "regression: mse, huber (delta huber_delta, on standardised targets) or l1",
        choices=("mse", "huber", "l1"),
    )
    huber_delta: float = option(1.0, "regression: Huber's delta, in standard deviations")
    targets: str = option(
        "",
        "regression: the CSV's target columns, comma-separated; empty: every column after the file",
    )

    def check(self, cfg: Any) -> None:
        if self.huber_delta <= 0:
            raise ValueError(f"huber_delta must be > 0, got {self.huber_delta}")
