"""Models by name: any timm architecture (never downloaded), or the user's own factory."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigbatch.io import load_tensors

__all__ = [
    "UnknownArchitectureError",
    "enable_grad_checkpointing",
    "grad_checkpointed",
    "load_weights",
    "pretrained_state",
    "read_weights",
    "resolve_arch",
    "timm_factory",
]

# ImageNet's channel statistics, which torchvision/timm ImageNet weights were trained with.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class UnknownArchitectureError(ValueError):
    """An architecture name timm does not know; the message lists close names."""


@functools.cache
def _timm_names() -> tuple[str, ...]:
    import timm

    return tuple(timm.list_models())


def resolve_arch(name: str) -> str:
    """Check ``name`` is a timm architecture, with or without a pretrained tag
    (``vit_tiny_patch16_224.augreg_in21k``: which weights, and so which data config);
    otherwise raise with the closest names.

    >>> resolve_arch("resnet18"), resolve_arch("resnet18.a1_in1k")
    ('resnet18', 'resnet18.a1_in1k')
    """
    import timm

    names = _timm_names()
    if name in names:
        return name
    if "." in name and name.split(".", 1)[0] in names:
        if name in timm.list_pretrained(name.split(".", 1)[0] + ".*"):
            return name
        tags = timm.list_pretrained(name.split(".", 1)[0] + ".*")
        raise UnknownArchitectureError(
            f"unknown pretrained tag {name!r}: {name.split('.', 1)[0]} has "
            + (", ".join(tags[:8]) if tags else "no pretrained weights")
        )
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else "see timm.list_models() for the names"
    raise UnknownArchitectureError(f"unknown architecture {name!r}: {hint}")


def _create(
    arch: str, num_classes: int, img_size: int | None, in_chans: int, pretrained: bool = False
) -> nn.Module:
    import timm

    kwargs: dict[str, Any] = {
        "pretrained": pretrained,
        "num_classes": num_classes,
        "in_chans": in_chans,
    }
    if img_size is not None:
        try:
            # Vision transformers fix their input size at build time; convnets take any.
            return timm.create_model(arch, img_size=img_size, **kwargs)
        except TypeError:
            pass
    return timm.create_model(arch, **kwargs)


def timm_factory(
    arch: str,
    *,
    num_classes: int = 1000,
    img_size: int | None = None,
    in_chans: int = 3,
    weights: str | Path | None = None,
    pretrained: bool = False,
) -> Callable[[], nn.Module]:
    """A zero-argument factory building ``arch`` with random weights, a local ``weights`` file
    (safetensors, or a torch state dict read with ``weights_only=True``), or timm's
    ``pretrained`` weights: through the Hugging Face hub cache, downloaded when there is a
    network, offline when cached; resolved once, here, so a missing file fails before any work
    (:func:`pretrained_state`). A head of another size is left as timm makes it.

    >>> model = timm_factory("resnet18", num_classes=10)()
    >>> model.fc.out_features
    10
    """
    arch = resolve_arch(arch)
    if weights is not None:
        read_weights(weights)  # a missing or unreadable file fails now, not inside training
    state = pretrained_state(arch, num_classes, img_size, in_chans) if pretrained else None

    def build() -> nn.Module:
        model = _create(arch, num_classes, img_size, in_chans)
        on_meta = any(p.is_meta for p in model.parameters())  # a plan's shapes-only build
        if state is not None and not on_meta:
            model.load_state_dict(state)
        if weights is not None and not on_meta:
            load_weights(model, weights)
        return model

    build.__name__ = f"timm:{arch}"
    return build


def pretrained_state(
    arch: str, num_classes: int, img_size: int | None = None, in_chans: int = 3
) -> dict[str, torch.Tensor]:
    """timm's pretrained weights for ``arch`` with this head, as a state dict.

    timm fetches them from the Hugging Face hub into its cache (``HF_HUB_CACHE``, by default
    ``~/.cache/huggingface/hub``) the first time, and reads the cache after that, offline too
    (``HF_HUB_OFFLINE=1``). With neither a network nor the files cached it raises ValueError
    naming the model, the cache and what to do."""
    try:
        model = _create(arch, num_classes, img_size, in_chans, pretrained=True)
    except Exception as exc:
        raise not_cached_error(arch, arch, exc) from None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def not_cached_error(what: str, arch: str, exc: Exception) -> ValueError:
    """The one line for timm's pretrained weights of ``arch`` that could be neither read from
    the Hugging Face cache nor downloaded (``what`` names them: the model, or an encoder)."""
    import timm
    from huggingface_hub.constants import HF_HUB_CACHE

    cfg = timm.models.get_pretrained_cfg(arch)
    source = getattr(cfg, "hf_hub_id", None) or getattr(cfg, "url", None) or arch
    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return ValueError(
        f"pretrained weights for {what} ({source}) are not in the Hugging Face cache "
        f"{HF_HUB_CACHE} and could not be downloaded ({type(exc).__name__}: {first}); run once "
        "with a network, point HF_HUB_CACHE at a cache that has them, or give weights=FILE"
    )


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a local weights file (safetensors, a state dict, or a checkpoint with a
    ``"model"`` state dict), without unpickling; ``ValueError`` naming the file otherwise."""

    state = load_tensors(path, "weights file")
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(
            f"weights file {path} is not a state dict (names to tensors): save one with "
            "torch.save(model.state_dict(), path)"
        )
    return state


def load_weights(model: nn.Module, path: str | Path, *, strict: bool = False) -> list[str]:
    """Load a local weights file into ``model`` without unpickling anything.

    A classifier head whose shape differs (another number of classes) is skipped; returns the
    names of the tensors that were not loaded.
    """
    state = read_weights(path)
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    skipped = sorted(set(state) - set(usable))
    model.load_state_dict(usable, strict=False)
    if strict and (skipped or set(own) - set(usable)):
        raise ValueError(f"weights in {path} do not match the model: {skipped[:5]}")
    return skipped


# The blocks torch's checkpoint_wrapper recomputes where a network's library has no switch of
# its own (MONAI's U-Nets, SegResNet, UNETR, SwinUNETR's convolutional encoders, smp's
# decoders under their timm encoders, which timm's switch checkpoints): each a
# conv-norm-act or residual unit whose inner activations are several times its input, so keeping
# only the input saves most of its memory. Named by class path so that neither MONAI nor smp is
# imported to decide.
_RECOMPUTED_BLOCKS = frozenset(
    {
        "monai.networks.blocks.convolutions.ResidualUnit",
        "monai.networks.blocks.segresnet_block.ResBlock",
        "monai.networks.blocks.dynunet_block.UnetBasicBlock",
        "monai.networks.blocks.dynunet_block.UnetResBlock",
        "monai.networks.blocks.transformerblock.TransformerBlock",
        "bigbatch.segmentation.models._Block",
        # segmentation_models_pytorch's decoders, at up to the image's resolution: a
        # full-resolution Kaggle mask's memory is mostly theirs.
        "segmentation_models_pytorch.decoders.unet.decoder.UnetDecoderBlock",
        "segmentation_models_pytorch.decoders.unetplusplus.decoder.DecoderBlock",
        "segmentation_models_pytorch.decoders.fpn.decoder.SegmentationBlock",
    }
)


def _block_path(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


_MONAI_CONVOLUTION = "monai.networks.blocks.convolutions.Convolution"


def _recomputed_blocks(model: nn.Module) -> list[str]:
    """The names of ``model``'s blocks that bigbatch wraps in a checkpoint, in the model's
    order: of a type in ``_RECOMPUTED_BLOCKS``, or one of MONAI's ``Convolution`` layers with
    its norm and activation (a U-Net's upsampling transposed convolutions; a convolution
    alone keeps nothing a checkpoint would free)."""
    return [
        name
        for name, module in model.named_modules()
        if _block_path(module) in _RECOMPUTED_BLOCKS
        or (_block_path(module) == _MONAI_CONVOLUTION and "adn" in module._modules)
    ]


def _out_of_place(features: nn.Module) -> None:
    """timm's feature extractor (an smp encoder's ``tu-`` model) checkpoints each of its
    top-level modules apart; an in-place activation among them (a ResNet's stem ReLU) then
    overwrites the output the checkpoint before it keeps, and backward fails on the version
    check. Out of place, the same values."""
    for child in features.children():
        if getattr(child, "inplace", False) is True:
            child.inplace = False  # type: ignore[assignment]


def _under(name: str, roots: list[str]) -> bool:
    """Whether the module ``name`` is inside one of ``roots`` ("" is the model itself)."""
    return any(not root or name.startswith(f"{root}.") for root in roots)


def _library_switches(model: nn.Module) -> list[str]:
    """Turn on each library's own checkpointing switch in ``model``; the names switched."""
    switched: list[str] = []
    timm_switched: list[str] = []  # a timm model's switch covers its submodules
    for name, module in model.named_modules():
        if _under(name, timm_switched):
            continue
        setter = getattr(module, "set_grad_checkpointing", None)
        if callable(setter):
            try:
                setter(True)
            except (AssertionError, NotImplementedError):  # timm's "not supported"
                continue
            timm_switched.append(name)
            switched.append(name)
            if type(module).__name__ in ("FeatureListNet", "FeatureDictNet"):
                _out_of_place(module)
        elif type(module).__module__.startswith("monai.") and hasattr(module, "use_checkpoint"):
            module.use_checkpoint = True  # each of MONAI's blocks reads its own
            switched.append(name)
    return switched


def enable_grad_checkpointing(model: nn.Module) -> nn.Module:
    """Turn on ``model``'s activation checkpointing, and return it: by its library's own switch
    where it has one (timm's ``set_grad_checkpointing`` for timm's models and the timm encoder
    under a segmentation_models_pytorch decoder; MONAI's ``use_checkpoint`` for SwinUNETR's
    Swin blocks), and by torch's ``checkpoint_wrapper`` around the residual and
    conv-norm-act blocks of MONAI's UNet (its upsampling convolutions too), SegResNet,
    DynUNet, UNETR and SwinUNETR, the decoder blocks of segmentation_models_pytorch's
    U-Net, U-Net++ and FPN, and those of
    :class:`bigbatch.segmentation.models.UNet`, which have none. The activations inside each
    checkpointed block are recomputed in backward instead of kept: less memory, about a third
    more compute, the same gradients. The wrapped model's ``state_dict`` keeps the plain
    model's names, so weights load into either. BatchNorm's running statistics move once a
    forward, not again in the recomputation, when the backward runs through
    :meth:`bigbatch.Accumulator.backward` (else wrap it in
    :func:`bigbatch.batchnorm.running_stats_kept`). Raises ``ValueError`` naming the fix
    where the model has neither a switch nor such blocks.

    >>> model = enable_grad_checkpointing(timm_factory("resnet18", num_classes=10)())
    >>> model.grad_checkpointing
    True
    >>> from bigbatch.segmentation.models import unet2d
    >>> net = enable_grad_checkpointing(unet2d(width=4, depth=2))
    >>> plain = unet2d(width=4, depth=2)
    >>> type(net.down[0]).__name__, net.state_dict().keys() == plain.state_dict().keys()
    ('CheckpointWrapper', True)
    """
    switched = _library_switches(model)
    blocks: list[str] = []  # the outermost only: a block inside one is recomputed with it
    for name in _recomputed_blocks(model):
        if not (_under(name, switched) or _under(name, blocks)):
            blocks.append(name)
    if blocks:
        try:  # where torch was built without torch.distributed, the wrapper is missing too
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )
        except ImportError as exc:
            raise ValueError(
                f"{type(model).__name__}'s blocks are checkpointed by torch's checkpoint_wrapper, "
                f"which this torch build lacks ({exc}): train without checkpointing, or install "
                "torch with torch.distributed"
            ) from None
        chosen = {id(model.get_submodule(name)) for name in blocks}
        apply_activation_checkpointing(model, check_fn=lambda m: id(m) in chosen)
    if not switched and not blocks:
        raise ValueError(
            f"{type(model).__name__} has no activation checkpointing its library switches on "
            "(timm's set_grad_checkpointing, MONAI's use_checkpoint) nor blocks bigbatch "
            "recomputes (MONAI's networks', smp's decoders', bigbatch's U-Net's): train it "
            "without, or wrap its blocks yourself with torch.distributed.algorithms._checkpoint."
            "checkpoint_wrapper.apply_activation_checkpointing(model, check_fn=...)"
        )
    return model


def grad_checkpointed(
    factory: Callable[[], nn.Module],
    *,
    refused: Callable[[str], Exception] = ValueError,
    said: str = "grad_checkpointing=true",
) -> Callable[[], nn.Module]:
    """``factory`` whose models have activation checkpointing on
    (:func:`enable_grad_checkpointing`); a model with neither a switch nor blocks it wraps is
    refused when built, as ``refused(f"{said}: ...")``: a command's own error, naming its own
    key or flag.

    >>> build = grad_checkpointed(timm_factory("resnet18", num_classes=10))
    >>> build().grad_checkpointing
    True
    >>> grad_checkpointed(lambda: nn.Linear(2, 2))()
    Traceback (most recent call last):
    ...
    ValueError: grad_checkpointing=true: Linear has no activation checkpointing its library switches on (timm's set_grad_checkpointing, MONAI's use_checkpoint) nor blocks bigbatch recomputes (MONAI's networks', smp's decoders', bigbatch's U-Net's): train it without, or wrap its blocks yourself with torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing(model, check_fn=...)
    """

    def build() -> nn.Module:
        try:
            return enable_grad_checkpointing(factory())
        except ValueError as exc:
            raise refused(f"{said}: {exc}") from None

    return build
