"""Out-of-memory errors: how to recognise one on any device.

The back-off that survives an OOM without changing the update is :mod:`bigbatch.backoff`;
freeing memory after one is :func:`bigbatch.device.free_memory`.
"""

from __future__ import annotations

import torch

__all__ = ["HOST_OOM_MESSAGES", "ONEDNN_OOM_MESSAGE", "is_oom"]

# oneDNN on CPU when an allocation fails while it builds a kernel (torch raises it as a
# RuntimeError); after one, see bigbatch.device.onednn_stuck.
ONEDNN_OOM_MESSAGE = "could not create a primitive"

# Fallbacks for errors that are OOM but not raised as an OutOfMemoryError type.
OOM_MESSAGES = (
    "out of memory",  # CUDA (older torch), XPU
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    ONEDNN_OOM_MESSAGE,
    "MPS backend out of memory",
)


NOT_OOM_MESSAGE = "could not create a primitive descriptor"

# Of those, the CPU's (whatever type torch raises them as): the host heap ran out.
HOST_OOM_MESSAGES = ("DefaultCPUAllocator", ONEDNN_OOM_MESSAGE)


def _oom_types() -> tuple[type[BaseException], ...]:
    types = [
        getattr(torch, "OutOfMemoryError", None),
        getattr(torch.cuda, "OutOfMemoryError", None),
    ]
    return tuple(t for t in types if isinstance(t, type))


def is_oom(exc: BaseException) -> bool:
    """True for an out-of-memory error: by type first (``torch.cuda.OutOfMemoryError``), by the
    allocator's message as a fallback (CPU's ``RuntimeError``, oneDNN, MPS).

    >>> is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory")), is_oom(ValueError("x"))
    (True, False)
    """
    if isinstance(exc, _oom_types()):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    # oneDNN says "could not create a primitive descriptor for ..." when it does not support
    # a configuration (an LSTM under bf16 autocast on a CPU without bf16): no smaller
    # micro-batch helps, so it is not an OOM.
    return any(m in text for m in OOM_MESSAGES) and NOT_OOM_MESSAGE not in text
