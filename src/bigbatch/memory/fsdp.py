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
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "StreamNumbers",
    "fake_ranks",
    "local_shard",
    "shard_as_trainer",
    "shard_decoder_layers",
    "storage_resizes",
    "trainer_sharding",
]


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
            "(torchrun): plan before init_process_group, or in a process of its own (plan_lm "
            "does, and `bigbatch plan --hf`)"
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

    Weights that are not floating point (a QLoRA base's packed 4-bit weights in bitsandbytes'
    default uint8 storage) are left out of the sharding, whole on each rank, as accelerate
    leaves them (sharded, their quantization state would be lost).

    >>> with fake_ranks(2):
    ...     m = shard_decoder_layers(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [])
    ...     tuple(m[0].weight.to_local().shape)
    (2, 4)
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    whole = {p for p in model.parameters() if not p.is_floating_point()}
    kwargs: dict[str, Any] = {"ignored_params": whole} if whole else {}
    for layer in layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def trainer_sharding() -> bool:
    """Whether accelerate's FSDP2 preparation, what Trainer runs, is installed here (else a
    plan shards as :func:`shard_decoder_layers` does).

    >>> isinstance(trainer_sharding(), bool)
    True
    """
    try:
        from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: F401
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model  # noqa: F401
    except ImportError:
        return False
    return True


def shard_as_trainer(
    model: nn.Module, layers: list[nn.Module], device_type: str = "cpu", precision: str = "fp32"
) -> nn.Module:
    """``model`` under FSDP2 as Trainer runs it: accelerate's own preparation
    (``fsdp2_prepare_model``: FSDP version 2, transformer-layer wrapping on the classes of
    ``layers``, the input embedding and the head in units of their own) on a mesh of
    ``device_type`` over the process group's ranks, at Trainer's ``precision``: with ``bf16``
    or ``fp16``, accelerate's mixed-precision policy (weights gathered, gradients reduced and
    outputs cast in that dtype) and the weights that train upcast to float32 masters (not
    beside a quantized base). Raises what accelerate raises where its preparation cannot run
    here (:func:`trainer_sharding` says whether it is installed).

    >>> with fake_ranks(2):
    ...     m = shard_as_trainer(nn.Sequential(nn.Linear(4, 4)).bfloat16(), [], "cpu", "bf16")
    ...     m[0].weight.dtype, tuple(m[0].weight.to_local().shape)
    (torch.float32, (2, 4))
    """
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.device_mesh import init_device_mesh

    mixed = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # accelerate's notes on the plugin's settings
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=sorted({type(m).__name__ for m in layers}),
            reshard_after_forward=True,
            cpu_ram_efficient_loading=False,
            state_dict_type="SHARDED_STATE_DICT",
        )
        if mixed != "no":
            plugin.set_mixed_precision(mixed)
        mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        # What fsdp2_prepare_model reads of an Accelerator. Not the main process: its log
        # lines need accelerate's global state, which planning must not start.
        accelerator = SimpleNamespace(
            state=SimpleNamespace(fsdp_plugin=plugin),
            mixed_precision=mixed,
            is_main_process=False,
            device=torch.device(device_type),
            torch_device_mesh=mesh,
            parallelism_config=SimpleNamespace(fsdp_dim_names=("fsdp",)),
        )
        return cast(nn.Module, fsdp2_prepare_model(accelerator, model))


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
