"""BatchNorm's running statistics under activation checkpointing: the recomputation in backward
runs BatchNorm's forward a second time, and without ``running_stats_kept`` it moves the
statistics again (two batches counted, the mean pulled twice towards the same batch)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch import Accumulator, cached_backward
from bigbatch.models import enable_grad_checkpointing
from helpers import bigbatch_run, max_rel_diff, naive_run


def _bn_unet(checkpointed: bool) -> nn.Module:
    UNet = pytest.importorskip("monai.networks.nets").UNet

    torch.manual_seed(0)
    net = UNet(2, 3, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=2, norm="batch")
    return enable_grad_checkpointing(net.double()) if checkpointed else net.double()


def _same_state(got: nn.Module, want: nn.Module) -> None:
    """Every weight and buffer equal, running statistics and counts included (a checkpointed
    model's state_dict keeps the plain model's names)."""
    mine, theirs = got.state_dict(), want.state_dict()
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        scale = float(value.double().abs().max()) or 1.0
        assert float((mine[name].double() - value.double()).abs().max()) <= 1e-12 * scale, name


def _counted(model: nn.Module) -> set[int]:
    return {int(v) for k, v in model.state_dict().items() if k.endswith("num_batches_tracked")}


def _seg_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def _batches(sizes: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 3, 16, 16, generator=g).double(),
         torch.randint(0, 2, (n, 16, 16), generator=g))
        for n in sizes
    ]  # fmt: skip


def test_checkpointed_accumulation_moves_running_stats_once() -> None:
    """Through the Accumulator, a checkpointed MONAI U-Net with BatchNorm ends two steps over
    uneven micro-batches with the running statistics (and count) of the same model trained
    without checkpointing, and the same weights, in float64; the usual ``loss.backward()``
    counts every micro-batch twice."""
    epochs = [_batches((3, 3, 1, 2, 2))]
    plain, _ = bigbatch_run(_bn_unet(False), epochs, loss_fn=_seg_loss, micro_batches=3)
    ours, _ = bigbatch_run(_bn_unet(True), epochs, loss_fn=_seg_loss, micro_batches=3)
    assert max_rel_diff(ours, plain) < 1e-12
    _same_state(ours, plain)
    assert _counted(ours) == {5}
    naive = naive_run(_bn_unet(True), [epochs[0][:3], epochs[0][3:]], 3, loss_fn=_seg_loss)
    assert 10 in _counted(naive)  # the control: each checkpointed block's BatchNorm counts twice


def test_gradient_caching_through_a_checkpointed_encoder_moves_running_stats_once() -> None:
    """``cached_backward`` encodes twice by design (its first pass keeps the statistics); a
    checkpointed encoder's recomputation in the second pass's backward keeps them too."""

    def encoder(checkpointed: bool) -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        if not checkpointed:
            return nn.Sequential(net.double())
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        return nn.Sequential(checkpoint_wrapper(net.double()))

    def contrastive(z: torch.Tensor) -> torch.Tensor:
        logits = F.normalize(z, dim=1) @ F.normalize(z, dim=1).T
        return F.cross_entropy(logits, torch.arange(len(z)))

    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(n, 6, generator=g).double() for n in (3, 2)]
    runs = []
    for checkpointed in (False, True):
        net = encoder(checkpointed)
        acc = Accumulator(torch.optim.SGD(net.parameters(), lr=0.1), micro_batches=1)
        cached_backward(acc, lambda x, net=net: net(x), contrastive, parts)
        acc.step()
        runs.append(net)
    _same_state(runs[1], runs[0])
    assert _counted(runs[1]) == {2}


def test_running_stats_kept_restores_inside_and_lets_go_on_exit() -> None:
    """A BatchNorm in train mode that runs inside ends with its statistics as they were before
    it ran there (as a checkpointed step's forward left them); one in eval mode is left alone;
    after the block the hook is gone, and they move again, even where the block raised."""
    from bigbatch.batchnorm import running_stats_kept

    bn, frozen = nn.BatchNorm1d(3), nn.BatchNorm1d(3).eval()
    before = copy.deepcopy(bn.state_dict())
    with running_stats_kept():
        bn(torch.randn(4, 3))
        bn(torch.randn(4, 3))
        frozen(torch.randn(4, 3))
    assert all(torch.equal(bn.state_dict()[k], v) for k, v in before.items())
    try:
        with running_stats_kept():
            raise RuntimeError("out of memory")
    except RuntimeError:
        pass
    bn(torch.randn(4, 3))
    assert int(bn.num_batches_tracked) == 1  # no hook left behind
