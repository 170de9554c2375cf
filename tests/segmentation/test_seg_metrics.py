"""Dice and Jaccard accumulated batch by batch equal a direct computation on the whole set."""

from __future__ import annotations

import torch

from bigbatch.segmentation.metrics import SegmentationMetrics


def direct(pred: torch.Tensor, target: torch.Tensor, classes: list[int]) -> tuple[list, list]:
    dice, jac = [], []
    for c in classes:
        p, t = pred == c, target == c
        inter = float((p & t).sum())
        dice.append(2 * inter / float(p.sum() + t.sum()))
        jac.append(inter / float((p | t).sum()))
    return dice, jac


def test_multiclass_metrics_over_uneven_batches_equal_the_whole_set() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 3, 6, 6, 6, generator=g)
    target = torch.randint(0, 3, (10, 6, 6, 6), generator=g)
    m = SegmentationMetrics(num_classes=3)
    for a, b in [(0, 1), (1, 5), (5, 10)]:  # batches of 1, 4, 5: a mean of means would differ
        m.update(logits[a:b], target[a:b])
    out = m.compute()
    dice, jac = direct(logits.argmax(1), target, [0, 1, 2])
    assert out["dice_per_class"] == dice
    assert out["jaccard_per_class"] == jac
    assert out["dice"] == sum(dice[1:]) / 2  # the background is left out of the mean


def test_binary_metrics_score_the_foreground() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 1, 8, 8, generator=g)
    target = (torch.rand(7, 8, 8, generator=g) > 0.5).long()
    m = SegmentationMetrics(num_classes=1)
    m.update(logits[:2], target[:2])
    m.update(logits[2:], target[2:])
    dice, jac = direct((logits[:, 0] > 0).long(), target, [1])
    assert m.compute()["dice"] == dice[0]
    assert m.compute()["jaccard"] == jac[0]
