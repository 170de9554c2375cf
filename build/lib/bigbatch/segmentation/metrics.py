"""Dice and Jaccard (IoU) over a whole set, from summed intersections and areas."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SegmentationMetrics"]


@dataclass
class SegmentationMetrics:
    """Accumulate hard-prediction overlaps batch by batch; :meth:`compute` gives Dice and Jaccard
    per class and their mean, exactly as if the whole set were one batch (sums, not means of
    per-batch means). Binary masks (one logit channel, threshold 0.5) score the foreground.

    >>> m = SegmentationMetrics(num_classes=1)
    >>> m.update(torch.tensor([[[[5.0, -5.0]]]]), torch.tensor([[[1, 1]]]))
    >>> m.compute()["dice"], m.compute()["jaccard"]
    (0.6666666666666666, 0.5)
    """

    num_classes: int
    intersection: torch.Tensor = field(init=False)
    predicted: torch.Tensor = field(init=False)
    actual: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        self.reset()

    def reset(self) -> None:
        scored = self.num_classes if self.num_classes > 1 else 1
        self.intersection = torch.zeros(scored, dtype=torch.float64)
        self.predicted = torch.zeros(scored, dtype=torch.float64)
        self.actual = torch.zeros(scored, dtype=torch.float64)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        if logits.shape[1] == 1:
            pred = (logits[:, 0] > 0).long()  # sigmoid > 0.5
            target = target.reshape(pred.shape).long()
            classes = [1]
        else:
            pred = logits.argmax(1)
            target = target.long()
            classes = list(range(self.num_classes))
        for i, c in enumerate(classes):
            p, t = pred == c, target == c
            self.intersection[i] += float((p & t).sum())
            self.predicted[i] += float(p.sum())
            self.actual[i] += float(t.sum())

    def compute(self) -> dict[str, object]:
        """``dice``/``jaccard`` (means over the classes but the background) and
        ``dice_per_class``/``jaccard_per_class`` (every class).
        A class absent from both prediction and truth scores 1 (nothing to miss)."""
        union = self.predicted + self.actual - self.intersection
        total = self.predicted + self.actual
        dice = torch.where(
            total > 0, 2 * self.intersection / total.clamp(min=1), torch.ones_like(total)
        )
        jaccard = torch.where(
            union > 0, self.intersection / union.clamp(min=1), torch.ones_like(union)
        )
        # The means leave the background (class 0) out: it is most of every image and would
        # hide how well the structures themselves are found.
        scored = slice(1, None) if self.num_classes > 1 else slice(None)
        return {
            "dice": float(dice[scored].mean()),
            "jaccard": float(jaccard[scored].mean()),
            "dice_per_class": dice.tolist(),
            "jaccard_per_class": jaccard.tolist(),
        }
