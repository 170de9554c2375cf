"""Per-sample Dice and BCE + Dice accumulate exactly on 2D and 3D U-Nets; the naive loss / N
does not on an uneven window; the batch Dice cannot, and verify says why."""

from __future__ import annotations

import pytest
import torch

from bigbatch.segmentation.losses import batch_dice_loss, bce_dice_loss, dice_loss
from bigbatch.segmentation.models import UNet
from bigbatch.verify import verify


def images_2d(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 16, 16, generator=g)
    mask = (torch.rand(n, 1, 16, 16, generator=g) > 0.6).float()
    return x, mask


def volumes_3d(n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, 8, 8, 8, generator=g)
    labels = torch.randint(0, 3, (n, 8, 8, 8), generator=g)
    return x, labels


CASES = {
    "2d_dice": (lambda: UNet(3, 1, dims=2, width=4, depth=2), images_2d, dice_loss, [1, 3, 2]),
    "2d_bce_dice": (
        lambda: UNet(3, 1, dims=2, width=4, depth=2),
        images_2d,
        bce_dice_loss,
        [1, 3, 2],
    ),
    "3d_bce_dice": (
        lambda: UNet(2, 3, dims=3, width=4, depth=2),
        volumes_3d,
        bce_dice_loss,
        [1, 2],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_sample_losses_accumulate_exactly_and_naive_does_not(name: str) -> None:
    build, data, loss_fn, sizes = CASES[name]
    torch.manual_seed(0)
    x, y = data()
    results = verify(
        build(),
        x,
        y,
        sizes,
        loss_fn,
        methods=("bigbatch", "naive"),
        dtypes=(torch.float64, torch.float32),
    )
    got = {(r.method, r.dtype): r.max_rel for r in results}
    assert got[("bigbatch", "float64")] <= 1e-12
    assert got[("bigbatch", "float32")] <= 1e-6
    assert got[("naive", "float64")] > 1e-3


def test_batch_dice_couples_samples_and_verify_says_so() -> None:
    torch.manual_seed(0)
    x, y = images_2d()
    (result,) = verify(UNet(3, 1, dims=2, width=4, depth=2), x, y, [1, 3, 2], batch_dice_loss)
    assert not result.passed
    assert "couples the samples" in result.explanation
    assert "dice_loss" in result.explanation


def test_bad_shapes_are_refused() -> None:
    logits = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match="class indices"):
        dice_loss(logits, torch.zeros(2, 1, 4, 4))
    with pytest.raises(ValueError, match="binary mask"):
        dice_loss(torch.zeros(2, 1, 4, 4), torch.zeros(2, 5, 5))
    with pytest.raises(ValueError, match="divisible by 4"):
        UNet(3, 1, depth=2)(torch.zeros(1, 3, 10, 10))
