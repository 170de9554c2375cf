"""Compact U-Nets: 2D or 3D with per-sample normalisation, and a 2D decoder on a timm encoder.

Written here rather than taken from segmentation-models-pytorch or MONAI: each would add a
dependency tree for a few dozen lines, and these normalise with GroupNorm, which works per
sample, so accumulation stays exact (BatchNorm's batch statistics cannot be, see
:mod:`bigbatch.inexact`). ``timm_unet`` reuses timm (already a dependency) for its encoders.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

__all__ = ["UNet", "timm_unet", "unet2d", "unet3d"]


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


class _TimmUNet(nn.Module):
    def __init__(self, encoder: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        info: Any = encoder.feature_info  # timm's FeatureInfo
        chans = list(info.channels())  # shallow to deep
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        current = chans[-1]
        for skip in reversed(chans[:-1]):  # each decoder stage ends with its skip's channels
            self.up.append(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False))
            self.merge.append(_Block(current + skip, skip, 2))
            current = skip
        self.head = nn.Sequential(
            nn.Upsample(scale_factor=info.reduction()[0], mode="bilinear"),
            nn.Conv2d(current, num_classes, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.encoder(x)
        y = feats[-1]
        for up, merge, skip in zip(self.up, self.merge, reversed(feats[:-1]), strict=True):
            y = up(y)
            if y.shape[2:] != skip.shape[2:]:
                y = nn.functional.interpolate(y, size=skip.shape[2:], mode="bilinear")
            y = merge(torch.cat([y, skip], dim=1))
        return self.head(y)


def timm_unet(
    encoder: str = "resnet18",
    *,
    in_channels: int = 3,
    num_classes: int = 1,
    pretrained: bool = False,
) -> nn.Module:
    """A 2D U-Net: any timm encoder (``features_only``) and a GroupNorm decoder. Encoders with
    BatchNorm are not exact under accumulation (bigbatch warns; ``freeze_batchnorm`` helps).

    >>> net = timm_unet("resnet10t", num_classes=2)
    >>> net(torch.randn(1, 3, 64, 64)).shape
    torch.Size([1, 2, 64, 64])
    """
    import timm

    enc = timm.create_model(
        encoder, features_only=True, pretrained=pretrained, in_chans=in_channels
    )
    return _TimmUNet(enc, num_classes)
