"""The count bookkeeping of one window, for frameworks that run backward and step themselves.

Where a framework owns both ``loss.backward()`` and ``optimizer.step()`` (fastai's Learner,
Keras's ``fit``), the adapter cannot hand them to :class:`bigbatch.Accumulator`; it asks this
window what to multiply each micro-batch's loss by before backward, and the summed gradient by
before the step. Same rule as the Accumulator: weight each mean loss by its count, divide the
window once by its true total count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bigbatch.accumulate import Reduction
from bigbatch.counts import MicroBatchCount

__all__ = ["ExactWindow"]


@dataclass
class ExactWindow:
    """One window's counts: ``micro_batches`` per window, or ``target_count`` items per window.

    >>> from bigbatch.counts import resolve_count
    >>> w = ExactWindow(micro_batches=2)
    >>> w.add(resolve_count(3)), w.add(resolve_count(1)), w.full
    (0.5, 0.16666666666666666, True)
    >>> w.close()   # the gradient factor: ref / count = 6 / 4
    1.5
    """

    micro_batches: int | None = None
    target_count: float | None = None
    reduction: Reduction = "mean"

    def __post_init__(self) -> None:
        if (self.micro_batches is None) == (self.target_count is None):
            raise ValueError(
                "give one window size: micro_batches=N (micro-batches per optimizer step) or "
                "target_count=C (samples or tokens per optimizer step)"
            )
        if self.micro_batches is not None and (
            isinstance(self.micro_batches, bool)
            or not isinstance(self.micro_batches, int)
            or self.micro_batches < 1
        ):
            raise ValueError(f"micro_batches must be an integer >= 1, got {self.micro_batches!r}")
        if self.target_count is not None and not (
            math.isfinite(self.target_count) and self.target_count > 0
        ):
            raise ValueError(f"target_count must be a positive number, got {self.target_count!r}")
        self.reset()

    def reset(self) -> None:
        self.count = 0.0
        self.micro = 0
        # Losses are weighted by count / ref, with ref the window's expected count, so a full
        # window of equal micro-batches needs no rescaling at the step (as in the Accumulator).
        self.ref: float | None = None

    def add(self, mb: MicroBatchCount) -> float:
        """Account for one micro-batch; return the factor its loss is multiplied by."""
        c = float(mb.normaliser)
        if self.ref is None:
            self.ref = self.target_count or max(c, 1.0) * (self.micro_batches or 1)
        self.count += c
        self.micro += 1
        return (c if self.reduction == "mean" else 1.0) / self.ref

    @property
    def full(self) -> bool:
        if self.micro == 0:
            return False
        if self.target_count is not None:
            return self.count >= self.target_count
        return self.micro >= (self.micro_batches or 1)

    def close(self) -> float | None:
        """End the window; return the gradient factor, or None when its count is zero (every
        label was padding): then skip the step and discard the gradient."""
        ref, count = self.ref or 1.0, self.count
        self.reset()
        return ref / count if count > 0 else None
