"""Classification metrics from torchmetrics, accumulated over batches by state (never a mean of
batch means): accuracy, error rate, top-5, macro and micro F1, AUROC, quadratic Cohen's kappa
and each class's recall."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["METRICS", "ClassificationMetrics"]

# What monitor= may name (recall_<class> and the loss are in history.csv too).
METRICS = ("accuracy", "error_rate", "top5", "f1_macro", "f1_micro", "auroc", "kappa")
LOWER_IS_BETTER = ("error_rate",)


def _collection(num_classes: int) -> Any:
    from torchmetrics import MetricCollection
    from torchmetrics.classification import (
        MulticlassAccuracy,
        MulticlassAUROC,
        MulticlassCohenKappa,
        MulticlassF1Score,
        MulticlassRecall,
    )

    k = num_classes
    metrics: dict[str, Any] = {
        "f1_macro": MulticlassF1Score(k, average="macro"),
        "f1_micro": MulticlassF1Score(k, average="micro"),
        "auroc": MulticlassAUROC(k, average="macro"),
        "kappa": MulticlassCohenKappa(k, weights="quadratic"),
        "recall": MulticlassRecall(k, average="none"),
    }
    if k > 5:
        metrics["top5"] = MulticlassAccuracy(k, top_k=5, average="micro")
    return MetricCollection(metrics)


@dataclass
class ClassificationMetrics:
    """The validation loss (a sum, divided once by the count) and torchmetrics' states.

    >>> m = ClassificationMetrics()
    >>> m.update(torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 1, 1]))
    >>> round(m.accuracy, 4), round(m.error_rate, 4)
    (0.6667, 0.3333)
    """

    num_classes: int = 0  # 0: the logits' width, at the first update
    classes: list[str] = field(default_factory=list)
    loss_sum: float = 0.0
    correct: int = 0  # accuracy from integer counts: exact, where torchmetrics' is float32
    count: int = 0
    _metrics: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_classes:  # torchmetrics' import (seconds) when made, not at a first batch
            self._metrics = _collection(max(2, self.num_classes))

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logits = logits.float()
        if self._metrics is None:
            self._metrics = _collection(max(2, self.num_classes or logits.shape[1]))
        self.loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
        self.count += int(targets.numel())
        self.correct += int((logits.argmax(dim=1) == targets).sum())
        self._metrics.update(logits.softmax(1).cpu(), targets.cpu())

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    def _computed(self) -> dict[str, Any]:
        if not self.count:
            return {}
        with warnings.catch_warnings():
            # AUROC of a class absent from the validation set: torchmetrics warns, says 0.
            warnings.simplefilter("ignore", UserWarning)
            return dict(self._metrics.compute())

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else math.nan

    @property
    def error_rate(self) -> float:
        return 1.0 - self.accuracy

    def as_dict(self, prefix: str = "valid_") -> dict[str, float]:
        values = self._computed()
        row = {f"{prefix}loss": self.loss, "accuracy": self.accuracy, "error_rate": self.error_rate}
        row |= {k: float(v) for k, v in values.items() if k != "recall"}
        recall = values.get("recall")
        if recall is not None:
            names = self.classes or [str(i) for i in range(len(recall))]
            row |= {f"recall_{n}": float(r) for n, r in zip(names, recall, strict=False)}
        return row
