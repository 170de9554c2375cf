"""From per-class probabilities to a Kaggle submission: each class's threshold and smallest
kept component, chosen on the validation set by the competition's own score, then applied to
the test set's probabilities at the submission's mask size.

The score is the one Understanding Clouds and Severstal rank by: the Dice of every image-class
pair (an empty prediction of an empty mask scores 1, a non-empty one 0; MONAI's ``compute_dice``
with ``ignore_empty=False``), averaged over the pairs. Dropping components under a size is the
standard trick there: a few stray pixels on an empty mask cost a whole pair.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bigbatch.io import DamagedFileError, read_json

__all__ = [
    "ClassRule",
    "apply_rules",
    "competition_dice",
    "load_rules",
    "pair_dice",
    "resize_masks",
    "resize_probabilities",
    "save_rules",
    "tune_rules",
]

THRESHOLDS = tuple(round(0.05 * k, 2) for k in range(4, 16))  # 0.2 to 0.75
# Smallest kept component, as shares of the mask's area (Clouds' kernels keep 5-14 %).
MIN_SIZE_SHARES = (0.0, 0.005, 0.01, 0.025, 0.05, 0.1)


@dataclass(frozen=True)
class ClassRule:
    """How one class's probabilities become its mask: above ``threshold``, then connected
    components of fewer than ``min_size`` pixels (at the mask size) dropped.

    >>> ClassRule(threshold=0.35, min_size=10_000)
    ClassRule(threshold=0.35, min_size=10000)
    """

    threshold: float = 0.5
    min_size: int = 0


def resize_probabilities(probs: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(N, C, H, W) probabilities at the mask size (bilinear, as they are averages already)."""
    if tuple(probs.shape[-2:]) == size:
        return probs
    return F.interpolate(probs.float(), size=size, mode="bilinear", align_corners=False)


def resize_masks(masks: torch.Tensor, size: tuple[int, int]) -> np.ndarray:
    """(N, C, H, W) 0/1 masks at the mask size, by nearest neighbour, as booleans.

    >>> resize_masks(torch.ones(1, 1, 4, 4), (2, 2)).shape
    (1, 1, 2, 2)
    """
    return F.interpolate(masks.float(), size=size, mode="nearest").bool().numpy()


def _components(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each pixel's connected component (0: background) and each component's size."""
    from scipy import ndimage  # the segmentation extra's

    labels, count = ndimage.label(mask)
    return labels, np.bincount(labels.ravel(), minlength=count + 1)


def _kept(labels: np.ndarray, sizes: np.ndarray, min_size: int) -> np.ndarray:
    keep = sizes >= min_size
    keep[0] = False
    return keep[labels]


def _keep_large(mask: np.ndarray, min_size: int) -> np.ndarray:
    if min_size <= 0 or not mask.any():
        return mask
    return _kept(*_components(mask), min_size)


def apply_rules(probs: np.ndarray, rules: Sequence[ClassRule]) -> np.ndarray:
    """(C, H, W) probabilities of one image -> its (C, H, W) boolean masks.

    >>> probs = np.zeros((1, 4, 4)); probs[0, 0, 0] = 0.9; probs[0, 2:, 2:] = 0.8
    >>> int(apply_rules(probs, [ClassRule(0.5, min_size=2)]).sum())  # the lone pixel dropped
    4
    """
    if len(rules) != probs.shape[0]:
        raise ValueError(f"{len(rules)} rules for {probs.shape[0]} classes")
    return np.stack(
        [_keep_large(p > r.threshold, r.min_size) for p, r in zip(probs, rules, strict=True)]
    )


def pair_dice(predicted: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """The Dice of every image-class pair, ``(N, C)`` float64 from exact pixel counts, of
    (N, C, H, W) boolean masks; an empty prediction of an empty mask scores 1 (MONAI's
    ``compute_dice`` with ``ignore_empty=False``).

    >>> truth = np.zeros((2, 1, 4, 4), bool)
    >>> truth[0, 0, :1] = True  # the second image has none of the class
    >>> predicted = np.zeros_like(truth)
    >>> predicted[0, 0, :2] = True
    >>> pair_dice(predicted, truth).round(3).tolist()
    [[0.667], [1.0]]
    """
    # Counted here rather than by MONAI's compute_dice, whose one-class answer is float32 (it
    # reads one channel as class labels): 2 I / (P + T) from exact counts, in float64.
    predicted, truth = np.asarray(predicted, bool), np.asarray(truth, bool)
    if predicted.shape != truth.shape or predicted.ndim < 3:
        raise ValueError(
            f"predicted {predicted.shape} and truth {truth.shape} masks differ or lack the "
            "(N, C, ...) layout: pass one boolean plane per image and class in both"
        )
    spatial = tuple(range(2, predicted.ndim))
    overlap = (predicted & truth).sum(spatial)
    total = predicted.sum(spatial) + truth.sum(spatial)
    # An empty prediction of an empty mask scores 1, as MONAI's ignore_empty=False.
    return np.where(total == 0, 1.0, 2 * overlap / np.maximum(total, 1))


def competition_dice(predicted: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Each class's mean Dice over the images (:func:`pair_dice`), (N, C, H, W) boolean masks
    in.

    >>> empty = np.zeros((2, 1, 3, 3), dtype=bool)
    >>> competition_dice(empty, empty).tolist()
    [1.0]
    """
    return pair_dice(predicted, truth).mean(0)


def tune_rules(
    probs: np.ndarray,
    truth: np.ndarray,
    thresholds: Sequence[float] = THRESHOLDS,
    min_size_shares: Sequence[float] = MIN_SIZE_SHARES,
) -> tuple[list[ClassRule], np.ndarray]:
    """Each class's rule that scores best on the validation set (``probs`` and ``truth``
    (N, C, H, W) at the submission's mask size), and its score; ties keep the lower threshold
    and the smaller size.

    >>> truth = np.zeros((1, 1, 4, 4), bool)
    >>> truth[0, 0, 0] = True
    >>> probs = np.zeros((1, 1, 4, 4))
    >>> probs[0, 0, 0], probs[0, 0, 1] = 0.9, 0.4
    >>> rules, scores = tune_rules(probs, truth)
    >>> rules, scores.tolist()
    ([ClassRule(threshold=0.4, min_size=0)], [1.0])
    """
    if probs.shape != truth.shape:
        raise ValueError(f"probabilities {probs.shape} and masks {truth.shape} differ in shape")
    area = probs.shape[-2] * probs.shape[-1]
    sizes = sorted({round(share * area) for share in min_size_shares})
    rules, scores = [], []
    for c in range(probs.shape[1]):
        best = (-1.0, ClassRule())
        for threshold in thresholds:
            # Each image's components once per threshold; every size only filters them.
            parts = [_components(m) for m in probs[:, c] > threshold]
            for size in sizes:
                kept = np.stack([_kept(labels, counts, size) for labels, counts in parts])[:, None]
                score = float(competition_dice(kept, truth[:, c : c + 1])[0])
                if score > best[0]:
                    best = (score, ClassRule(float(threshold), size))
        scores.append(best[0])
        rules.append(best[1])
    return rules, np.array(scores)


def save_rules(
    path: str | Path,
    classes: Sequence[str],
    rules: Sequence[ClassRule],
    scores: Sequence[float],
    mask_size: tuple[int, int],
) -> None:
    """``postprocess.json``: each class's rule and validation score, and the mask size they
    were chosen at (a rule's ``min_size`` counts pixels at that size), written atomically;
    :func:`load_rules` reads it back.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "postprocess.json"
    >>> rules = [ClassRule(0.4, 100), ClassRule()]
    >>> save_rules(path, ["Fish", "Flower"], rules, [0.61, 0.55], (350, 525))
    >>> load_rules(path, ["Flower"])
    ([ClassRule(threshold=0.5, min_size=0)], (350, 525))
    """
    from bigbatch.io import atomic_write_text

    body = {
        "mask_size": list(mask_size),
        "classes": {
            name: asdict(rule) | {"valid_dice": round(float(score), 6)}
            for name, rule, score in zip(classes, rules, scores, strict=True)
        },
    }
    atomic_write_text(Path(path), json.dumps(body, indent=1))


def load_rules(path: str | Path, classes: Sequence[str]) -> tuple[list[ClassRule], tuple[int, int]]:
    """The rules of ``classes`` from ``postprocess.json`` (:func:`save_rules`), and their mask
    size; a class it does not hold is refused (it was not seen in training), and so is a rule
    out of range (a hand edit).

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "postprocess.json"
    >>> save_rules(path, ["Fish"], [ClassRule(0.4, 100)], [0.61], (350, 525))
    >>> load_rules(path, ["Gravel"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: class 'Gravel' was not seen in training (...postprocess.json holds Fish): ...
    """
    fix = (
        "bigbatch train writes it after training; restore it from a copy, or delete it to "
        "predict with a 0.5 threshold and no component dropped"
    )
    body = read_json(path, fix)
    try:
        known = body["classes"]
        height, width = body["mask_size"]
        for c in known.values():
            float(c["threshold"]), int(c["min_size"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise DamagedFileError(f"{path} is not a postprocess.json bigbatch wrote: {fix}") from None
    missing = [c for c in classes if c not in known]
    if missing:
        raise ValueError(
            f"class {missing[0]!r} was not seen in training ({path} holds {', '.join(known)}): "
            "predict with the run's own classes"
        )
    rules = [ClassRule(float(known[c]["threshold"]), int(known[c]["min_size"])) for c in classes]
    for name, rule in zip(classes, rules, strict=True):
        # A hand-edited rule out of range would quietly empty (or fill) a class's masks.
        if not 0 <= rule.threshold <= 1 or rule.min_size < 0:
            raise ValueError(
                f"{path}: class {name!r} has threshold {rule.threshold} and min_size "
                f"{rule.min_size}; a threshold is a probability in [0, 1] and min_size a pixel "
                f"count >= 0: correct it, or {fix.split('; ', 1)[1]}"
            )
    if int(height) < 1 or int(width) < 1:
        raise DamagedFileError(f"{path}: mask_size {height}x{width} is not a size: {fix}")
    return rules, (int(height), int(width))
