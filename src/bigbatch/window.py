"""One accumulation window's bookkeeping: its size, the counts and losses of its micro-batches,
and the factors that make the accumulated gradient the big batch's.

Each micro-batch's mean loss is weighted by ``count / ref`` before backward, with ``ref`` the
window's expected count (the first count times the micro-batches per window): the weights are then
about ``1/N``, as with ``loss / N``, which keeps fp16 gradients in range. At step time the summed
gradient is multiplied by ``ref / total count``, exactly 1 for a full window of equal
micro-batches. :class:`~bigbatch.Accumulator` owns a :class:`Window`; the fastai and Keras
adapters, whose frameworks run backward and step themselves, use one directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch

from bigbatch.counts import MicroBatchCount
from bigbatch.device import device_kind

__all__ = ["Reduction", "Window"]

Reduction = Literal["mean", "sum"]
Count = float | torch.Tensor


class Window:
    """The open window: ``micro_batches`` per window (an int, or a schedule by epoch such as
    ``{0: 8, 4: 2}``), or ``target_count`` samples/tokens per window, or neither (the caller
    decides when a window ends). ``shared_ref``: under DDP every rank must weigh its losses alike
    before the totals are known, so the reference count is 1.

    >>> from bigbatch.counts import resolve_count
    >>> w = Window(micro_batches=2)
    >>> w.add(resolve_count(3)), w.add(resolve_count(1)), w.full
    (0.5, 0.16666666666666666, True)
    >>> w.close()   # the gradient factor: ref / count = 6 / 4
    1.5
    """

    def __init__(
        self,
        micro_batches: int | Mapping[int, int] | None = None,
        target_count: float | None = None,
        reduction: Reduction = "mean",
    ) -> None:
        if micro_batches is not None and target_count is not None:
            raise ValueError(
                "give one window size: micro_batches=N (micro-batches per optimizer step) or "
                "target_count=C (samples/tokens per optimizer step), not both (or neither, and "
                "call step() yourself when a window ends)"
            )
        self.schedule = _check_schedule(micro_batches) if micro_batches is not None else None
        if target_count is not None and not (
            isinstance(target_count, int | float)
            and not isinstance(target_count, bool)
            and math.isfinite(target_count)
            and target_count > 0
        ):
            raise ValueError(f"target_count must be a positive number, got {target_count!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.micro_batches = micro_batches
        self.target_count = target_count
        self.reduction: Reduction = reduction
        self.epoch = 0  # the schedule's epoch
        self.reset()

    def reset(self) -> None:
        """Open an empty window."""
        self.micro = 0
        self.count: Count = 0.0
        # Detached losses and their counts; combined (in float64) only at step time, so a
        # micro-batch costs no extra kernels.
        self.losses: list[torch.Tensor] = []
        self.counts: list[Count] = []
        self.ref: Count | None = None
        self.planned: int | None = None  # micro-batches a loop said the window will hold
        self._full_at: tuple[Count, bool] = (self.count, False)

    def plan(self, micro_batches: int) -> None:
        """Say that the window about to start holds ``micro_batches`` micro-batches (a loop
        that splits its window up front knows): its losses are weighed against that many, so
        a full window of equal micro-batches needs no rescaling pass over the gradients at
        step time. A window with a size of its own keeps it.

        >>> from bigbatch.counts import resolve_count
        >>> w = Window(); w.plan(2)
        >>> w.add(resolve_count(4)), w.add(resolve_count(4)), w.close()
        (0.5, 0.5, 1.0)
        """
        if self.micro:
            raise RuntimeError(
                f"plan() comes before the window's first micro-batch; {self.micro} are in it"
            )
        self.planned = micro_batches

    # ------------------------------------------------------------------ size
    @property
    def size(self) -> int | None:
        """Micro-batches per window at :attr:`epoch` (None with ``target_count`` or neither)."""
        return None if self.schedule is None else _schedule_at(self.schedule, self.epoch)

    @property
    def full(self) -> bool:
        """The window has reached its size (with ``target_count`` and counts on a device, this
        reads the count: one sync, which the loop asking pays anyway)."""
        if self.micro == 0:
            return False
        if self.target_count is not None:
            full = float(self.count) >= self.target_count
            self._full_at = (self.count, full)
            return full
        return self.size is not None and self.micro >= self.size

    def _known_full(self) -> bool:
        """:attr:`full`, without reading a device count again when the loop just asked for it
        (counting tokens must not cost a sync per micro-batch)."""
        if self.target_count is not None and self._full_at[0] is self.count:
            return self._full_at[1]
        return self.full

    def is_last(self, next_count: int | None = None) -> bool:
        """Whether the next micro-batch completes the window (``next_count``: its count, for
        ``target_count`` windows)."""
        if self.target_count is not None:
            if next_count is None:
                raise ValueError(
                    "with target_count windows, pass the next micro-batch's count: "
                    "acc.no_sync(model, count=len(batch))"
                )
            return float(self.count) + next_count >= self.target_count
        return self.size is not None and self.micro + 1 >= self.size

    def check_open(self) -> None:
        if self._known_full():
            # Without this, a forgotten step() merges every following window into one update.
            raise RuntimeError(
                f"the window is full ({self.micro} micro-batches"
                + (
                    f", count {float(self.count):g} >= target_count {self.target_count:g}"
                    if self.target_count is not None
                    else ""
                )
                + "): call acc.step() when acc.window_full, before the next micro-batch's "
                "backward()"
            )

    # ------------------------------------------------------------------ counts
    def add(
        self, mb: MicroBatchCount, loss: torch.Tensor | None = None, *, shared_ref: bool = False
    ) -> Count:
        """Account for one micro-batch; return the factor its loss is multiplied by before
        backward. Counts given as tensors stay tensors: no device sync."""
        self.check_open()
        c = _exact(mb.normaliser)
        if self.ref is None:
            self.ref = 1.0 if shared_ref else self._expected(c)
        if loss is not None:
            self.losses.append(loss.detach())
            self.counts.append(c)
        self.count = self.count + c
        self.micro += 1
        return _ratio(c if self.reduction == "mean" else 1.0, self.ref)

    def _expected(self, first: Count) -> Count:
        if self.target_count is not None:
            return float(self.target_count)
        n = self.size or self.planned or 1
        if isinstance(first, torch.Tensor):
            return torch.clamp(first, min=1.0) * n
        return (first if first > 0 else 1.0) * n

    def close(self) -> float | None:
        """End the window; return the gradient factor ``ref / count``, or None when its count
        is zero (every label was padding): then skip the step and discard the gradient."""
        ref, count = float(self.ref or 1.0), float(self.count)
        self.reset()
        return ref / count if count > 0 else None

    def check_counts_not_negative(self) -> None:
        """Tensor counts are checked here, at step time, where the counts are read anyway, not
        per micro-batch (which would wait for the device each time)."""
        first = next((c for c in self.counts if isinstance(c, torch.Tensor)), None)
        if first is None:
            return
        counts = torch.stack(
            [torch.as_tensor(c, dtype=first.dtype, device=first.device) for c in self.counts]
        )
        if bool((counts < 0).any()):
            raise ValueError(
                f"micro-batch {int((counts < 0).nonzero()[0]) + 1} of this window has a negative "
                "count or weight: counts are numbers of samples/tokens and weights are >= 0; "
                "pass count=len(batch), labels=labels or weight=w.sum() with w >= 0"
            )

    def loss_sum(self) -> torch.Tensor | None:
        """Sum of the count-weighted losses, in float64 where the device has it."""
        return weighted_loss_sum(self.losses, self.counts, self.reduction)

    def non_finite_losses(self) -> list[int]:
        """The (1-based) micro-batches whose loss was inf or nan."""
        return [i + 1 for i, x in enumerate(self.losses) if not bool(torch.isfinite(x).all())]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_in_window": self.micro,
            "window_count": torch.as_tensor(self.count, dtype=torch.float64).cpu(),
            "window_losses": [loss.cpu() for loss in self.losses],
            "window_loss_counts": [
                torch.as_tensor(c, dtype=torch.float64).cpu() for c in self.counts
            ],
            "ref": None
            if self.ref is None
            else torch.as_tensor(self.ref, dtype=torch.float64).cpu(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.micro = int(state["micro_in_window"])
        self.count = float(state["window_count"])
        self.losses = [loss.clone() for loss in state["window_losses"]]
        self.counts = [float(c) for c in state["window_loss_counts"]]
        self.ref = None if state["ref"] is None else float(state["ref"])


def weighted_loss_sum(
    losses: list[torch.Tensor], counts: list[Count], reduction: Reduction
) -> torch.Tensor | None:
    """Sum of count-weighted losses (a window's), in float64 where the device has it."""
    if not losses:
        return None
    stacked = cast(torch.Tensor, _exact(torch.stack(losses)))
    if reduction == "sum":
        return stacked.sum()
    if all(not isinstance(c, torch.Tensor) for c in counts):
        weights = torch.tensor(counts, dtype=stacked.dtype, device=stacked.device)
    else:
        weights = torch.stack([torch.as_tensor(c).to(stacked) for c in counts])
    # A micro-batch of count 0 (all padding) has a mean loss of 0/0 = nan but adds nothing.
    return torch.where(weights == 0, 0.0, stacked * weights).sum()


def mean_loss(
    losses: list[torch.Tensor], counts: list[Count], reduction: Reduction, count: float
) -> float:
    """A window's exact mean loss: the count-weighted sum over its total count."""
    total = weighted_loss_sum(losses, counts, reduction)
    return math.nan if total is None else float(total) / count


def _check_schedule(micro_batches: int | Mapping[int, int]) -> dict[int, int]:
    def check_n(n: object, where: str) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"micro_batches{where} must be an integer >= 1, got {n!r}")
        return n

    if isinstance(micro_batches, Mapping):
        if not micro_batches:
            raise ValueError("micro_batches schedule is empty; give at least {0: N}")
        schedule = {}
        for epoch, n in micro_batches.items():
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise ValueError(f"micro_batches schedule keys are epochs >= 0, got {epoch!r}")
            schedule[epoch] = check_n(n, f"[{epoch}]")
        if 0 not in schedule:
            raise ValueError(
                f"micro_batches schedule must say what to do from epoch 0, got keys "
                f"{sorted(schedule)}; add 0: N"
            )
        return schedule
    return {0: check_n(micro_batches, "")}


def _schedule_at(schedule: Mapping[int, int], epoch: int) -> int:
    return schedule[max(e for e in schedule if e <= epoch)]


def _ratio(c: Count, ref: Count) -> Count:
    if isinstance(c, torch.Tensor) or isinstance(ref, torch.Tensor):
        return torch.as_tensor(_exact(c)) / torch.as_tensor(_exact(ref))
    return float(c) / float(ref)


def _exact(x: Count) -> Count:
    """A count in float64 (float32 on MPS, which has no float64), so sums of counts stay exact."""
    if not isinstance(x, torch.Tensor):
        return float(x)
    return x.detach().to(torch.float64 if device_kind(x.device).float64 else torch.float32)
