"""Recover from out-of-memory at run time without changing the update.

A window is the batch you hand to :func:`run_window`. It is split into micro-batches of the
current size; on OOM the partial window is discarded, memory freed, the micro-batch halved and
the *same samples* re-run from the window's start. Because the Accumulator normalises by the true
count, the update is the same whatever the split: backing off is free. After ``grow_after``
clean windows it tries to grow back. Every change is logged (logger ``bigbatch``) and kept in
``OOMBackoff.events``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bigbatch import distributed as bbdist
from bigbatch.accumulate import Accumulator, StepResult
from bigbatch.batching import batch_len, split_batch
from bigbatch.coupled import cached_backward
from bigbatch.device import free_memory, onednn_stuck
from bigbatch.memory.oom import HOST_OOM_MESSAGES, ONEDNN_OOM_MESSAGE, is_oom

__all__ = [
    "BackoffEvent",
    "EvalBackoff",
    "OOMBackoff",
    "OneDNNStuckError",
    "OutOfMemoryAtMinimumError",
    "infer_fitting",
    "run_coupled_window",
    "run_window",
]

log = logging.getLogger("bigbatch")


class OutOfMemoryAtMinimumError(RuntimeError):
    """Out of memory even at the smallest micro-batch; its message says what to try.

    >>> OOMBackoff(micro_batch=1).shrink(0, "CUDA out of memory")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    bigbatch.backoff.OutOfMemoryAtMinimumError: out of memory even at micro-batch 1: ...
    """


class OneDNNStuckError(OutOfMemoryAtMinimumError):
    """After an out-of-memory error, oneDNN cannot build CPU kernels in this process any more
    (:func:`bigbatch.device.onednn_stuck`): no micro-batch of a new size can run here; a new
    process can. Its message says how to go on from the last checkpoint.

    >>> issubclass(OneDNNStuckError, OutOfMemoryAtMinimumError)  # caught where that is
    True
    """


def _check_onednn(failure: str, size: int, what: str) -> None:
    """Raise :class:`OneDNNStuckError` when ``failure`` (an OOM's text, its memory freed) left
    oneDNN unable to build kernels: halving further would only fail again at every size."""
    if ONEDNN_OOM_MESSAGE in failure and onednn_stuck():
        raise OneDNNStuckError(
            f"out of memory at {what} {size}, and oneDNN can no longer build CPU kernels in "
            "this process (an allocation failed while it wrote one, and oneDNN never clears "
            "that error), so no smaller size can run here. Start a new process at "
            f"{size // 2 or 1} (bigbatch train: the same command with `--resume RUN_DIR "
            f"micro_batch={size // 2 or 1}` continues from the last checkpoint), or give it "
            "more memory"
        )


@dataclass(frozen=True)
class BackoffEvent:
    optimizer_step: int  # the window (optimizer step about to be taken) where it happened
    old: int
    new: int
    reason: str  # "oom", "grow", or "measured" (the step's measured memory after the first steps)


@dataclass
class OOMBackoff:
    """The current micro-batch size and the rules for changing it.

    ``micro_batch`` starts at your (or the planner's) choice; ``max_micro_batch`` caps growing
    back (default: the starting size); ``grow_after`` clean windows trigger a try at double the
    size (0 disables growing); each OOM after a grow doubles the wait, so it cannot flap.
    :func:`run_window` calls it; the update is the same at every size.

    >>> backoff = OOMBackoff(micro_batch=32, grow_after=2)
    >>> backoff.shrink(optimizer_step=5, detail="CUDA out of memory")
    16
    >>> backoff.window_done(6); backoff.window_done(7)
    >>> backoff.micro_batch, [event.reason for event in backoff.events]
    (32, ['oom', 'grow'])
    """

    micro_batch: int
    max_micro_batch: int | None = None
    grow_after: int = 100
    min_micro_batch: int = 1
    events: list[BackoffEvent] = field(default_factory=list)
    clean_windows: int = 0

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.min_micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if self.max_micro_batch is None:
            self.max_micro_batch = self.micro_batch

    def shrink(self, optimizer_step: int, detail: str) -> int:
        if self.micro_batch <= self.min_micro_batch:
            raise OutOfMemoryAtMinimumError(
                f"out of memory even at micro-batch {self.micro_batch}: one step of "
                f"{self.micro_batch} sample(s) does not fit ({detail.strip()[:300]}). Try bf16, an "
                "optimizer without state (SGD), activation checkpointing or a smaller input; "
                "`bigbatch plan` shows what the floor is made of"
            )
        new = max(self.min_micro_batch, self.micro_batch // 2)
        self._change(optimizer_step, new, "oom")
        if self.events[-2:-1] and self.events[-2].reason == "grow":
            self.grow_after *= 2  # the last grow did not fit: wait longer before the next
        return new

    def window_done(self, optimizer_step: int) -> None:
        self.clean_windows += 1
        cap = self.max_micro_batch or self.micro_batch
        if self.grow_after and self.clean_windows >= self.grow_after and self.micro_batch < cap:
            self._change(optimizer_step, min(cap, self.micro_batch * 2), "grow")

    def refit(self, optimizer_step: int, new: int) -> None:
        """Change to ``new`` because the step's measured memory says it fits (or that the
        current size does not): never above it again after a shrink, up to it after a grow."""
        if new == self.micro_batch:
            return
        self.max_micro_batch = (
            new if new < self.micro_batch else max(new, self.max_micro_batch or 0)
        )
        self._change(optimizer_step, max(new, self.min_micro_batch), "measured")

    def _change(self, optimizer_step: int, new: int, reason: str) -> None:
        event = BackoffEvent(optimizer_step, self.micro_batch, new, reason)
        self.events.append(event)
        log.warning(
            "bigbatch: micro-batch %d -> %d (%s) at optimizer step %d; the update is unchanged",
            event.old,
            event.new,
            {"oom": "out of memory", "measured": "measured memory"}.get(
                reason, f"{self.clean_windows} clean windows"
            ),
            optimizer_step,
        )
        self.micro_batch = new
        self.clean_windows = 0


def run_window(
    acc: Accumulator,
    batch: Any,
    loss_fn: Callable[[Any], torch.Tensor | tuple[torch.Tensor, Any]],
    backoff: OOMBackoff,
    *,
    count_fn: Callable[[Any], dict[str, Any]] | None = None,
    split: Callable[[Any, int, int], list[Any]] | None = None,
    device: torch.device | str = "cpu",
    model: torch.nn.Module | None = None,
) -> StepResult:
    """Train one window on ``batch`` (all its samples), in micro-batches that fit, then step.

    ``loss_fn(micro_batch)`` runs the forward pass and returns the loss (a mean by default), or
    ``(loss, count)`` when it knows the micro-batch's count; else ``count_fn(micro_batch)``
    returns the count keywords for :meth:`Accumulator.backward` (default
    ``{"count": len(micro_batch)}``; ``{"labels": ...}`` for tokens). ``split(batch, size,
    min_size)`` cuts the window into micro-batches (default
    :func:`~bigbatch.batching.split_batch`; a batch of per-sample target lists needs its own).
    ``model`` (default: the Accumulator's): its buffers are put back as they were at the
    window's start before an OOM's retry, since the failed micro-batches' forward passes have
    already moved BatchNorm's running statistics.

    >>> import torch, torch.nn.functional as F
    >>> model = torch.nn.Linear(4, 2)
    >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> backoff = OOMBackoff(micro_batch=8)
    >>> window = (torch.randn(20, 4), torch.randint(0, 2, (20,)))
    >>> run_window(acc, window, lambda b: F.cross_entropy(model(b[0]), b[1]), backoff).count
    20.0
    """
    counts = count_fn or (lambda micro: {"count": batch_len(micro)})
    cut = split or (lambda window, size, min_size: split_batch(window, size, min_size=min_size))

    def backward_all(micro_batch: int) -> None:
        parts = list(cut(batch, micro_batch, backoff.min_micro_batch))
        # Weighed against the whole window: equal micro-batches then need no rescaling pass.
        acc.window.plan(len(parts))
        for micro in parts:
            # No collective runs inside a micro-batch (sync='step'), so ranks can fail apart.
            with acc.no_sync():
                out = loss_fn(micro)
                if isinstance(out, tuple):
                    acc.backward(out[0], count=out[1])
                else:
                    acc.backward(out, **counts(micro))

    return _step_fitting(acc, backoff, device, backward_all, "run_window", model)


def run_coupled_window(
    acc: Accumulator,
    batch: tuple[Any, torch.Tensor],
    encode: Callable[[Any], torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    backoff: OOMBackoff,
    *,
    device: torch.device | str = "cpu",
    model: torch.nn.Module | None = None,
) -> StepResult:
    """:func:`run_window` for a loss that couples the samples (a batch Dice, a contrastive loss):
    ``batch`` is ``(inputs, targets)``; ``loss_fn(outputs, targets)`` runs once on the whole
    window's outputs, through :func:`bigbatch.coupled.cached_backward`, so the gradient is the
    big batch's whatever the micro-batch, and an OOM shrinks the micro-batch as for any loss.

    >>> import torch
    >>> model = torch.nn.Linear(4, 3)
    >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> def batch_mse(out, y): return ((out.sum(0) - y.sum(0)) ** 2).mean()  # couples the rows
    >>> window = (torch.randn(10, 4), torch.randn(10, 3))
    >>> run_coupled_window(acc, window, model, batch_mse, OOMBackoff(micro_batch=4)).count
    10.0
    """
    inputs, targets = batch

    def backward_all(micro_batch: int) -> None:
        parts = split_batch(inputs, micro_batch, min_size=backoff.min_micro_batch)
        with acc.no_sync():
            cached_backward(acc, encode, loss_fn, list(parts), targets=targets)

    return _step_fitting(acc, backoff, device, backward_all, "run_coupled_window", model)


class _Buffers:
    """A module's buffers (BatchNorm's running statistics and counts) at a window's start, kept
    to put back before an OOM's retry: the same samples then move them as a run without the
    OOM would. A copy per window, tiny beside the activations (resnet50: 0.2 MiB)."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.live = [b for b in model.buffers() if b is not None] if model is not None else []
        self.saved = [b.detach().clone() for b in self.live]

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in zip(self.live, self.saved, strict=True):
                live.copy_(saved)


def _step_or_oom(acc: Accumulator) -> tuple[str, bool, StepResult | None]:
    """``acc.step()``; an OOM while the optimizer creates its state (Adam's two copies of the
    weights, on its first step) is returned as a failure to back off from, with the state it
    had begun to create removed. No weight has changed then: torch's optimizers create every
    parameter's state before they update any. Elsewhere (an update half done, under DDP, with
    a GradScaler that has unscaled) it is raised."""
    params = [p for group in acc.optimizer.param_groups for p in group["params"]]
    had_state = {id(p) for p in params if acc.optimizer.state.get(p)}
    try:
        return "", False, acc.step()
    except Exception as exc:
        created = {id(p) for p in params if acc.optimizer.state.get(p)} - had_state
        creating = len(had_state) + len(created) < sum(p.grad is not None for p in params)
        if not is_oom(exc) or not creating or acc.scaler is not None or bbdist.is_distributed():
            raise
        failure = f"{type(exc).__name__} in the optimizer step: {exc}"
    for p in params:
        if id(p) in created:
            del acc.optimizer.state[p]
    return failure, any(m in failure for m in HOST_OOM_MESSAGES), None


def _step_fitting(
    acc: Accumulator,
    backoff: OOMBackoff,
    device: torch.device | str,
    backward_all: Callable[[int], None],
    name: str,
    model: torch.nn.Module | None = None,
) -> StepResult:
    """Run ``backward_all(micro_batch)`` for the window, halving the micro-batch on OOM (the
    same samples again, from the window's start), then step; an OOM while the optimizer
    creates its state backs off the same way (:func:`_step_or_oom`)."""
    if bbdist.is_ddp(acc.model) and acc.sync != "step":
        raise ValueError(
            f"under DDP {name} needs Accumulator(..., model=ddp_model, sync='step'): with "
            "DDP syncing inside backward, a rank that runs out of memory would leave the others "
            "waiting in that all-reduce forever"
        )
    buffers = _Buffers(model if model is not None else acc.model)
    while True:
        failure = ""
        host_oom = False  # the CPU allocator (not CUDA's or MPS's) ran out
        try:
            backward_all(backoff.micro_batch)
        except Exception as exc:
            if not is_oom(exc):
                raise
            failure = f"{type(exc).__name__}: {exc}"
            host_oom = any(m in failure for m in HOST_OOM_MESSAGES)
        # Every rank must agree, or one would wait forever in the others' all-reduce.
        if not bbdist.any_rank(bool(failure), device, acc.process_group):
            failure, host_oom, result = _step_or_oom(acc)
            if result is not None:
                backoff.window_done(acc.optimizer_step)
                return result
        # Leaving the except block dropped the exception and its traceback, which held the
        # failed micro-batch's activations; now they can be freed.
        acc.discard_window()
        buffers.restore()
        free_memory(host_oom)
        _check_onednn(failure, backoff.micro_batch, "micro-batch")
        backoff.shrink(acc.optimizer_step, failure or "another rank ran out of memory")


@dataclass
class EvalBackoff:
    """Evaluation's OOM back-off (:func:`infer_fitting`): ``chunk`` is the most samples one
    forward pass takes (None: whole batches); an OOM halves it, and it stays halved for the
    rest of the pass. No weight, statistic or metric depends on it: eval mode's outputs are
    each sample's own (up to the kernels' round-off at another batch size).

    >>> backoff = EvalBackoff(chunk=64)  # at most 64 samples a forward pass
    >>> infer_fitting(lambda x: x + 1, torch.zeros(100, 2), backoff).shape
    torch.Size([100, 2])
    """

    chunk: int | None = None
    events: list[BackoffEvent] = field(default_factory=list)


def infer_fitting(fn: Callable[[Any], torch.Tensor], x: Any, backoff: EvalBackoff) -> torch.Tensor:
    """``fn(x)`` without gradients (validation's or prediction's forward), in chunks of
    ``backoff.chunk`` samples joined along the first dimension; on OOM the chunk is halved and
    the batch run again (the failed outputs dropped first), down to one sample.

    >>> calls = []
    >>> def model(x):
    ...     calls.append(len(x))
    ...     if len(x) > 2:
    ...         raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    ...     return x * 2
    >>> backoff = EvalBackoff()
    >>> infer_fitting(model, torch.ones(5, 1), backoff).shape, backoff.chunk, calls
    (torch.Size([5, 1]), 2, [5, 2, 2, 1])
    """
    if not isinstance(x, torch.Tensor):  # a task's own structure: not split here
        return fn(x)
    while True:
        size = min(backoff.chunk or len(x), len(x))
        failure = ""
        try:
            if size >= len(x):
                return fn(x)
            return torch.cat([fn(part) for part in x.split(size)])
        except Exception as exc:
            if not is_oom(exc):
                raise
            failure = f"{type(exc).__name__}: {exc}"
        # Out of the except block: the exception and the frames holding the failed outputs
        # are gone, so their memory can go back before the retry.
        free_memory(any(m in failure for m in HOST_OOM_MESSAGES))
        _check_onednn(failure, size, "evaluation batch")
        if size <= 1:
            raise OutOfMemoryAtMinimumError(
                f"out of memory evaluating a single sample ({failure.strip()[:300]}); give the "
                "run a larger budget, or predict on a device with more memory (--device cpu)"
            )
        backoff.chunk = size // 2
        backoff.events.append(BackoffEvent(0, size, backoff.chunk, "oom"))
        log.warning(
            "bigbatch: evaluation batch %d -> %d (out of memory); the outputs are unchanged",
            size,
            backoff.chunk,
        )
