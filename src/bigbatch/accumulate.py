"""Exact gradient accumulation for a plain PyTorch loop.

Each micro-batch's mean loss is weighted by its count before ``backward``; the summed gradient
is divided by the window's true total count once, at step time (over all ranks under DDP).
The update then equals the big-batch update whatever the micro-batch sizes, token counts,
partial last window or number of processes: the usual ``loss / N`` is right only when every
micro-batch has the same count.

Under DDP (``model=`` the DDP module, micro-batches run inside :meth:`Accumulator.no_sync`) the window's
count is summed over ranks and the gradients are synchronised once per window: with
``sync="last"`` by DDP itself during the last micro-batch's backward (overlapping
communication with compute; every rank must run the same number of micro-batches, as a
``DistributedSampler`` ensures), with ``sync="step"`` by one flat all-reduce at step time
(ranks may run out of data at different times, and OOM back-off cannot deadlock). FSDP2
(``fully_shard``) takes ``sync="last"`` (one reduce-scatter per window; unsharded gradients
are kept in between) or ``sync="every"`` (a reduce-scatter per micro-batch: less memory).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import nn

from bigbatch import distributed as bbdist
from bigbatch.batchnorm import running_stats_kept
from bigbatch.counts import MicroBatchCount, resolve_count
from bigbatch.inexact import warn_inexact_layers
from bigbatch.window import Reduction, Window

__all__ = [
    "Accumulator",
    "EmptyWindowWarning",
    "NonFiniteGradientWarning",
    "StepResult",
    "scale_grads_",
]

_MID_EPOCH = (
    "{} micro-batch(es) ran since the last end_epoch(): call acc.end_epoch() after a loop that "
    "does not use acc.iterate(loader)"
)
_CARRY_UNDER_DDP = (
    "last_window='carry' cannot be used under DDP, where ranks must settle their windows "
    "together at the epoch's end: use 'renorm' or 'drop'"
)
_EMPTY_STEP = (
    "step() was called with no backward() since the last step: call acc.backward(loss, "
    "count=len(batch)) for each micro-batch, then acc.step() when acc.window_full"
)

LastWindow = Literal["renorm", "drop", "carry"]
_LAST_WINDOW_POLICIES = ("renorm", "drop", "carry")


class EmptyWindowWarning(UserWarning):
    """A window's total count was zero (e.g. only padding): its step was skipped.

    >>> import warnings
    >>> with warnings.catch_warnings():  # make a skipped step fatal
    ...     warnings.simplefilter("error", EmptyWindowWarning)
    """


class NonFiniteGradientWarning(UserWarning):
    """A window's gradient held inf or nan (no GradScaler to catch it): its step was skipped.

    >>> import warnings
    >>> with warnings.catch_warnings():  # stop at the first one
    ...     warnings.simplefilter("error", NonFiniteGradientWarning)
    """


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did (returned by :meth:`Accumulator.step`).

    >>> model = torch.nn.Linear(3, 1)
    >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> for x in (torch.ones(2, 3), torch.ones(5, 3)):
    ...     acc.backward(model(x).pow(2).mean(), count=len(x))
    >>> result = acc.step()
    >>> result.optimizer_step, result.micro_batches, result.count, result.skipped
    (1, 2, 7.0, False)
    """

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
    :meth:`step` when your window ends (as :func:`bigbatch.run_window` does). ``reduction``
    says whether your loss is a mean (default) or a sum over its count. ``scheduler`` is stepped
    once per optimizer step (never on a skipped fp16 step); ``scaler`` is a
    ``torch.amp.GradScaler`` for fp16; ``clip_grad_norm`` clips the accumulated, unscaled,
    normalised gradient once per window.

    Under DDP and FSDP2 pass ``model=`` and ``sync=``: see the module's documentation.

    >>> import torch, torch.nn.functional as F
    >>> model = torch.nn.Linear(4, 2)
    >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2)
    >>> loader = [(torch.randn(3, 4), torch.tensor([0, 1, 0])), (torch.randn(1, 4), torch.tensor([1]))] * 2
    >>> for x, y in acc.iterate(loader):  # end_epoch() when the loader is exhausted
    ...     acc.backward(F.cross_entropy(model(x), y), count=len(y))
    ...     if acc.window_full:
    ...         _ = acc.step()
    >>> acc.optimizer_step, acc.samples_seen, acc.epoch
    (2, 8, 1)
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
        _check_options(optimizer, last_window, sync, model, epoch_length, clip_grad_norm, scheduler)
        self.window = Window(micro_batches, target_count, reduction)
        self.optimizer = optimizer
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
        self._micro_in_epoch = 0  # backward() calls since the last end_epoch()
        self._iterating = False  # inside iterate(): it calls end_epoch() itself

        self._checked_model = False
        self._sync = bbdist.SyncControl(model, sync, process_group)
        self._guard = GradGuard()
        self._reset_window()

    # ----------------------------------------------------------------- window state
    def _reset_window(self) -> None:
        # Counters at the window's start, for discard_window().
        self._window_start = (self.micro_step, self._samples_seen, self._tokens_seen)
        self.window.reset()
        self._sync.last_synced = True
        self._guard.clear()

    @property
    def epoch(self) -> int:
        """Epochs settled by :meth:`end_epoch` (a ``micro_batches`` schedule follows it)."""
        return self.window.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.window.epoch = epoch

    @property
    def target_count(self) -> float | None:
        """Samples/tokens per window, when windows are sized by count (the window's own)."""
        return None if self.window.target_count is None else float(self.window.target_count)

    @property
    def reduction(self) -> Reduction:
        return self.window.reduction

    @property
    def micro_in_window(self) -> int:
        """Micro-batches accumulated so far in the open window."""
        return self.window.micro

    @property
    def window_full(self) -> bool:
        """True when the open window has reached its size: time to call :meth:`step`."""
        return self.window.full

    @contextmanager
    def no_sync(
        self, model: nn.Module | None = None, *, count: int | None = None
    ) -> Iterator[None]:
        """Run a micro-batch's forward and backward inside this context: under DDP, gradients
        are synchronised only on the window's last micro-batch. A no-op on one process.

        A window that ends early (the last partial window of an epoch) is still exact: step()
        then all-reduces the unsynchronised gradients itself.
        """
        with self._sync.micro_batch(model, lambda: self.window.is_last(count)):
            yield

    def iterate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate over one epoch of ``loader`` and call :meth:`end_epoch` when it is exhausted,
        so the epoch's partial window is settled and a ``micro_batches`` schedule advances
        (the class's example uses it)."""
        if self._micro_in_epoch and not self._iterating:
            raise RuntimeError(_MID_EPOCH.format(self._micro_in_epoch))
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
        count: int | torch.Tensor | MicroBatchCount | None = None,
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
        The default one keeps BatchNorm's statistics through a checkpointed model's
        recomputation (:func:`~bigbatch.batchnorm.running_stats_kept`).
        """
        work = _scalar_loss(loss)
        self._guard.check("backward()", self.window.micro)
        _check_epoch_length(self._micro_in_epoch, self.epoch_length)
        mb = resolve_count(
            count, labels=labels, ignore_index=ignore_index, shift=shift, weight=weight
        )
        weight_now = self.add_micro_batch(mb, work.detach())
        weighted = work * (
            weight_now.to(work.dtype) if isinstance(weight_now, torch.Tensor) else weight_now
        )
        if self.scaler is not None:
            weighted = self.scaler.scale(weighted)
        with running_stats_kept() if backward is None else nullcontext():
            (backward or torch.Tensor.backward)(weighted)
        self._sync.after_backward()
        self._micro_in_epoch += 1
        self._guard.remember(_params_of(self.optimizer))

    def add_micro_batch(
        self, mb: MicroBatchCount, loss: torch.Tensor | None = None
    ) -> float | torch.Tensor:
        """Add one micro-batch's count (and detached loss) to the window without running
        backward, and return the factor its loss must be multiplied by before backward.
        :meth:`backward` and :class:`~bigbatch.optim.AccumulatingOptimizer` use it.
        """
        if not self._checked_model and self.model is not None:
            warn_inexact_layers(self.model, stacklevel=4)
            self._checked_model = True
        factor = self.window.add(mb, loss, shared_ref=self._sync.distributed)
        self.micro_step += 1
        # Kept as tensors until read, so counting tokens never forces a device sync.
        self._samples_seen = self._samples_seen + mb.samples
        self._tokens_seen = self._tokens_seen + mb.tokens
        return factor

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
        if self.window.micro == 0:
            raise RuntimeError(_EMPTY_STEP)
        result = self._step()
        if result is None:  # cannot happen: this rank has a window
            raise RuntimeError("internal error: a window with micro-batches did not step")
        return result

    def _step(self) -> StepResult | None:
        """One global window. Under DDP every rank calls this once per window, with its own
        part (possibly none, when it ran out of data); returns None when no rank had anything,
        which is how :meth:`end_epoch` knows every rank is done."""
        params = _params_of(self.optimizer)
        micro_batches = self.window.micro
        self._guard.check("step()", micro_batches, params)
        self.window.check_counts_not_negative()
        totals = self._sync.totals(self.window, params)
        if totals is None:
            return None  # no rank had a window: nothing to step
        count, ref, loss = totals
        if count <= 0 or not math.isfinite(count):
            _warn_empty(self.optimizer_step, count)
            self._discard()
            return StepResult(self.optimizer_step, micro_batches, count, None, True)
        # A disabled GradScaler checks and skips nothing: the step goes as without one.
        scaler = self.scaler if self.scaler is not None and self.scaler.is_enabled() else None
        finite, grad_norm = _finish_gradient(
            self.optimizer, params, scaler, ref / count, self.clip_grad_norm
        )
        if not finite and scaler is None:  # with a GradScaler: its routine skip, below
            _warn_non_finite(self.optimizer_step, self.window)
            self._discard()
            return StepResult(self.optimizer_step, micro_batches, count, None, True, loss, True)
        skipped = _step_optimizer(self.optimizer, scaler, finite)
        if not skipped:
            self.optimizer_step += 1
            if self.scheduler is not None:
                self.scheduler.step()
        self._reset_window()
        return StepResult(self.optimizer_step, micro_batches, count, grad_norm, skipped, loss)

    def _discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()

    def discard_window(self) -> None:
        """Throw the open window away: zero its gradients and roll the counters back to its
        start (used to re-run the same samples after an out-of-memory error)."""
        self.micro_step, self._samples_seen, self._tokens_seen = self._window_start
        self._discard()

    def end_epoch(self) -> StepResult | None:
        """Settle the epoch's last, partial window by the ``last_window`` policy, then advance
        the epoch (which the ``micro_batches`` schedule follows). Returns the step, if one ran.

        Under DDP every rank must call it: a rank that ran out of data joins the others' steps
        (with nothing of its own, and the same update) until every rank has reached its end.
        """
        if self.last_window == "drop" and self.window.micro > 0:
            self._discard()
        result = None
        if not self._sync.distributed:
            if self.window.micro > 0 and self.last_window == "renorm":
                result = self.step()
        elif self.last_window != "carry" or self.window.micro == 0:
            while True:
                step = self._step()
                if step is None:
                    break
                result = step
        else:
            raise RuntimeError(_CARRY_UNDER_DDP)
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
        return _state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (after loading the model and optimizer)."""
        _load_state_dict(self, state)


def _finish_gradient(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    scaler: Any,
    factor: float,
    clip_grad_norm: float | None,
) -> tuple[bool, float | None]:
    """Unscale (fp16), divide the window's summed gradient by its true count (``factor`` =
    the reference count the losses were weighted by / the true count) and clip it once.
    Returns (finite, the norm before clipping); a non-finite gradient is left unclipped.

    With an enabled GradScaler (the caller passes None for a disabled one) the check reads the
    still-scaled gradient, GradScaler's own check on the same values: it skips the step exactly
    when this says non-finite, so whether it skipped is known before the optimizer's step is
    queued, and nothing is read from the device after it (a read there would wait for the step
    and leave the GPU idle while the next one is queued)."""
    if scaler is not None:
        finite = _grads_finite(params)
        scaler.unscale_(optimizer)
    if factor != 1.0:  # exactly 1.0 for a full window of equal micro-batches
        scale_grads_(params, factor)
    if scaler is None:
        # GradScaler skips such a step itself; without one, optimizer.step() would turn every
        # parameter into nan. After the all-reduce, so every rank skips alike.
        finite = _grads_finite(params)
    if not finite:
        return False, None
    if clip_grad_norm is None:
        return True, None
    return True, float(torch.nn.utils.clip_grad_norm_(params, clip_grad_norm))


def _step_optimizer(optimizer: torch.optim.Optimizer, scaler: Any, finite: bool) -> bool:
    """Step the optimizer (through the scaler) and zero its gradients; True when fp16 skipped
    it, which GradScaler does exactly when the gradient was not ``finite``."""
    if scaler is None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return False
    scaler.step(optimizer)
    scaler.update()  # lowers the scale after a skipped step
    optimizer.zero_grad(set_to_none=True)
    return not finite


def _state_dict(acc: Accumulator) -> dict[str, Any]:
    open_window = acc.window.micro > 0
    return {
        "version": 1,
        "micro_step": acc.micro_step,
        "optimizer_step": acc.optimizer_step,
        "samples_seen": acc.samples_seen,
        "tokens_seen": acc.tokens_seen,
        "epoch": acc.epoch,
        "window_start": [_as_int(v) for v in acc._window_start],
        **acc.window.state_dict(),
        "grads": [
            None if (p.grad is None or not open_window) else p.grad.detach().cpu().clone()
            for p in _params_of(acc.optimizer)
        ],
    }


def _load_state_dict(acc: Accumulator, state: Mapping[str, Any]) -> None:
    if state.get("version") != 1:
        raise ValueError(f"unknown bigbatch Accumulator state version {state.get('version')!r}")
    params = _params_of(acc.optimizer)
    grads = state["grads"]
    if len(grads) != len(params):
        raise ValueError(
            f"the saved window holds gradients for {len(grads)} parameters but the optimizer "
            f"has {len(params)}: load the state into an Accumulator built on the same optimizer"
        )
    acc.micro_step = int(state["micro_step"])
    acc.optimizer_step = int(state["optimizer_step"])
    acc._samples_seen = int(state["samples_seen"])
    acc._tokens_seen = int(state["tokens_seen"])
    acc.epoch = int(state["epoch"])
    acc._reset_window()
    start = state["window_start"]
    acc._window_start = (int(start[0]), int(start[1]), int(start[2]))
    acc.window.load_state_dict(state)
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()


class GradGuard:
    """Each gradient as the last backward() left it, and its version counter: a gradient
    cleared, replaced or changed in place before the next backward() or step() (a zero_grad()
    left in the loop) would silently drop the window's earlier micro-batches. No copy, no sync."""

    def __init__(self) -> None:
        self._after_backward: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def clear(self) -> None:
        self._after_backward = []

    def remember(self, params: list[torch.Tensor]) -> None:
        self._after_backward = [(p, p.grad, p.grad._version) for p in params if p.grad is not None]

    def check(self, where: str, micro_in_window: int, params: Sequence[torch.Tensor] = ()) -> None:
        if micro_in_window and params and not any(p.grad is not None for p in params):
            raise RuntimeError(
                "the window's gradients were cleared before step(): do not call "
                "optimizer.zero_grad() inside a window; acc.step() zeroes them after stepping"
            )
        for p, grad, version in self._after_backward:
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
                f"the {micro_in_window} micro-batch(es) already in the window. Do not call "
                "optimizer.zero_grad() (or clip/unscale) inside a window: acc.step() clips, "
                "unscales and zeroes them once per window"
            )


def _check_options(
    optimizer: Any,
    last_window: str,
    sync: str,
    model: nn.Module | None,
    epoch_length: Any,
    clip_grad_norm: float | None,
    scheduler: Any,
) -> None:
    """The Accumulator's options, refused with the fix before any work."""
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
    if last_window not in _LAST_WINDOW_POLICIES:
        raise ValueError(f"last_window must be one of {_LAST_WINDOW_POLICIES}, got {last_window!r}")
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


def _scalar_loss(loss: Any) -> torch.Tensor:
    """The loss as a 0-d tensor that requires grad, upcast from bf16/fp16 (so multiplying it
    by a count does not round it); refused with the fix otherwise."""
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
    work = loss if loss.dim() == 0 else loss.reshape(())
    return work if work.dtype in (torch.float32, torch.float64) else work.float()


def _check_epoch_length(micro_in_epoch: int, epoch_length: int | None) -> None:
    if epoch_length is not None and micro_in_epoch >= epoch_length:
        raise RuntimeError(
            f"micro-batch {micro_in_epoch + 1} of an epoch of epoch_length={epoch_length}: "
            "end_epoch() was not called. Call acc.end_epoch() after each epoch (it settles the "
            "partial window and advances a micro_batches schedule), or loop with "
            "`for batch in acc.iterate(loader)`"
        )


def _warn_empty(optimizer_step: int, count: float) -> None:
    warnings.warn(
        f"optimizer step {optimizer_step} skipped: the window's total count is {count:g} (every "
        "label was padding/ignore_index, or every weight was zero); its gradient is discarded. "
        "Check the labels if this happens often.",
        EmptyWindowWarning,
        stacklevel=4,
    )


def _warn_non_finite(optimizer_step: int, window: Window) -> None:
    bad = window.non_finite_losses()
    where = (
        f"the loss of micro-batch {', '.join(map(str, bad[:5]))} of {window.micro}"
        if bad
        else "a gradient (the losses were finite: an overflow in backward?)"
    )
    warnings.warn(
        f"optimizer step {optimizer_step} skipped: the window's gradient holds inf or nan, from "
        f"{where}. The weights are unchanged. Check that batch's inputs and labels, lower the "
        "learning rate, or use a GradScaler with fp16",
        NonFiniteGradientWarning,
        stacklevel=4,
    )


def _as_int(x: int | float | torch.Tensor) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _grads_finite(params: list[torch.Tensor]) -> bool:
    """Whether every gradient is finite: one fused pass per (device, dtype) group, one sync for
    the step. The pass is GradScaler's own check (``_amp_foreach_non_finite_check_and_unscale_``)
    with an unscale by exactly 1.0, which leaves every gradient bit for bit as it was and cannot
    overflow (a sum or a 2-norm can, in fp16); on a CPU it is about 30x faster than the fused
    inf-norm, which stays the fallback where a backend lacks the check."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad._values() if p.grad.is_sparse else p.grad
            groups.setdefault((g.device, g.dtype), []).append(g)
    return all(bool(_group_finite(grads)) for grads in groups.values())


def _group_finite(grads: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool on the gradients' device: none of ``grads`` (one device and dtype) holds
    inf or nan."""
    device = grads[0].device
    # float32 whatever torch's default dtype is: the check takes no other. 0-d, as GradScaler's
    # own: FSDP2's DTensor gradients take a 0-d tensor as replicated (and warn on a 1-element one).
    found = torch.zeros((), dtype=torch.float32, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    except NotImplementedError:
        return torch.stack(torch._foreach_norm(grads, math.inf)).isfinite().all()
    return found == 0
