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
    got = {(r.method, r.dtype): r for r in results}
    assert got[("bigbatch", "float64")].max_rel <= 1e-12
    # float32 is judged against the float32 big batch's own round-off (verify's tolerance).
    ours = got[("bigbatch", "float32")]
    assert ours.passed and ours.tolerance <= 4 * max(ours.roundoff, 2.5e-7)
    assert not got[("naive", "float64")].passed and not got[("naive", "float32")].passed
    assert got[("naive", "float32")].max_rel > 1e-3


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


@pytest.mark.slow
def test_float32_per_sample_dice_passes_verify_across_seeds_and_naive_does_not() -> None:
    """float32 round-off is not a false alarm: 10 seeds of a small CNN with per-sample Dice."""
    for seed in range(10):
        torch.manual_seed(seed)
        x, y = images_2d()
        results = verify(
            UNet(3, 1, dims=2, width=4, depth=2),
            x,
            y,
            [1, 3, 2],
            dice_loss,
            methods=("bigbatch", "naive"),
            dtypes=(torch.float32,),
            seed=seed,
        )
        ours, naive = results
        assert ours.passed, (seed, ours.max_rel, ours.tolerance, ours.explanation)
        assert not naive.passed and "loss / N" in naive.explanation


def test_a_float32_difference_that_vanishes_in_float64_is_called_round_off() -> None:
    """With the tolerance forced to the floor, the float32 difference is explained by measuring
    the same window in float64, not blamed on the loss."""
    from unittest import mock

    import bigbatch.verify as bv

    torch.manual_seed(0)
    x, y = images_2d()
    caps = dict.fromkeys(bv.ROUNDOFF_CAPS, 1e-12)
    floors = {**bv.TOLERANCES, torch.float32: 1e-12}
    with mock.patch.dict(bv.ROUNDOFF_CAPS, caps), mock.patch.dict(bv.TOLERANCES, floors):
        (r,) = verify(
            UNet(3, 1, dims=2, width=4, depth=2),
            x,
            y,
            [1, 3, 2],
            dice_loss,
            dtypes=(torch.float32,),
        )
    assert not r.passed
    assert "round-off" in r.explanation and "couples" not in r.explanation
