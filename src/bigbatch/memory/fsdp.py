"""One FSDP2 rank's training step, traced in this process: the model under ``fully_shard`` on a
fake process group of N ranks (torch's own ``fake`` backend: collectives that move no data),
so that the trace holds what a rank holds (its shards of the weights, gradients and optimizer
state as DTensors, each layer's all-gather and reduce-scatter buffers while they live) rather
than a one-process step with the sharding composed on top.

FSDP2 frees a layer's unsharded weights by resizing their storage to nothing and takes the
memory back before the next all-gather (``free_storage`` / ``alloc_storage``), which no
dispatcher op shows: :func:`storage_resizes` has the trace follow them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["StreamNumbers", "fake_ranks", "local_shard", "shard_decoder_layers", "storage_resizes"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``t`` is: this rank's shard of a DTensor (FSDP2's sharded
    weights, gradients and optimizer state), else ``t`` itself.

    >>> local_shard(torch.ones(3)).shape
    torch.Size([3])
    """
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


@contextlib.contextmanager
def fake_ranks(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) while the block
    runs, for tracing one rank's step. Refused where a process group exists already (under
    ``torchrun``): plan from a process of its own.

    >>> with fake_ranks(4):
    ...     import torch.distributed as dist
    ...     dist.get_world_size()
    4
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "tracing FSDP2 ranks needs a process without a process group; this one has one "
            "(torchrun): plan before init_process_group, or with `bigbatch plan --hf` apart"
        )
    # Importing it registers torch's "fake" backend (torchtitan's memory estimation uses it too).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_decoder_layers(
    model: nn.Module, layers: list[nn.Module], device_type: str = "cpu"
) -> nn.Module:
    """``fully_shard`` each of ``layers`` (a causal LM's decoder layers) and then the root, as
    accelerate's transformer wrapping and torchtitan do, on a mesh of ``device_type`` over the
    process group's ranks: ``cpu`` for a trace (it runs on CPU-placed fake tensors whatever the
    target), the device for a real step (FSDP2 moves the weights there).

    >>> with fake_ranks(2):
    ...     m = shard_decoder_layers(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [])
    ...     tuple(m[0].weight.to_local().shape)
    (2, 4)
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class StreamNumbers:
    """The stream a traced step is on now, as a number (0: the one current when this is made,
    the default stream; others from 1 in the order first seen). FSDP2 gathers weights and
    reduces gradients on streams of its own, and on a GPU the caching allocator keeps each
    stream's blocks apart; a trace runs on the CPU, where FSDP2 enters ``torch.cpu``'s
    stand-in streams at the same places, so the trace can say which stream each allocation
    is on.

    >>> streams = StreamNumbers()
    >>> with torch.cpu.stream(torch.cpu.Stream()):
    ...     inside = streams.current()
    >>> inside, streams.current()
    (1, 0)
    """

    def __init__(self) -> None:
        default = torch.cpu.current_stream()
        # Each stream held beside its number, so that its id() is not reused by another.
        self._numbers: dict[int, tuple[int, object]] = {id(default): (0, default)}

    def current(self) -> int:
        """The number of the stream that is current now."""
        stream = torch.cpu.current_stream()
        if id(stream) not in self._numbers:
            self._numbers[id(stream)] = (len(self._numbers), stream)
        return self._numbers[id(stream)][0]


@contextlib.contextmanager
def storage_resizes(resized: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """While the block runs, ``resized(tensor)`` after FSDP2 resizes a tensor's storage in
    place (frees or re-takes an unsharded weight's memory). Nothing where FSDP2 is not
    imported; restored on exit.

    >>> with storage_resizes(lambda t: None):
    ...     pass
    """
    param: Any = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param")
    group: Any = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    patched: list[tuple[Any, str, Any]] = []
    for module, name in (
        (param, "free_storage"),
        (param, "alloc_storage"),
        (group, "alloc_storage"),
    ):
        original = getattr(module, name, None)
        if original is None:
            continue

        def following(tensor: torch.Tensor, _original: Any = original) -> None:
            _original(tensor)
            resized(tensor)

        patched.append((module, name, original))
        setattr(module, name, following)  # looked up at each call, as a module global
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
