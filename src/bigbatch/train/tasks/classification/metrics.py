"""Classification metrics, accumulated over batches by count (never a mean of batch means)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ClassificationMetrics"]


@dataclass
class ClassificationMetrics:
    """Running loss (sum), correct predictions and count.

    >>> m = ClassificationMetrics()
    >>> m.update(torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 1, 1]))
    >>> round(m.accuracy, 4), round(m.error_rate, 4)
    (0.6667, 0.3333)
    """

    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logits = logits.float()
        self.loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
        self.correct += int((logits.argmax(dim=1) == targets).sum())
        self.count += int(targets.numel())

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else float("nan")

    @property
    def error_rate(self) -> float:
        return 1.0 - self.accuracy

    def as_dict(self, prefix: str = "valid_") -> dict[str, float]:
        return {
            f"{prefix}loss": self.loss,
            "accuracy": self.accuracy,
            "error_rate": self.error_rate,
        }
