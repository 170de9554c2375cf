"""The scratch memory of ATen's CUDA reduction kernel (``sum``, ``mean`` over some dimensions).

Where a reduction has few outputs and many inputs per output (a linear layer's bias gradient:
``grad.sum(0)`` over batch x tokens rows), ATen splits each output's inputs across thread
blocks and combines them through a staging buffer in global memory, with a semaphore per
block column; both come from the caching allocator and are freed when the kernel is queued.
Their sizes follow from the launch configuration ``setReduceConfig`` chooses
(aten/src/ATen/native/cuda/Reduce.cuh), which depends on the card's multiprocessor count: the
traces of ViT-B's training steps (bfloat16, batch 64: 12,608 rows) hold buffers of 73.9, 132.75
and 132.0 MiB for 768, 2304 and 3072 outputs with semaphores of 24, 72 and 96 bytes, which this
gives to the byte on an H100 (132 multiprocessors, 2048 threads each).

>>> x = torch.empty(12608, 768, dtype=torch.bfloat16, device="meta")
>>> reduction_staging("aten.sum.dim_IntList", (x, [0]), card=(132, 2048))
[77463552, 24]
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

__all__ = ["reduction_staging"]

# The card predicted for where none is at hand: an H100's (and an H200's) multiprocessors and
# the threads each can hold, the card the traces come from.
H100_MULTIPROCESSORS = 132
THREADS_PER_MULTIPROCESSOR = 2048

_REDUCTIONS = frozenset({"aten.sum.dim_IntList", "aten.mean.dim"})
_MAX_THREADS = 512  # a block's threads (256 for complex double, not modelled)
_WARP = 32
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256
_INPUT_VEC = 4  # gpu_reduce_kernel's vt0


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _card() -> tuple[int, int]:
    """The predicted card's multiprocessors and threads per multiprocessor."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.multi_processor_count, props.max_threads_per_multi_processor
    return H100_MULTIPROCESSORS, THREADS_PER_MULTIPROCESSOR


def _two_blocks(x: torch.Tensor, dims: Any) -> tuple[int, int, bool] | None:
    """(inputs per output, outputs, whether the reduced dimensions are the fastest) where the
    reduced dimensions of dense ``x`` are, in memory order, its outermost or its innermost
    ones (what TensorIterator folds into one reduced and one kept dimension: a contiguous
    tensor's leading rows, or a transposed view's); None otherwise."""
    if x.dim() == 0 or not is_non_overlapping_and_dense_or_false(x):
        return None
    asked = {d % x.dim() for d in ([dims] if isinstance(dims, int) else dims)}
    # Memory order, outermost first; a dimension of one element folds away.
    order = sorted((d for d in range(x.dim()) if x.shape[d] > 1), key=lambda d: -x.stride()[d])
    reduced = [d for d in order if d in asked]
    if not reduced or len(reduced) == len(order):
        return None
    n_inputs = math.prod(x.shape[d] for d in reduced)
    n_outputs = x.numel() // n_inputs
    if order[: len(reduced)] == reduced:
        return n_inputs, n_outputs, False
    if order[-len(reduced) :] == reduced:
        return n_inputs, n_outputs, True
    return None


def reduction_staging(
    func: str, args: tuple[Any, ...], card: tuple[int, int] | None = None
) -> list[int]:
    """The staging buffer's and the semaphores' bytes a reduction op takes on ``card``
    (multiprocessors, threads each; default :func:`_card`'s), or [] where it takes none or the
    op is not one modelled here."""
    if func not in _REDUCTIONS or len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return []
    x = args[0]
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return []
    shape = _two_blocks(x, args[1])
    if shape is None or x.numel() == 0:
        return []
    n_inputs, n_outputs, fastest = shape
    arg_bytes = 8 if x.dtype == torch.float64 else 4  # the accumulation type
    # Vectorised loads: along the input where the reduced dimension is the fastest, else along
    # the outputs (4 where their count allows).
    vec = 1
    dim0, dim1 = (n_inputs, n_outputs) if fastest else (n_outputs, n_inputs)
    if fastest and dim0 >= 128:
        dim0 //= _INPUT_VEC
    elif not fastest:
        vec = 4
        while n_outputs % vec:
            vec //= 2
        dim0 //= vec
    # set_block_dimension
    max_threads = _MAX_THREADS // vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    step_input = width if fastest else 1
    step_output = 1 if fastest else width
    values_per_thread = -(-n_inputs // step_input)
    across_warps = values_per_thread >= min(height * 16, _MAX_VALUES_PER_THREAD)
    if across_warps:
        step_input *= height
    else:
        step_output *= height
    sms, threads_per_sm = card or _card()
    target_grid = sms * (threads_per_sm // (width * height))
    grid = -(-(n_outputs // vec) // step_output)
    values_per_thread = -(-n_inputs // step_input)
    if not across_warps or values_per_thread < _MAX_VALUES_PER_THREAD or grid > target_grid:
        return []
    ctas = min(
        max(-(-target_grid // grid), -(-values_per_thread // _MAX_VALUES_PER_THREAD)),
        -(-values_per_thread // _MIN_VALUES_PER_THREAD),
    )
    if ctas <= 1:
        return []
    staging = arg_bytes * n_outputs * ctas * (1 if fastest else width * vec)
    return [staging, 4 * grid]
