"""Overlapping classes (a sigmoid per class): each sample's Dice per class plus its BCE, then
the mean over samples, accumulates exactly (float64 to 1e-12 against the big batch); the naive
``loss / N`` on an uneven window does not."""

from __future__ import annotations

import pytest
import torch

from bigbatch.segmentation.losses import multilabel_loss
from bigbatch.segmentation.models import UNet
from bigbatch.verify import verify

pytest.importorskip("monai")


def overlapping(n: int = 6, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 16, 16, generator=g)
    masks = (torch.rand(n, classes, 16, 16, generator=g) > 0.6).float()
    masks[1] = 0.0  # an image with no class at all
    assert (masks.sum(1) > 1).any()  # pixels of two classes at once
    return x, masks


@pytest.mark.parametrize("name", ["dice_bce", "dice", "bce"])
def test_the_multilabel_loss_accumulates_exactly_and_naive_does_not(name: str) -> None:
    torch.manual_seed(0)
    x, y = overlapping()
    results = verify(
        UNet(3, 4, dims=2, width=4, depth=2),
        x,
        y,
        [1, 3, 2],
        multilabel_loss(name),
        methods=("bigbatch", "naive"),
        dtypes=(torch.float64, torch.float32),
    )
    got = {(r.method, r.dtype): r for r in results}
    assert got[("bigbatch", "float64")].max_rel <= 1e-12
    ours = got[("bigbatch", "float32")]  # against the float32 big batch's own round-off
    assert ours.passed and ours.tolerance <= 4 * max(ours.roundoff, 2.5e-7)
    assert not got[("naive", "float64")].passed and got[("naive", "float64")].max_rel > 1e-3


def test_masks_of_another_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="a 0/1 plane per class"):
        multilabel_loss()(torch.zeros(2, 4, 8, 8), torch.zeros(2, 8, 8))
