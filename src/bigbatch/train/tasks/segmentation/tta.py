"""Test-time augmentation for segmentation: each pass a distinct flip of the spatial axes,
the probabilities flipped back and averaged (prediction, submissions, and the thresholds tuned
on validation all use it)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from bigbatch.train.config import ConfigError

__all__ = ["Probabilities", "tta_flips", "with_tta"]

Probabilities = Callable[[torch.Tensor], torch.Tensor]


def tta_flips(spatial_dims: int, tta: int) -> list[list[int]]:
    """The axes each of ``tta`` passes flips, all distinct: none, then each spatial axis alone
    (the last, width, first), then each pair, ... (2D: none, width, height, both: at most 4;
    3D: at most 8). More passes than that is refused: a pass would repeat.

    >>> tta_flips(2, 4)
    [[], [3], [2], [3, 2]]
    """
    axes = list(range(spatial_dims + 1, 1, -1))
    passes = [list(c) for k in range(len(axes) + 1) for c in itertools.combinations(axes, k)]
    if not 1 <= tta <= len(passes):
        raise ConfigError(
            f"--tta {tta}: {len(passes)} passes are all the distinct flips of a "
            f"{spatial_dims}D input (none, each axis, each combination); give 1 to {len(passes)}"
        )
    return passes[:tta]


def with_tta(probabilities: Probabilities, x: torch.Tensor, tta: int) -> torch.Tensor:
    """The mean over ``tta`` passes, each with other flips (:func:`tta_flips`), each pass's
    output flipped back.

    >>> x = torch.rand(1, 2, 4, 4)
    >>> torch.allclose(with_tta(lambda v: v.softmax(1), x, 4), x.softmax(1))
    True
    """
    total = probabilities(x)
    for axes in tta_flips(x.dim() - 2, tta)[1:]:
        total = total + probabilities(x.flip(axes)).flip(axes)
    return total / tta
