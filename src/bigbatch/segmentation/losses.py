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

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "BATCH_LOSSES",
    "MONAI_LOSSES",
    "MULTILABEL_LOSSES",
    "batch_dice_loss",
    "batch_loss",
    "bce_dice_loss",
    "dice_loss",
    "multilabel_loss",
    "per_sample_loss",
    "seg_bce_loss",
]


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


def _labels_and_mask(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``(N, 1, *spatial)`` with void voxels set to 0, and the mask of labelled voxels
    in the logits' dtype (void voxels 0), from a target ``(N, *spatial)`` or ``(N, 1, ...)``."""
    if target.dim() == logits.dim():
        target = target[:, 0]
    valid = torch.ones_like(target, dtype=torch.bool)
    if ignore_index is not None:
        valid = target != ignore_index
    labels = torch.where(valid, target, torch.zeros_like(target)).long()[:, None]
    return labels, valid[:, None].to(logits.dtype)


MONAI_LOSSES = ("dice", "dice_ce", "dice_focal", "ce")
BATCH_LOSSES = ("dice_batch", "dice_ce_batch")


def per_sample_loss(
    name: str, *, num_classes: int, ignore_index: int | None = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """MONAI's Dice, Dice + cross-entropy, Dice + focal (or cross-entropy alone) as the mean over
    samples of each sample's own loss, so that accumulating micro-batches with
    ``count=len(batch)`` is exact. Each sample's Dice is MONAI's (per class, averaged over the
    classes); its cross-entropy and focal terms are averaged over its own labelled voxels, so
    voxels labelled ``ignore_index`` (a void label) count nowhere.

    ``num_classes`` 1 is binary (a sigmoid output, masks of 0/1); K > 1 a softmax over K classes
    (masks of class indices). The returned function takes logits ``(N, C, *spatial)`` and masks
    ``(N, *spatial)``.

    >>> loss = per_sample_loss("dice_ce", num_classes=3, ignore_index=255)
    >>> mask = torch.zeros(2, 4, 4, dtype=torch.long); mask[0, 0, 0] = 255
    >>> bool(loss(torch.zeros(2, 3, 4, 4, requires_grad=True), mask) > 0)
    True
    """
    if name not in MONAI_LOSSES:
        raise ValueError(f"loss={name!r} is not one of {', '.join(MONAI_LOSSES)}")
    # MONAI is the segmentation extra; the rest of this module needs only torch.
    from monai.losses import MaskedDiceLoss
    from monai.losses.focal_loss import sigmoid_focal_loss, softmax_focal_loss

    binary = num_classes == 1
    dice = MaskedDiceLoss(
        sigmoid=binary, softmax=not binary, to_onehot_y=not binary, reduction="none"
    )

    def focal(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # MONAI's functions, not its FocalLoss class: the class computes in float32 whatever the
        # input, which float64 equivalence checks (and float64 users) would not expect.
        if binary:
            return sigmoid_focal_loss(logits, labels.to(logits.dtype), gamma=2.0)
        onehot = F.one_hot(labels[:, 0], logits.shape[1]).movedim(-1, 1).to(logits.dtype)
        return softmax_focal_loss(logits, onehot, gamma=2.0)

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, mask = _labels_and_mask(logits, target, ignore_index)
        voxels = mask.flatten(1).sum(1).clamp(min=1)  # each sample's labelled voxels
        terms = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
        if name != "ce":
            d = dice(logits, labels.to(logits.dtype) if binary else labels, mask)
            terms = terms + d.flatten(1).mean(1)
        if name in ("dice_ce", "ce"):
            if binary:
                ce = F.binary_cross_entropy_with_logits(
                    logits, labels.to(logits.dtype), reduction="none"
                )
            else:
                ce = F.cross_entropy(logits, labels[:, 0], reduction="none")[:, None]
            terms = terms + (ce * mask).flatten(1).sum(1) / voxels
        if name == "dice_focal":
            fl = focal(logits, labels)
            terms = terms + (fl * mask).flatten(1).sum(1) / (voxels * fl.shape[1])
        return terms.mean()

    return loss


MULTILABEL_LOSSES = ("dice_bce", "dice", "bce")


def multilabel_loss(name: str = "dice_bce") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """For classes that overlap (a pixel can be Fish and Sugar): a sigmoid per class, each
    sample's Dice per class (MONAI's) averaged over the classes, plus its binary cross-entropy
    averaged over its pixels, then the mean over the samples: a mean of per-sample terms, so
    accumulating micro-batches with ``count=len(batch)`` is exact.

    Takes logits ``(N, C, *spatial)`` and masks of the same shape, 0/1 per class.

    >>> loss = multilabel_loss("dice_bce")
    >>> masks = torch.zeros(2, 4, 8, 8); masks[0, :2, 2:5, 2:5] = 1  # two classes overlap
    >>> bool(loss(torch.zeros(2, 4, 8, 8, requires_grad=True), masks) > 0)
    True
    """
    if name not in MULTILABEL_LOSSES:
        raise ValueError(f"loss={name!r} is not one of {', '.join(MULTILABEL_LOSSES)}")
    from monai.losses import DiceLoss

    dice = DiceLoss(sigmoid=True, reduction="none")

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.shape != logits.shape:
            raise ValueError(
                f"multilabel masks have the logits' shape {tuple(logits.shape)} (a 0/1 plane "
                f"per class), got {tuple(target.shape)}"
            )
        target = target.to(logits.dtype)
        terms = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
        if name != "bce":
            terms = terms + dice(logits, target).flatten(1).mean(1)
        if name != "dice":
            bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
            terms = terms + bce.flatten(1).mean(1)
        return terms.mean()

    return loss


def batch_loss(
    name: str, *, num_classes: int, ignore_index: int | None = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """MONAI's batch Dice (intersections and areas summed over the whole batch before the
    ratio, as nnU-Net trains), alone (``dice_batch``) or with the cross-entropy over every
    labelled voxel of the batch (``dice_ce_batch``). It couples the samples
    (``couples_samples`` is True): accumulating it per micro-batch trains another objective, so
    ``bigbatch train`` runs it through :func:`bigbatch.coupled.cached_backward`, which gives the
    big batch's gradient with one micro-batch's activations.

    >>> loss = batch_loss("dice_batch", num_classes=2)
    >>> loss.couples_samples
    True
    """
    if name not in BATCH_LOSSES:
        raise ValueError(f"loss={name!r} is not one of {', '.join(BATCH_LOSSES)}")
    from monai.losses import MaskedDiceLoss

    binary = num_classes == 1
    dice = MaskedDiceLoss(sigmoid=binary, softmax=not binary, to_onehot_y=not binary, batch=True)

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, mask = _labels_and_mask(logits, target, ignore_index)
        total = dice(logits, labels.to(logits.dtype) if binary else labels, mask)
        if name == "dice_ce_batch":
            if binary:
                ce = F.binary_cross_entropy_with_logits(
                    logits, labels.to(logits.dtype), reduction="none"
                )
            else:
                ce = F.cross_entropy(logits, labels[:, 0], reduction="none")[:, None]
            total = total + (ce * mask).sum() / mask.sum().clamp(min=1)
        return total

    loss.couples_samples = True  # type: ignore[attr-defined]
    return loss
