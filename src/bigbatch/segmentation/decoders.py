"""2D segmentation networks from segmentation_models_pytorch: a decoder the Kaggle practitioner
chooses (U-Net, U-Net++, FPN, DeepLabV3+) on any timm encoder (smp's ``tu-`` encoders).

The decoders' normalisation follows exactness where smp lets it: U-Net and U-Net++ take
``norm=instance`` (each sample normalised alone, exact under accumulation; smp's own default is
BatchNorm, ``norm=batch``), FPN's decoder uses GroupNorm (exact), DeepLabV3+'s BatchNorm
(inexact: bigbatch says so, and ``freeze_bn=true`` makes it exact). Most timm encoders use
BatchNorm too; the same note and remedy apply.

Pretrained encoders come through the Hugging Face hub cache, as timm's classifiers do: resolved
once when the factory is made, offline when cached, one clear line when neither.

>>> import torch
>>> net = smp_factory("fpn", "resnet10t", in_channels=3, num_classes=4)()
>>> net(torch.zeros(1, 3, 64, 96)).shape
torch.Size([1, 4, 64, 96])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bigbatch.models import not_cached_error, resolve_arch

__all__ = ["SMP_ARCHS", "smp_factory"]

# arch= names, as segmentation_models_pytorch's create_model takes them.
SMP_ARCHS = ("unet", "unetplusplus", "fpn", "deeplabv3plus")
# What norm= means for the decoders that take a choice.
_DECODER_NORMS: dict[str, Any] = {
    "instance": {"type": "instancenorm", "affine": True},
    "batch": "batchnorm",
}


def _smp() -> Any:
    try:
        import segmentation_models_pytorch
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "arch=unet|unetplusplus|fpn|deeplabv3plus with encoder= uses "
            "segmentation_models_pytorch, which is not installed: pip install 'bigbatch[seg]'"
        ) from exc
    return segmentation_models_pytorch


def _create(
    arch: str, encoder: str, in_channels: int, num_classes: int, norm: str, weights: str | None
) -> nn.Module:
    kwargs: dict[str, Any] = {}
    if arch in ("unet", "unetplusplus"):
        kwargs["decoder_use_norm"] = _DECODER_NORMS[norm]
    model = _smp().create_model(
        arch,
        encoder_name=f"tu-{encoder}",
        encoder_weights=weights,
        in_channels=in_channels,
        classes=num_classes,
        **kwargs,
    )
    return model


def _pretrained_encoder(
    arch: str, encoder: str, in_channels: int, num_classes: int, norm: str
) -> dict[str, torch.Tensor]:
    """The encoder's pretrained weights (timm's, through the hub cache), as a state dict."""
    try:
        model = _create(arch, encoder, in_channels, num_classes, norm, "imagenet")
    except Exception as exc:
        raise not_cached_error(f"the encoder {encoder}", encoder, exc) from None
    encoder_module: nn.Module = model.encoder  # type: ignore[assignment]
    return {k: v.detach().clone() for k, v in encoder_module.state_dict().items()}


def smp_factory(
    arch: str,
    encoder: str,
    *,
    in_channels: int,
    num_classes: int,
    norm: str = "instance",
    pretrained: bool = False,
) -> Callable[[], nn.Module]:
    """A zero-argument factory of smp's ``arch`` decoder on the timm ``encoder`` (random
    weights, or the encoder's pretrained ones with ``pretrained``), with ``num_classes`` output
    channels. Unknown names fail here, with the closest ones."""
    if arch not in SMP_ARCHS:
        raise ValueError(f"arch={arch!r} with encoder= is one of {', '.join(SMP_ARCHS)}")
    if norm not in _DECODER_NORMS and arch in ("unet", "unetplusplus"):
        raise ValueError(
            f"norm={norm} for smp's {arch} decoder: instance (exact under accumulation) or batch"
        )
    fixed = {"fpn": "GroupNorm", "deeplabv3plus": "BatchNorm"}.get(arch)
    if fixed and norm != "instance":  # instance: the default, which these decoders do not take
        raise ValueError(
            f"norm={norm}: smp's {arch} decoder normalises with {fixed}, which it does not let "
            "you change; drop norm= (it chooses the U-Net and U-Net++ decoders' normalisation)"
        )
    encoder = resolve_arch(encoder)
    _smp()  # a missing library fails now, not inside the planner
    state = (
        _pretrained_encoder(arch, encoder, in_channels, num_classes, norm) if pretrained else None
    )

    def build() -> nn.Module:
        model = _create(arch, encoder, in_channels, num_classes, norm, None)
        on_meta = any(p.is_meta for p in model.parameters())  # a plan's shapes-only build
        if state is not None and not on_meta:
            encoder_module: nn.Module = model.encoder  # type: ignore[assignment]
            encoder_module.load_state_dict(state)
        return model

    build.__name__ = f"smp:{arch}:{encoder}"
    return build
