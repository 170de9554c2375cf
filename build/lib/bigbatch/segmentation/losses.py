"""Segmentation losses, and which of them accumulate exactly.

A loss accumulates exactly when it is a mean of per-sample terms: then weighting each
micro-batch by its number of samples and dividing the window by the total gives the big batch's
gradient. BCE over equally sized images or patches is such a mean, and so is Dice computed **per
sample** and then averaged. The **batch** Dice sums intersections and areas over the whole batch
before taking the ratio: its value on 4 micro-batches of 8 is not its value on the batch of 32,
whatever the weights, so it carries ``couples_samples = True`` for ``bigbatch verify`` and for
readers, and the per-sample Dice is the one to accumulate.

Shapes: logits ``(N, C, *spatial)``. Binary (C == 1): target ``(N, 1, *spatial)`` or
``(N, *spatial)`` of 0/1. Multi-class (C > 1): target ``(N, *spatial)`` of class indices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["batch_dice_loss", "bce_dice_loss", "dice_loss", "seg_bce_loss"]


def _probs_and_onehot(
    logits: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() < 3:
        raise ValueError(
            f"segmentation logits are (N, C, *spatial), got shape {tuple(logits.shape)}"
        )
    classes = logits.shape[1]
    if classes == 1:
        if target.dim() == logits.dim() - 1:
            target = target.unsqueeze(1)
        if target.shape != logits.shape:
            raise ValueError(
                f"a binary mask must have the logits' shape {tuple(logits.shape)} (or without the "
                f"channel), got {tuple(target.shape)}"
            )
        return torch.sigmoid(logits), target.to(logits.dtype)
    if target.shape != (logits.shape[0], *logits.shape[2:]):
        raise ValueError(
            f"a multi-class mask holds class indices of shape {(logits.shape[0], *logits.shape[2:])}, "
            f"got {tuple(target.shape)}"
        )
    onehot = F.one_hot(target.long(), classes).movedim(-1, 1).to(logits.dtype)
    return torch.softmax(logits, dim=1), onehot


def _dice_terms(
    logits: torch.Tensor, target: torch.Tensor, dims: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    probs, onehot = _probs_and_onehot(logits, target)
    return (probs * onehot).sum(dims), probs.sum(dims) + onehot.sum(dims)


def dice_loss(logits: torch.Tensor, target: torch.Tensor, *, smooth: float = 1.0) -> torch.Tensor:
    """Soft Dice loss per sample and class, averaged over classes and then over samples: a mean
    of per-sample terms, so accumulation with ``count=len(batch)`` is exact.

    >>> logits = torch.full((2, 1, 4, 4), 10.0); mask = torch.ones(2, 4, 4)
    >>> round(float(dice_loss(logits, mask)), 4)
    0.0
    """
    spatial = tuple(range(2, logits.dim()))
    inter, total = _dice_terms(logits, target, spatial)  # (N, C)
    return (1 - (2 * inter + smooth) / (total + smooth)).mean()


def batch_dice_loss(
    logits: torch.Tensor, target: torch.Tensor, *, smooth: float = 1.0
) -> torch.Tensor:
    """Soft Dice with intersections and areas summed over the whole batch before the ratio.

    It couples the samples (``batch_dice_loss.couples_samples`` is True): no weighting makes
    accumulated micro-batches equal the big batch. Use :func:`dice_loss` (per sample) with
    accumulation; ``bigbatch verify`` explains the difference on your model.
    """
    dims = (0, *range(2, logits.dim()))
    inter, total = _dice_terms(logits, target, dims)  # (C,)
    return (1 - (2 * inter + smooth) / (total + smooth)).mean()


batch_dice_loss.couples_samples = True  # type: ignore[attr-defined]


def seg_bce_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """BCE (binary) or cross-entropy (multi-class) averaged over every pixel or voxel: over
    samples of one size, a mean of per-sample means, so it accumulates exactly."""
    if logits.shape[1] == 1:
        probs_target = target.unsqueeze(1) if target.dim() == logits.dim() - 1 else target
        return F.binary_cross_entropy_with_logits(logits, probs_target.to(logits.dtype))
    return F.cross_entropy(logits, target.long())


def bce_dice_loss(
    logits: torch.Tensor, target: torch.Tensor, *, dice_weight: float = 1.0
) -> torch.Tensor:
    """BCE (or cross-entropy) + per-sample Dice: the usual segmentation loss, exact under
    accumulation.

    >>> logits = torch.zeros(2, 3, 4, 4); mask = torch.zeros(2, 4, 4, dtype=torch.long)
    >>> bce_dice_loss(logits, mask).shape
    torch.Size([])
    """
    return seg_bce_loss(logits, target) + dice_weight * dice_loss(logits, target)
