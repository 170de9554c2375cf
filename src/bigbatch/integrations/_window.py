"""The window of an adapter whose framework runs backward and step itself (fastai's Learner,
Keras's ``fit``): the adapter cannot hand them to :class:`bigbatch.Accumulator`, so it asks a
:class:`bigbatch.window.Window` what to multiply each micro-batch's loss by before backward, and
the summed gradient by before the step. The same rule and the same code as the Accumulator.
"""

from __future__ import annotations

from bigbatch.window import Reduction, Window

__all__ = ["adapter_window"]


def adapter_window(
    micro_batches: int | None,
    target_count: float | None,
    reduction: Reduction = "mean",
    *,
    count_name: str = "target_count",
) -> Window:
    """A :class:`Window` of ``micro_batches`` batches or ``target_count`` items: exactly one,
    since the adapter, not the user, decides when to step.

    >>> adapter_window(4, None).size
    4
    """
    if (micro_batches is None) == (target_count is None):
        raise ValueError(
            "give one window size: micro_batches=N (micro-batches per optimizer step) or "
            f"{count_name}=C (samples or tokens per optimizer step)"
        )
    return Window(micro_batches, target_count, reduction)
