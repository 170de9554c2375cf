"""Models without memory: built on the meta device, then given fake (or real) storage, for the
planner's traces (:mod:`bigbatch.memory.predict`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["build_on_meta", "to_empty_shared", "unfakeable_op"]


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """``factory()`` on the meta device: the model's shapes, no memory.

    >>> build_on_meta(lambda: nn.Linear(4, 2)).weight.device
    device(type='meta')
    """
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:
        if unfakeable_op(exc) is None:
            raise
        # The constructor itself computes with an op meta tensors lack (timm's RegNets size
        # their stages with torch.unique): build on the CPU, then keep only the shapes.
        model = factory()
        if isinstance(model, nn.Module):
            model = model.to(device="meta")
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    lazy = [n for n, p in model.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(
            f"the model has lazy parameters ({', '.join(lazy[:3])}): their sizes are unknown "
            "until a forward pass. Run one in the factory, e.g. `model(torch.zeros(1, "
            "*input_shape)); return model` (free on the meta device), or give the layers "
            "their input sizes"
        )
    return model


def to_empty_shared(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to_empty(device)`` that keeps shared parameters shared and converts each once.

    ``Module.to_empty`` converts a module once per parent, so a module held by two parents
    (MONAI's DynUNet keeps its output block in its skip list too; tied embeddings) is converted
    twice, and under fake tensors the second conversion fails ("Couldn't swap").
    """
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():  # each module once
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in done:
                    new = _empty_like(t, device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    done[id(t)] = new
                table[name] = done[id(t)]  # type: ignore[assignment]
    return model


def _empty_like(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    # Not empty_like: that fakes the meta input first, 4x the time here.
    from bigbatch.memory.fsdp import local_shard

    local = local_shard(t)
    if local is t:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    # FSDP2's sharded parameter (a DTensor): this rank's shard, on the same mesh and placements.
    from torch.distributed.tensor import DTensor

    sharded: Any = t
    shard = torch.empty_strided(local.size(), local.stride(), dtype=t.dtype, device=device)
    return DTensor.from_local(
        shard,
        sharded.device_mesh,
        sharded.placements,
        run_check=False,
        shape=t.size(),
        stride=t.stride(),
    )


def unfakeable_op(exc: BaseException) -> str | None:
    """The op fake tensors could not run, when that is what ``exc`` says; else None."""
    from torch._subclasses.fake_tensor import (
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    if isinstance(exc, DynamicOutputShapeException | UnsupportedOperatorException):
        return str(exc.func)
    text = str(exc)
    if isinstance(exc, NotImplementedError) and "Meta" in text:
        return text.split(":", 1)[0]  # "aten::_unique2: attempted to run this operator ..."
    if isinstance(exc, RuntimeError) and "cannot be called on meta tensors" in text:
        # A value read back while building (MONAI's SwinUNETR: its stochastic depth rates,
        # torch.linspace(...) each .item()): "Tensor.item() cannot be called on meta tensors".
        return text.split(" cannot", 1)[0]
    return None
