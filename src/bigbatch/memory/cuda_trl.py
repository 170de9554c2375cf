"""TRL's fused LM head as a CUDA card runs it, in a trace that runs on the CPU.

TRL's ``SFTTrainer`` computes its loss through a fused LM head (``add_fused_lm_head`` in
``trl.trainer.utils``): the token log-probabilities come from ``[4096 x 32768]`` tiles of the
logits, one at a time, never the whole ``[tokens x vocabulary]`` logits. On a card, a Triton kernel
folds each tile into per-token statistics in place (and, in the backward, turns it into the logits'
gradient in place); elsewhere TRL runs the same fold as torch ops, whose temporaries are each as
large as the tile. A CUDA step is traced on CPU-placed fake tensors, where TRL would take its torch
path: :func:`trl_kernels_as_on_a_card` has it take the card's, its two Triton kernels stood in for
by what they allocate (nothing: they write into the tile and the per-token statistics TRL made), and
its float32 accumulation of the gradients' products through cuBLAS (``addmm`` with ``out_dtype``, on
a card only: elsewhere it copies both factors to float32 first) by nothing either. Every position is
scored, as TRL does off Triton (on a card it scores only positions with a label, which a boolean
mask selects: a shape fake tensors cannot know), so the trace is over by the ignored positions' rows
of each tile.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["trl_kernels_as_on_a_card"]

_KERNELS = "trl.kernels.chunked_logprob"
_HEAD = "trl.trainer.utils"
_lock = threading.Lock()


class _InPlace:
    """A Triton kernel's stand-in: ``kernel[grid](...)`` writes into its arguments, no more."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class _Cdiv:
    """``triton.cdiv``, where the machine that plans has no Triton."""

    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)


def _on_a_card(addmm_fp32: Callable[..., None]) -> Callable[..., None]:
    """TRL's ``_addmm_fp32`` as on a card: 16-bit factors go to cuBLAS, which accumulates their
    product into the float32 sum in place (nothing made); others as TRL runs them."""

    def accumulate(acc: Any, a: Any, b: Any) -> None:
        if a.dtype not in (torch.float16, torch.bfloat16):
            addmm_fp32(acc, a, b)

    return accumulate


@contextlib.contextmanager
def trl_kernels_as_on_a_card() -> Iterator[None]:
    """While entered, TRL's chunked log-probabilities (if TRL's fused head is imported) take the
    path a CUDA card runs, with its kernels stood in for. Process-wide (TRL's module state):
    the planner enters it only around a CUDA target's trace, one trace at a time.

    >>> with trl_kernels_as_on_a_card():
    ...     pass
    """
    kernels: Any = sys.modules.get(_KERNELS)
    head: Any = sys.modules.get(_HEAD)
    if kernels is None or head is None or not hasattr(kernels, "_forward_kernel"):
        yield
        return
    names = ("_use_triton", "_forward_kernel", "_backward_kernel", "triton", "_addmm_fp32")
    with _lock:
        saved = {name: getattr(kernels, name, None) for name in names}
        head_saved = getattr(head, "_use_triton", None)
        try:
            kernels._use_triton = lambda device: True
            kernels._forward_kernel = kernels._backward_kernel = _InPlace()
            if saved["triton"] is None:
                kernels.triton = _Cdiv()
            if getattr(kernels, "_MM_OUT_DTYPE", False) and saved["_addmm_fp32"] is not None:
                kernels._addmm_fp32 = _on_a_card(saved["_addmm_fp32"])
            if head_saved is not None:
                head._use_triton = lambda device: False  # every position scored (see above)
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    vars(kernels).pop(name, None)
                else:
                    setattr(kernels, name, value)
            if head_saved is not None:
                head._use_triton = head_saved
