"""Exact gradient accumulation for a plain PyTorch loop.

Each micro-batch's mean loss is weighted by its count before ``backward``; the summed gradient
is divided by the window's true total count once, at step time (over all ranks under DDP).
The update then equals the big-batch update whatever the micro-batch sizes, token counts,
partial last window or number of processes: the usual ``loss / N`` is right only when every
micro-batch has the same count.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, cast

import torch
from torch import nn

from bigbatch import distributed as bbdist
from bigbatch.counts import MicroBatchCount, resolve_count
from bigbatch.inexact import warn_inexact_layers

__all__ = [
    "Accumulator",
    "EmptyWindowWarning",
    "NonFiniteGradientWarning",
    "StepResult",
    "scale_grads_",
]

LastWindow = Literal["renorm", "drop", "carry"]
Reduction = Literal["mean", "sum"]
_LAST_WINDOW_POLICIES = ("renorm", "drop", "carry")


class EmptyWindowWarning(UserWarning):
    """A window's total count was zero (e.g. only padding): its step was skipped."""


class NonFiniteGradientWarning(UserWarning):
    """A window's gradient held inf or nan (no GradScaler to catch it): its step was skipped."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did (returned by :meth:`Accumulator.step`)."""

    optimizer_step: int  # the optimizer step counter after this step
    micro_batches: int  # micro-batches in the window (on this rank)
    count: float  # the window's total count: samples, tokens or weight, summed over ranks
    grad_norm: float | None  # total gradient norm before clipping, when clipping is on
    skipped: bool  # True when the step was skipped (fp16 inf/nan, or a zero-count window)
    # The loss is computed when first read, so a loop that does not log it never waits for
    # the device; under DDP it is all-reduced with the count and stored as a float.
    _loss: float | Callable[[], float] = field(default=math.nan, repr=False, compare=False)
    # True when the step was skipped because the gradient held inf/nan without a GradScaler to
    # own it (a diverging run, a bad batch): not the routine skip of fp16 loss scaling.
    non_finite: bool = False

    @property
    def loss(self) -> float:
        """The exact window mean loss (count-weighted, over ranks): not a mean of means."""
        if callable(self._loss):
            object.__setattr__(self, "_loss", self._loss())
        return cast(float, self._loss)


def scale_grads_(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every existing ``.grad`` by ``factor`` in place, grouped by device and dtype.

    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.full((2,), 4.0)
    >>> scale_grads_([p], 0.25); p.grad.tolist()
    [1.0, 1.0]
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in groups.values():
        torch._foreach_mul_(grads, factor)


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class Accumulator:
    """Accumulate micro-batches into windows and step once per window, exactly.

    The loop stays yours: call :meth:`backward` for each micro-batch, :meth:`step` when
    :attr:`window_full`, and :meth:`end_epoch` after each epoch (it settles the last, partial
    window by ``last_window``: ``"renorm"`` steps on what it has, normalised by its real count;
    ``"drop"`` discards it; ``"carry"`` continues it in the next epoch).

    A window is ``micro_batches`` micro-batches (an int, or a schedule by epoch such as
    ``{0: 8, 4: 2}``), or, with ``target_count``, however many micro-batches it takes to reach
    that many samples/tokens; with neither, :attr:`window_full` stays False and you call
    :meth:`step` when your window ends (as :func:`bigbatch.memory.oom.run_window` does).
    ``reduction`` says whether your loss is a mean (default) or a sum over its count. ``scheduler`` is stepped once per optimizer step (never on a skipped fp16
    step); ``scaler`` is a ``torch.amp.GradScaler`` for fp16; ``clip_grad_norm`` clips the
    accumulated, unscaled, normalised gradient once per window.

    Under DDP (``model=`` the DDP module, micro-batches run inside :meth:`no_sync`) the window's
    count is summed over ranks and the gradients are synchronised once per window: with
    ``sync="last"`` by DDP itself during the last micro-batch's backward (overlapping
    communication with compute; every rank must run the same number of micro-batches, as a
    ``DistributedSampler`` ensures), with ``sync="step"`` by one flat all-reduce at step time
    (ranks may run out of data at different times, and OOM back-off cannot deadlock). FSDP2
    (``fully_shard``) takes ``sync="last"`` (one reduce-scatter per window; unsharded gradients
    are kept in between) or ``sync="every"`` (a reduce-scatter per micro-batch: less memory).

    >>> import torch, torch.nn.functional as F
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> acc = Accumulator(opt, micro_batches=2)
    >>> for x, y in [(torch.randn(3, 4), torch.tensor([0, 1, 0])), (torch.randn(1, 4), torch.tensor([1]))]:
    ...     acc.backward(F.cross_entropy(model(x), y), count=len(y))
    ...     if acc.window_full:
    ...         result = acc.step()
    >>> acc.optimizer_step, acc.samples_seen
    (1, 4)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        micro_batches: int | Mapping[int, int] | None = None,
        target_count: float | None = None,
        reduction: Reduction = "mean",
        last_window: LastWindow = "renorm",
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        clip_grad_norm: float | None = None,
        model: nn.Module | None = None,
        process_group: Any = None,
        sync: Literal["last", "step", "every"] = "last",
        epoch_length: int | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "pass the optimizer itself: Accumulator(optimizer, micro_batches=8)"
            )
        if type(optimizer).__name__ == "AccumulatingOptimizer":
            raise TypeError(
                "this optimizer is an AccumulatingOptimizer, which accumulates already: pass the "
                "optimizer it wraps (wrapper.optimizer), or use the wrapper alone"
            )
        if micro_batches is not None and target_count is not None:
            raise ValueError(
                "give one window size: micro_batches=N (micro-batches per optimizer step) or "
                "target_count=C (samples/tokens per optimizer step), not both (or neither, and "
                "call step() yourself when a window ends)"
            )
        self._schedule = _check_schedule(micro_batches) if micro_batches is not None else None
        if target_count is not None and not (
            isinstance(target_count, int | float)
            and math.isfinite(target_count)
            and target_count > 0
        ):
            raise ValueError(f"target_count must be a positive number, got {target_count!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if last_window not in _LAST_WINDOW_POLICIES:
            raise ValueError(
                f"last_window must be one of {_LAST_WINDOW_POLICIES}, got {last_window!r}"
            )
        if sync not in ("last", "step", "every"):
            raise ValueError(f"sync must be 'last', 'step' or 'every', got {sync!r}")
        if sync == "step" and bbdist.is_fsdp(model):
            raise ValueError(
                "sync='step' all-reduces full gradients, which FSDP2 shards: use sync='every' "
                "(reduce-scatter each micro-batch: least memory) or sync='last' (once per window)"
            )
        if epoch_length is not None and (
            isinstance(epoch_length, bool) or not isinstance(epoch_length, int) or epoch_length < 1
        ):
            raise ValueError(
                f"epoch_length is the number of backward() calls per epoch (an integer >= 1, "
                f"e.g. len(loader)), got {epoch_length!r}"
            )
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {clip_grad_norm!r}")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau steps on a metric, not per optimizer step: do not pass it as "
                "scheduler=; call scheduler.step(val_loss) yourself after each epoch"
            )
        self.optimizer = optimizer
        self.target_count = float(target_count) if target_count is not None else None
        self.reduction: Reduction = reduction
        self.last_window: LastWindow = last_window
        self.scheduler = scheduler
        self.scaler = scaler
        self.clip_grad_norm = clip_grad_norm
        self.model = model
        self.process_group = process_group
        self.sync = sync
        self.epoch_length = epoch_length

        # Counters, named with their units.
        self.micro_step = 0
        self.optimizer_step = 0
        self._samples_seen: float | torch.Tensor = 0
        self._tokens_seen: float | torch.Tensor = 0
        self.epoch = 0
        self._micro_in_epoch = 0  # backward() calls since the last end_epoch()
        self._iterating = False  # inside iterate(): it calls end_epoch() itself

        self._checked_model = False
        # Whether DDP will all-reduce the next backward (False inside no_sync()).
        self._pending_sync = True
        self._reset_window()

    # ----------------------------------------------------------------- window state
    def _reset_window(self) -> None:
        # Counters at the window's start, for discard_window().
        self._window_start = (self.micro_step, self._samples_seen, self._tokens_seen)
        self._micro_in_window = 0
        self._window_count: float | torch.Tensor = 0.0
        # Detached losses and their counts; combined (in float64) only at step time, so a
        # micro-batch costs no extra kernels.
        self._losses: list[torch.Tensor] = []
        self._counts: list[float | torch.Tensor] = []
        # Losses are weighted by count / ref, with ref the window's expected count (first count x
        # micro-batches per window): the weights are then ~1/N, as with loss / N, which keeps
        # fp16 gradients in range, and a full window of equal micro-batches needs no rescaling
        # pass at step time (ref / count == 1). Under DDP ref must agree across ranks: 1 there.
        self._ref: float | torch.Tensor | None = None
        self._last_backward_synced = True
        # Each gradient as the last backward() left it, and its version counter: a gradient
        # cleared, replaced or changed in place before the next backward() or step() (a
        # zero_grad() left in the loop) would silently drop the window's earlier micro-batches.
        self._grads_after_backward: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    @property
    def micro_batches_per_window(self) -> int | None:
        """Micro-batches per window at the current epoch (None with ``target_count``)."""
        if self._schedule is None:
            return None
        return _schedule_at(self._schedule, self.epoch)

    @property
    def micro_in_window(self) -> int:
        """Micro-batches accumulated so far in the open window."""
        return self._micro_in_window

    @property
    def window_full(self) -> bool:
        """True when the open window has reached its size: time to call :meth:`step`."""
        if self._micro_in_window == 0:
            return False
        if self.target_count is not None:
            return float(self._window_count) >= self.target_count
        n = self.micro_batches_per_window
        return n is not None and self._micro_in_window >= n

    def is_last_micro_batch(self, count: int | None = None) -> bool:
        """Whether the next micro-batch completes the window (so gradients should sync).

        With ``target_count`` windows, pass the next micro-batch's ``count``.
        """
        if self.target_count is not None:
            if count is None:
                raise ValueError(
                    "with target_count windows, pass the next micro-batch's count: "
                    "acc.no_sync(model, count=len(batch))"
                )
            return float(self._window_count) + count >= self.target_count
        n = self.micro_batches_per_window
        return n is not None and self._micro_in_window + 1 >= n

    @contextmanager
    def no_sync(
        self, model: nn.Module | None = None, *, count: int | None = None
    ) -> Iterator[None]:
        """Run a micro-batch's forward and backward inside this context: under DDP, gradients
        are synchronised only on the window's last micro-batch. A no-op on one process.

        A window that ends early (the last partial window of an epoch) is still exact: step()
        then all-reduces the unsynchronised gradients itself.
        """
        model = model if model is not None else self.model
        skip = (
            bbdist.syncs_gradients(model)
            and self.sync != "every"
            and (self.sync == "step" or not self.is_last_micro_batch(count))
        )
        self._pending_sync = not skip
        try:
            with bbdist.maybe_no_sync(model, skip):
                yield
        finally:
            self._pending_sync = True

    def iterate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate over one epoch of ``loader`` and call :meth:`end_epoch` when it is exhausted,
        so the epoch's partial window is settled and a ``micro_batches`` schedule advances.

        >>> import torch, torch.nn.functional as F
        >>> model = torch.nn.Linear(4, 2)
        >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2)
        >>> loader = [(torch.randn(3, 4), torch.tensor([0, 1, 0]))] * 3
        >>> for x, y in acc.iterate(loader):
        ...     acc.backward(F.cross_entropy(model(x), y), count=len(y))
        ...     if acc.window_full:
        ...         _ = acc.step()
        >>> acc.optimizer_step, acc.epoch   # 2 windows: [3+3], then the partial [3]
        (2, 1)
        """
        if self._micro_in_epoch and not self._iterating:
            raise RuntimeError(
                f"{self._micro_in_epoch} micro-batch(es) ran since the last end_epoch(): call "
                "acc.end_epoch() after a loop that does not use acc.iterate(loader)"
            )
        self._iterating = True
        try:
            yield from loader
        finally:
            self._iterating = False
        # Only an exhausted loader ends the epoch: a loop left with `break` keeps its window.
        self.end_epoch()

    # -------------------------------------------------------------------- backward
    def backward(
        self,
        loss: torch.Tensor,
        count: int | torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        ignore_index: int = -100,
        shift: bool = False,
        weight: float | torch.Tensor | None = None,
        backward: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Backpropagate one micro-batch's loss, weighted by its count.

        ``loss`` is your usual scalar loss (a mean over the micro-batch unless ``reduction="sum"``).
        Say what it averages over with exactly the count you have: ``count=len(batch)``
        (samples), ``labels=labels`` (tokens: labels != ``ignore_index``) or ``weight=w.sum()``
        (a weighted mean; combine with ``count=`` to keep ``samples_seen``). A causal language
        model that shifts its labels inside (Hugging Face's ``AutoModelForCausalLM(...,
        labels=labels)``) predicts ``labels[..., 1:]``: pass ``labels=labels, shift=True``.
        ``backward`` runs the weighted loss's backward where a framework must do it itself
        (Lightning's ``module.manual_backward`` applies its precision plugin's loss scaling).
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss must be a scalar tensor, got {shape}; reduce it first "
                "(loss.mean() with reduction='mean', or loss.sum() with reduction='sum')"
            )
        if not loss.requires_grad:
            raise ValueError(
                "loss does not require grad: compute it from the model's output outside "
                "torch.no_grad(), with the model's parameters requiring grad"
            )
        self._check_grads_untouched("backward()")
        if self.epoch_length is not None and self._micro_in_epoch >= self.epoch_length:
            raise RuntimeError(
                f"micro-batch {self._micro_in_epoch + 1} of an epoch of epoch_length="
                f"{self.epoch_length}: end_epoch() was not called. Call acc.end_epoch() after "
                "each epoch (it settles the partial window and advances a micro_batches "
                "schedule), or loop with `for batch in acc.iterate(loader)`"
            )
        mb = resolve_count(
            count, labels=labels, ignore_index=ignore_index, shift=shift, weight=weight
        )
        work = loss if loss.dim() == 0 else loss.reshape(())
        if work.dtype not in (torch.float32, torch.float64):
            # Upcast, so multiplying a bf16/fp16 loss by a count does not round it.
            work = work.float()
        weight_now = self.record(mb, work.detach())
        weighted = work * (
            weight_now.to(work.dtype) if isinstance(weight_now, torch.Tensor) else weight_now
        )
        if self.scaler is not None:
            weighted = self.scaler.scale(weighted)
        if backward is not None:
            backward(weighted)
        else:
            weighted.backward()
        self._last_backward_synced = self._pending_sync
        self._pending_sync = True
        self._micro_in_epoch += 1
        self._grads_after_backward = [
            (p, p.grad, p.grad._version) for p in _params_of(self.optimizer) if p.grad is not None
        ]

    def _check_grads_untouched(self, where: str) -> None:
        for p, grad, version in self._grads_after_backward:
            if p.grad is grad and grad._version == version:
                continue
            what = (
                "cleared (set to None)"
                if p.grad is None
                else "replaced"
                if p.grad is not grad
                else "changed in place (zero_grad(set_to_none=False), clipping or unscaling?)"
            )
            raise RuntimeError(
                f"the window's gradients were {what} between backward() and {where}: that drops "
                f"the {self._micro_in_window} micro-batch(es) already in the window. Do not call "
                "optimizer.zero_grad() (or clip/unscale) inside a window: acc.step() clips, "
                "unscales and zeroes them once per window"
            )

    def record(self, mb: MicroBatchCount, loss: torch.Tensor | None = None) -> float | torch.Tensor:
        """Account for one micro-batch without running backward; return the factor its loss
        must be multiplied by before backward. :meth:`backward` and the optimizer wrapper use it.
        """
        if not self._checked_model and self.model is not None:
            warn_inexact_layers(self.model, stacklevel=4)
            self._checked_model = True
        self._check_window_open()
        c = _exact(mb.normaliser)
        if self._ref is None:
            self._ref = self._expected_count(c)
        factor = _ratio(c if self.reduction == "mean" else 1.0, self._ref)
        if loss is not None:
            self._losses.append(loss.detach())
            self._counts.append(c)
        self._window_count = self._window_count + c
        self._micro_in_window += 1
        self.micro_step += 1
        # Kept as tensors until read, so counting tokens never forces a device sync.
        self._samples_seen = self._samples_seen + mb.samples
        self._tokens_seen = self._tokens_seen + mb.tokens
        return factor

    def _check_window_open(self) -> None:
        if self.window_full:
            # Without this, a forgotten step() merges every following window into one update.
            raise RuntimeError(
                f"the window is full ({self._micro_in_window} micro-batches"
                + (
                    f", count {float(self._window_count):g} >= target_count {self.target_count:g}"
                    if self.target_count is not None
                    else ""
                )
                + "): call acc.step() when acc.window_full, before the next micro-batch's "
                "backward()"
            )

    def _expected_count(self, first: float | torch.Tensor) -> float | torch.Tensor:
        if bbdist.is_distributed(self.process_group):
            return 1.0
        if self.target_count is not None:
            return self.target_count
        n = self.micro_batches_per_window or 1
        if isinstance(first, torch.Tensor):
            return torch.clamp(first, min=1.0) * n
        return (first if first > 0 else 1.0) * n

    @property
    def samples_seen(self) -> int:
        """Samples backpropagated so far (over all windows, on this rank)."""
        return _as_int(self._samples_seen)

    @property
    def tokens_seen(self) -> int:
        """Tokens (labels != ignore_index) backpropagated so far, when counted from labels."""
        return _as_int(self._tokens_seen)

    # ------------------------------------------------------------------------ step
    def step(self) -> StepResult:
        """Normalise the window's gradient by its true count, unscale and clip it once, step the
        optimizer (and scheduler), then zero the gradients and open a new window.
        """
        if self._micro_in_window == 0:
            raise RuntimeError(
                "step() was called with no backward() since the last step: call "
                "acc.backward(loss, count=len(batch)) for each micro-batch, then acc.step() "
                "when acc.window_full"
            )
        result = self._step()
        if result is None:  # cannot happen: this rank has a window
            raise RuntimeError("internal error: a window with micro-batches did not step")
        return result

    def _step(self) -> StepResult | None:
        """One global window. Under DDP every rank calls this once per window, with its own
        part (possibly none, when it ran out of data); returns None when no rank had anything,
        which is how :meth:`end_epoch` knows every rank is done."""
        params = _params_of(self.optimizer)
        local = self._micro_in_window > 0
        self._check_grads_untouched("step()")
        if local and not any(p.grad is not None for p in params):
            raise RuntimeError(
                "the window's gradients were cleared before step(): do not call "
                "optimizer.zero_grad() inside a window; acc.step() zeroes them after stepping"
            )
        micro_batches = self._micro_in_window
        self._check_counts_not_negative()
        ref = float(self._ref) if self._ref is not None else 1.0
        distributed = bbdist.is_distributed(self.process_group)
        loss: float | Callable[[], float]
        synced = False
        if distributed:
            # One small all-reduce carries every rank's count, loss and sync state.
            device = _grad_device(params)
            window_loss = _loss_sum(self._losses, self._counts, self.reduction)
            synced_here = (
                local and self._last_backward_synced and bbdist.syncs_gradients(self.model)
            )
            totals = torch.tensor(
                [
                    float(self._window_count),
                    float(window_loss) if window_loss is not None else 0.0,
                    1.0 if local else 0.0,
                    1.0 if synced_here else 0.0,
                ],
                dtype=torch.float64,
                device=device,
            )
            bbdist.all_reduce_sum(totals, self.process_group)
            count, loss_total, n_local, n_synced = totals.tolist()
            if n_local == 0:
                return None  # no rank had a window: nothing to step
            world = bbdist.world_size(self.process_group)
            if 0 < n_synced < world:
                raise RuntimeError(
                    "ranks disagree on whether DDP synchronised this window's gradients: they ran "
                    "different numbers of micro-batches. Use Accumulator(..., sync='step'), which "
                    "synchronises once at step time and lets ranks run out of data at different times"
                )
            synced = n_synced == world
            if not synced and bbdist.is_fsdp(self.model):
                raise RuntimeError(
                    "this window ended before its last micro-batch synchronised FSDP2's sharded "
                    "gradients (a partial window): use Accumulator(..., sync='every') with FSDP2, "
                    "or windows that always fill"
                )
            loss = loss_total / count if count > 0 else math.nan
        else:
            count = float(self._window_count)
            # The optimizer wrapper is not told the losses: nan then.
            loss = partial(_mean_loss, self._losses, self._counts, self.reduction, count)

        if count <= 0 or not math.isfinite(count):
            warnings.warn(
                f"optimizer step {self.optimizer_step} skipped: the window's total count is "
                f"{count:g} (every label was padding/ignore_index, or every weight was zero); "
                "its gradient is discarded. Check the labels if this happens often.",
                EmptyWindowWarning,
                stacklevel=3,
            )
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_window()
            return StepResult(self.optimizer_step, micro_batches, count, None, True)

        if not distributed:
            factor = ref / count  # exactly 1.0 for a full window of equal micro-batches
        elif synced:
            # DDP (all-reduce) and FSDP2 (reduce-scatter) averaged the per-rank sums over world
            # size; undo that and divide by the count.
            factor = bbdist.world_size(self.process_group) * ref / count
        else:
            _all_reduce_grads(params, self.process_group)
            factor = ref / count
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if factor != 1.0:
            scale_grads_(params, factor)
        if self.scaler is None and not _grads_finite(params):
            # GradScaler skips such a step itself; without one, optimizer.step() would turn
            # every parameter into nan. After the all-reduce, so every rank skips alike.
            self._skip_non_finite()
            return StepResult(
                self.optimizer_step, micro_batches, count, None, True, _loss=loss, non_finite=True
            )

        grad_norm = None
        if self.clip_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm))

        skipped = False
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            # GradScaler lowers its scale exactly when it found inf/nan and skipped the step.
            skipped = self.scaler.get_scale() < scale_before
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not skipped:
            self.optimizer_step += 1
            if self.scheduler is not None:
                self.scheduler.step()
        self._reset_window()
        return StepResult(
            optimizer_step=self.optimizer_step,
            micro_batches=micro_batches,
            count=count,
            grad_norm=grad_norm,
            skipped=skipped,
            _loss=loss,
        )

    def _check_counts_not_negative(self) -> None:
        # Tensor counts are checked here, where the step reads them anyway, not per micro-batch
        # (which would wait for the device each time).
        first = next((c for c in self._counts if isinstance(c, torch.Tensor)), None)
        if first is None:
            return
        counts = torch.stack(
            [torch.as_tensor(c, dtype=first.dtype, device=first.device) for c in self._counts]
        )
        if bool((counts < 0).any()):
            raise ValueError(
                f"micro-batch {int((counts < 0).nonzero()[0]) + 1} of this window has a negative "
                "count or weight: counts are numbers of samples/tokens and weights are >= 0; "
                "pass count=len(batch), labels=labels or weight=w.sum() with w >= 0"
            )

    def _skip_non_finite(self) -> None:
        where = "a gradient (the losses were finite: an overflow in backward?)"
        bad = [i + 1 for i, x in enumerate(self._losses) if not bool(torch.isfinite(x).all())]
        if bad:
            where = "the loss of micro-batch " + ", ".join(map(str, bad[:5]))
            where += f" of {self._micro_in_window}"
        warnings.warn(
            f"optimizer step {self.optimizer_step} skipped: the window's gradient holds inf or "
            f"nan, from {where}. The weights are unchanged. Check that batch's inputs and "
            "labels, lower the learning rate, or use a GradScaler with fp16",
            NonFiniteGradientWarning,
            stacklevel=4,
        )
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()

    def discard_window(self) -> None:
        """Throw the open window away: zero its gradients and roll the counters back to its
        start (used to re-run the same samples after an out-of-memory error)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.micro_step, self._samples_seen, self._tokens_seen = self._window_start
        self._reset_window()

    def end_epoch(self) -> StepResult | None:
        """Settle the epoch's last, partial window by the ``last_window`` policy, then advance
        the epoch (which the ``micro_batches`` schedule follows). Returns the step, if one ran.

        Under DDP every rank must call it: a rank that ran out of data joins the others' steps
        (with nothing of its own, and the same update) until every rank has reached its end.
        """
        if self.last_window == "drop" and self._micro_in_window > 0:
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_window()
        result = None
        if not bbdist.is_distributed(self.process_group):
            if self._micro_in_window > 0 and self.last_window == "renorm":
                result = self.step()
        elif self.last_window != "carry" or self._micro_in_window == 0:
            while True:
                step = self._step()
                if step is None:
                    break
                result = step
        else:
            raise RuntimeError(
                "last_window='carry' cannot be used under DDP, where ranks must settle their "
                "windows together at the epoch's end: use 'renorm' or 'drop'"
            )
        self.epoch += 1
        self._micro_in_epoch = 0
        if self.window_full:
            # A carried window that the new epoch's (smaller) window size already fills.
            result = self.step()
        return result

    # -------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Counters and the open window, including its partial gradient, so a run resumed
        mid-window ends bit-identical to an uninterrupted one. Save the model, optimizer,
        scheduler and scaler beside it as usual. Safe for ``torch.load(weights_only=True)``.
        """
        params = _params_of(self.optimizer)
        open_window = self._micro_in_window > 0
        return {
            "version": 1,
            "micro_step": self.micro_step,
            "optimizer_step": self.optimizer_step,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "epoch": self.epoch,
            "micro_in_window": self._micro_in_window,
            "window_start": [_as_int(v) for v in self._window_start],
            "window_count": torch.as_tensor(self._window_count, dtype=torch.float64).cpu(),
            "window_losses": [loss.cpu() for loss in self._losses],
            "window_loss_counts": [
                torch.as_tensor(c, dtype=torch.float64).cpu() for c in self._counts
            ],
            "ref": None
            if self._ref is None
            else torch.as_tensor(self._ref, dtype=torch.float64).cpu(),
            "grads": [
                None if (p.grad is None or not open_window) else p.grad.detach().cpu().clone()
                for p in params
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (after loading the model and optimizer)."""
        if state.get("version") != 1:
            raise ValueError(f"unknown bigbatch Accumulator state version {state.get('version')!r}")
        params = _params_of(self.optimizer)
        grads = state["grads"]
        if len(grads) != len(params):
            raise ValueError(
                f"the saved window holds gradients for {len(grads)} parameters but the optimizer "
                f"has {len(params)}: load the state into an Accumulator built on the same optimizer"
            )
        self.micro_step = int(state["micro_step"])
        self.optimizer_step = int(state["optimizer_step"])
        self._samples_seen = int(state["samples_seen"])
        self._tokens_seen = int(state["tokens_seen"])
        self.epoch = int(state["epoch"])
        self._reset_window()
        start = state["window_start"]
        self._window_start = (int(start[0]), int(start[1]), int(start[2]))
        self._micro_in_window = int(state["micro_in_window"])
        self._window_count = float(state["window_count"])
        self._losses = [loss.clone() for loss in state["window_losses"]]
        self._counts = [float(c) for c in state["window_loss_counts"]]
        self._ref = None if state["ref"] is None else float(state["ref"])
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()


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


def _ratio(c: float | torch.Tensor, ref: float | torch.Tensor) -> float | torch.Tensor:
    if isinstance(c, torch.Tensor) or isinstance(ref, torch.Tensor):
        return torch.as_tensor(_exact(c)) / torch.as_tensor(_exact(ref))
    return float(c) / float(ref)


def _exact(x: float | torch.Tensor) -> float | torch.Tensor:
    """A count in float64 (float32 on MPS, which has no float64), so sums of counts stay exact."""
    if not isinstance(x, torch.Tensor):
        return float(x)
    return x.detach().to(torch.float32 if x.device.type == "mps" else torch.float64)


def _loss_sum(
    losses: list[torch.Tensor], counts: list[float | torch.Tensor], reduction: Reduction
) -> torch.Tensor | None:
    """Sum of a window's count-weighted losses, in float64 where the device has it."""
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


def _mean_loss(
    losses: list[torch.Tensor],
    counts: list[float | torch.Tensor],
    reduction: Reduction,
    count: float,
) -> float:
    total = _loss_sum(losses, counts, reduction)
    return math.nan if total is None else float(total) / count


def _as_int(x: int | float | torch.Tensor) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _grads_finite(params: list[torch.Tensor]) -> bool:
    """Whether every gradient is finite: one fused max-abs per (device, dtype) group (max-abs
    cannot overflow the way a sum or a 2-norm can in fp16), one sync for the step."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad._values() if p.grad.is_sparse else p.grad
            groups.setdefault((g.device, g.dtype), []).append(g)
    finite = [
        torch.stack(torch._foreach_norm(grads, math.inf)).isfinite().all()
        for grads in groups.values()
    ]
    return all(bool(f) for f in finite)


def _grad_device(params: list[torch.Tensor]) -> torch.device:
    return next((p.grad.device for p in params if p.grad is not None), params[0].device)


def _all_reduce_grads(params: list[torch.Tensor], group: Any) -> None:
    """Sum the gradients over ranks in one flat all-reduce. A rank without a gradient for a
    parameter (it ran out of data, or the parameter was unused) takes part with zeros."""
    trainable = [p for p in params if p.requires_grad]
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in trainable:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in groups.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        bbdist.all_reduce_sum(flat, group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
