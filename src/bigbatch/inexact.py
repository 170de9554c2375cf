"""Layers that make accumulation differ from a big batch, and what to do about them.

BatchNorm in train mode normalises each micro-batch with its own statistics, so no weighting of
the losses can reproduce the big batch. Dropout draws different masks, so results match the big
batch in distribution but not bit for bit.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import nn

__all__ = [
    "BATCHNORM_REMEDIES",
    "InexactAccumulationWarning",
    "InexactLayer",
    "find_inexact_layers",
    "freeze_batchnorm",
    "warn_inexact_layers",
]

BATCHNORM_REMEDIES = (
    "freeze BatchNorm statistics after model.train() with bigbatch.freeze_batchnorm(model); "
    "or replace BatchNorm by GroupNorm/LayerNorm; "
    "or, under DDP, use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) with a larger micro-batch"
)


class InexactAccumulationWarning(UserWarning):
    """The model has layers for which accumulated training cannot equal big-batch training.

    >>> import warnings
    >>> with warnings.catch_warnings():  # make it fatal in a test
    ...     warnings.simplefilter("error", InexactAccumulationWarning)
    """


@dataclass(frozen=True)
class InexactLayer:
    """One layer :func:`find_inexact_layers` found, and why it is inexact (``kind``).

    >>> str(InexactLayer("encoder.bn1", "batchnorm", "BatchNorm2d"))
    'encoder.bn1 (BatchNorm2d)'
    """

    name: str  # the module's qualified name in the model
    kind: str  # "batchnorm" or "dropout"
    type_name: str

    def __str__(self) -> str:
        return f"{self.name or '<model>'} ({self.type_name})"


def find_inexact_layers(model: nn.Module) -> list[InexactLayer]:
    """BatchNorm layers in train mode and active dropout layers of ``model``.

    >>> from torch import nn
    >>> [str(x) for x in find_inexact_layers(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))]
    ['1 (BatchNorm1d)']
    """
    found: list[InexactLayer] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            # SyncBatchNorm included: it still normalises each micro-batch separately.
            found.append(InexactLayer(name, "batchnorm", type(module).__name__))
        elif isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            found.append(InexactLayer(name, "dropout", type(module).__name__))
    return found


def describe_inexact_layers(layers: list[InexactLayer]) -> str:
    """One paragraph a user can act on, or "" when every layer is exact."""
    bn = [layer for layer in layers if layer.kind == "batchnorm"]
    dropout = [layer for layer in layers if layer.kind == "dropout"]
    parts = []
    if bn:
        names = ", ".join(str(x) for x in bn[:3]) + (
            f" and {len(bn) - 3} more" if len(bn) > 3 else ""
        )
        parts.append(
            f"{len(bn)} BatchNorm layer(s) in train mode ({names}) normalise each micro-batch with "
            "its own statistics, so accumulated gradients cannot equal the big batch's. "
            f"Remedies: {BATCHNORM_REMEDIES}."
        )
    if dropout:
        parts.append(
            f"{len(dropout)} dropout layer(s) draw different masks per micro-batch: the update "
            "matches the big batch in distribution, not bit for bit (call model.eval() to verify "
            "exactness)."
        )
    return " ".join(parts)


def warn_inexact_layers(model: nn.Module, *, stacklevel: int = 3) -> list[InexactLayer]:
    """Warn (InexactAccumulationWarning) about layers that break exactness; return them."""
    layers = find_inexact_layers(model)
    if layers:
        warnings.warn(
            describe_inexact_layers(layers), InexactAccumulationWarning, stacklevel=stacklevel
        )
    return layers


def freeze_batchnorm(model: nn.Module) -> list[str]:
    """Put every BatchNorm layer in eval mode: it then uses (and stops updating) its running
    statistics, which makes accumulation exact. Call it again after each ``model.train()``.
    Its affine weight and bias still train. Returns the names of the layers frozen.

    >>> from torch import nn
    >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).train()
    >>> freeze_batchnorm(m)
    ['1']
    """
    frozen = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
            frozen.append(name)
    return frozen
