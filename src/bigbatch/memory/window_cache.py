"""What a window of a loss that couples the samples holds besides each micro-batch's step, traced.

:func:`bigbatch.coupled.cached_backward` (and so ``run_coupled_window``, which ``bigbatch train``
uses for ``loss=dice_batch``) keeps the whole window's outputs, a copy of them that the loss
differentiates, and then their gradient, for the whole window: memory that grows with the
window, not the micro-batch, so backing off cannot shrink it, and a plan must leave room for it
(``plan_under_budget(..., extra_bytes=...)``). The loss's own activations at the whole window
(a batch Dice's probabilities, products and sums) come on top while it runs: MONAI's losses
read values on the host (``torch.arange(...).tolist()``), which fake tensors cannot, so that
moment is measured: real CPU runs of the loss at windows of 2 and 4 samples, extrapolated
linearly (a loss over pixels or voxels holds per-sample activations).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["extrapolated_window_bytes", "window_cache_bytes"]


def window_cache_bytes(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    output_shape: tuple[int, ...],
    targets: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> int:
    """The most a coupled window of ``len(targets)`` samples holds besides its micro-batch
    steps: the larger of the loss's moment (the cached outputs, the copy it differentiates, its
    activations and their gradients) and the second pass's (outputs, copy and gradient, held
    while each micro-batch runs again). ``targets`` are the window's (they exist anyway, as
    its batch does); ``dtype`` is the model's output dtype (16 bits under autocast).

    >>> from bigbatch.segmentation.losses import batch_dice_loss
    >>> need = window_cache_bytes(batch_dice_loss, (2, 8, 8, 8), torch.zeros(16, 8, 8, 8, dtype=torch.long))
    >>> need >= 3 * 16 * 2 * 8**3 * 4   # outputs, their copy and their gradient at least
    True
    """
    from bigbatch.memory.measure import profiled_peak

    window = len(targets)
    per_sample = torch.Size(output_shape).numel() * torch.empty((), dtype=dtype).element_size()

    def loss_moment(n: int) -> int:
        cached = torch.zeros((n, *output_shape), dtype=dtype)
        part = targets[:n]

        def run() -> None:
            local = torch.cat([cached]).requires_grad_(True)
            loss_fn(local, part).backward()

        return profiled_peak(run, alive_at_start=n * per_sample)

    return extrapolated_window_bytes(loss_moment, window, per_sample)


def extrapolated_window_bytes(
    loss_moment: Callable[[int], int], window: int, per_sample: int
) -> int:
    """What a coupled window of ``window`` samples holds: the loss's moment at the whole window
    (``loss_moment(n)``, measured at 2 and 4 samples and extrapolated linearly: a loss over
    pixels or voxels holds per-sample activations), or, if more, the outputs, their copy and
    their gradient (3 x ``per_sample`` bytes a sample) that the second pass holds.

    >>> extrapolated_window_bytes(lambda n: 100 + 10 * n, 16, 2)
    260
    """
    small, large = min(2, window), min(4, window)
    at_small = loss_moment(small)
    at_large = loss_moment(large) if large > small else at_small
    slope = (at_large - at_small) / (large - small) if large > small else at_small / small
    loss_peak = int(at_small + slope * (window - small))
    return max(loss_peak, 3 * window * per_sample)
