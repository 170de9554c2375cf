"""A compact U-Net, 2D or 3D, with per-sample normalisation and no dependency beyond torch: for
the tests, the examples and ``bigbatch verify``'s built-in cases, where the segmentation extra
may be absent. It normalises with GroupNorm, which works per sample, so accumulation stays exact
(BatchNorm's batch statistics cannot be, see :mod:`bigbatch.inexact`). Training uses MONAI's
networks and segmentation_models_pytorch's decoders (:mod:`bigbatch.segmentation.networks`,
:mod:`bigbatch.segmentation.decoders`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = ["UNet", "unet2d", "unet3d"]


def _groups(channels: int) -> int:
    return next(g for g in (8, 4, 2, 1) if channels % g == 0)


class _Block(nn.Sequential):
    def __init__(self, cin: int, cout: int, dims: int) -> None:
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        super().__init__(
            conv(cin, cout, 3, padding=1),
            nn.GroupNorm(_groups(cout), cout),
            nn.ReLU(inplace=True),
            conv(cout, cout, 3, padding=1),
            nn.GroupNorm(_groups(cout), cout),
            nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    """A U-Net for 2D images (``dims=2``) or 3D volumes (``dims=3``): ``depth`` poolings, the
    channels doubling from ``width``; GroupNorm throughout. Spatial sizes must be divisible by
    ``2 ** depth``.

    >>> net = UNet(in_channels=4, num_classes=3, dims=3, width=4, depth=2)
    >>> net(torch.randn(1, 4, 16, 16, 16)).shape
    torch.Size([1, 3, 16, 16, 16])
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        dims: Literal[2, 3] = 2,
        width: int = 16,
        depth: int = 3,
    ) -> None:
        super().__init__()
        if dims not in (2, 3):
            raise ValueError(f"dims must be 2 (images) or 3 (volumes), got {dims!r}")
        self.dims = dims
        self.depth = depth
        pool = nn.MaxPool2d if dims == 2 else nn.MaxPool3d
        up = nn.ConvTranspose2d if dims == 2 else nn.ConvTranspose3d
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        chans = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(
            [_Block(in_channels if i == 0 else chans[i - 1], chans[i], dims) for i in range(depth)]
        )
        self.pool = pool(2)
        self.bottom = _Block(chans[depth - 1], chans[depth], dims)
        self.up = nn.ModuleList(
            [up(chans[i + 1], chans[i], 2, stride=2) for i in reversed(range(depth))]
        )
        self.merge = nn.ModuleList(
            [_Block(2 * chans[i], chans[i], dims) for i in reversed(range(depth))]
        )
        self.head = conv(chans[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 2**self.depth
        if any(s % factor for s in x.shape[2:]):
            raise ValueError(
                f"UNet(depth={self.depth}) needs spatial sizes divisible by {factor}, got "
                f"{tuple(x.shape[2:])}: crop or pad the input (or patches) to a multiple of {factor}"
            )
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def unet2d(in_channels: int = 3, num_classes: int = 1, width: int = 16, depth: int = 3) -> UNet:
    """A 2D :class:`UNet` (a factory for ``bigbatch plan --model``)."""
    return UNet(in_channels, num_classes, dims=2, width=width, depth=depth)


def unet3d(in_channels: int = 4, num_classes: int = 3, width: int = 16, depth: int = 3) -> UNet:
    """A 3D :class:`UNet`, by default for 4 MRI modalities and 3 tumour classes (BraTS-like):
    ``bigbatch plan --model bigbatch.segmentation.models:unet3d --input-shape 4,128,128,128``."""
    return UNet(in_channels, num_classes, dims=3, width=width, depth=depth)
