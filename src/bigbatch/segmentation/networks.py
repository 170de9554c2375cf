"""MONAI's segmentation networks by name, with the keys a practitioner changes.

``arch=unet|segresnet|dynunet|swinunetr|unetr`` builds MONAI's network for 2D or 3D data;
``widths`` sets the channels of each resolution level (their number is the depth) and ``norm``
the normalisation. The default, instance norm, normalises each sample on its own, so
accumulating micro-batches stays exact; ``norm=batch`` is accepted with bigbatch's BatchNorm
warning (``freeze_bn=true`` makes it exact).

>>> import torch
>>> net = build_network("segresnet", 1, 2, dims=2, size=32, widths=(8, 16))
>>> net(torch.zeros(1, 1, 32, 32)).shape
torch.Size([1, 2, 32, 32])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["MONAI_ARCHS", "NORMS", "build_network", "size_multiple"]

MONAI_ARCHS = ("unet", "segresnet", "dynunet", "swinunetr", "unetr")
NORMS = ("instance", "group", "batch")
DEFAULT_WIDTHS = (16, 32, 64, 128)
# SwinUNETR's feature size (its first width) must divide by 12: its heads split it 3, 6, 12, 24.
ARCH_WIDTHS = {"swinunetr": (24, 48, 96, 192, 384)}


class MonaiMissingError(ModuleNotFoundError):
    """MONAI (the segmentation extra) is not installed."""


def _monai_nets() -> Any:
    try:
        from monai.networks import nets
    except ModuleNotFoundError as exc:
        raise MonaiMissingError(
            "segmentation networks come from MONAI, which is not installed: "
            "pip install 'bigbatch[seg]'",
            name="monai",
        ) from exc
    return nets


def size_multiple(arch: str, widths: Sequence[int] = ()) -> int:
    """What every spatial size must divide by: the network halves it once per level below the
    first (UNETR's and SwinUNETR's patch embeddings fix theirs).

    >>> size_multiple("unet", (16, 32, 64)), size_multiple("unetr")
    (4, 16)
    """
    if arch == "unetr":
        return 16
    if arch == "swinunetr":
        return 32
    return 2 ** (len(widths or ARCH_WIDTHS.get(arch, DEFAULT_WIDTHS)) - 1)


def _norm(norm: str, widths: Sequence[int]) -> Any:
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r} is not one of {', '.join(NORMS)}")
    if norm == "group":
        # SegResNet's own default is 8 groups; fewer where a level's channels do not divide.
        return ("group", {"num_groups": math.gcd(8, *widths)})
    return norm


def build_network(
    arch: str,
    in_channels: int,
    num_classes: int,
    *,
    dims: int,
    size: int,
    widths: Sequence[int] = (),
    norm: str = "instance",
) -> nn.Module:
    """MONAI's ``arch`` for ``dims``-D inputs of ``in_channels`` channels and ``num_classes``
    outputs (1: a binary sigmoid output). ``size`` is the training patch or image size (UNETR
    needs it); ``widths`` the channels per level (SwinUNETR and UNETR take the first as their
    feature size); empty: the architecture's default."""
    nets = _monai_nets()
    widths = tuple(int(w) for w in widths) or ARCH_WIDTHS.get(arch, DEFAULT_WIDTHS)
    if len(widths) < 2 or min(widths) < 1:
        raise ValueError(f"widths needs two or more positive channel counts, got {widths}")
    norm_arg = _norm(norm, widths)
    if arch == "dynunet" and len(widths) < 3:
        raise ValueError(f"arch=dynunet needs three or more widths (levels), got {widths}")
    if arch == "swinunetr" and widths[0] % 12:
        raise ValueError(
            f"arch=swinunetr: its feature size (the first of widths, {widths[0]}) must divide by "
            "12; e.g. widths=24,48,96,192"
        )
    builders: dict[str, Callable[[], nn.Module]] = {
        "unet": lambda: nets.UNet(
            dims,
            in_channels,
            num_classes,
            channels=widths,
            strides=(2,) * (len(widths) - 1),
            num_res_units=2,
            norm=norm_arg,
        ),
        "segresnet": lambda: nets.SegResNet(
            spatial_dims=dims,
            init_filters=widths[0],
            in_channels=in_channels,
            out_channels=num_classes,
            blocks_down=(1, 2, 2, 4, 4, 4)[: len(widths)],
            blocks_up=(1,) * (len(widths) - 1),
            norm=norm_arg,
        ),
        "dynunet": lambda: nets.DynUNet(
            dims,
            in_channels,
            num_classes,
            kernel_size=[3] * len(widths),
            strides=[1] + [2] * (len(widths) - 1),
            upsample_kernel_size=[2] * (len(widths) - 1),
            filters=list(widths),
            norm_name=norm_arg,
        ),
        "swinunetr": lambda: nets.SwinUNETR(
            in_channels=in_channels,
            out_channels=num_classes,
            feature_size=widths[0],
            spatial_dims=dims,
            norm_name=norm_arg,
        ),
        "unetr": lambda: nets.UNETR(
            in_channels,
            num_classes,
            img_size=(size,) * dims,
            feature_size=widths[0],
            spatial_dims=dims,
            norm_name=norm_arg,
        ),
    }
    if arch not in builders:
        raise ValueError(f"arch={arch!r} is not one of MONAI's {', '.join(MONAI_ARCHS)}")
    try:
        return builders[arch]()
    except ModuleNotFoundError as exc:  # SwinUNETR and UNETR need einops
        raise MonaiMissingError(
            f"arch={arch} needs {exc.name or 'einops'}: pip install 'bigbatch[seg]'",
            name=exc.name or "einops",
        ) from exc
