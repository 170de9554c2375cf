"""Exact gradient accumulation inside fastai's ``Learner.fit``.

fastai's ``GradientAccumulation(n_acc)`` weights each batch by its size but divides by the
configured ``n_acc``, not by what the window really held: a window that overshoots ``n_acc`` is
over-weighted, and the epoch's remainder never steps. :class:`ExactGradientAccumulation` is a
drop-in replacement:

.. code-block:: python

    learn = Learner(dls, model, loss_func=..., cbs=ExactGradientAccumulation(n_acc=64))
    learn.fit_one_cycle(5, 1e-3)

It weights each batch's loss by its count (samples, or tokens: labels != ``ignore_index``),
steps once the window holds ``n_acc`` items (or ``micro_batches`` batches) with the gradient
divided by the window's true count, and steps the epoch's last partial window too, before
validation. It runs before ``MixedPrecision`` (its loss scaling and unscaling are linear, so
they compose) and before ``GradientClip`` (which then clips the window's true gradient once).

On learning-rate schedules: fastai's ``ParamScheduler`` (``fit_one_cycle``, ``fit_flat_cos``)
sets the learning rate before every batch from the fraction of training done, and the step uses
the value set for the window's last batch. The schedule is thus sampled once per optimizer step
along the same curve over the same training, which is what it should be; nothing to change.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Literal

import torch

from bigbatch.accumulate import EmptyWindowWarning, Reduction, scale_grads_
from bigbatch.batchnorm import running_stats_kept
from bigbatch.counts import MicroBatchCount, resolve_count
from bigbatch.inexact import warn_inexact_layers
from bigbatch.integrations import require
from bigbatch.integrations._window import adapter_window

require("fastai", "fastai")
from fastai.callback.core import (  # noqa: E402
    Callback,
    CancelBatchException,
    CancelStepException,
)
from fastai.callback.fp16 import MixedPrecision  # noqa: E402
from fastai.callback.training import GradientAccumulation  # noqa: E402
from fastai.torch_core import find_bs  # noqa: E402

from bigbatch.memory.plan import plan_under_budget  # noqa: E402
from bigbatch.memory.step import StepSpec  # noqa: E402

__all__ = ["ExactGradientAccumulation", "plan_learner"]


class ExactGradientAccumulation(Callback):
    """Replace fastai's ``GradientAccumulation``: exact whatever the batch sizes and padding.

    Give ``n_acc`` (items per optimizer step, as fastai's callback takes) or ``micro_batches``
    (batches per step). ``count="samples"`` (default) or ``"tokens"`` (the first target's labels
    != ``ignore_index``; ``shift=True`` for a causal LM that shifts its labels inside). An
    activation-checkpointed model's recomputation in backward leaves BatchNorm's running
    statistics as the forward left them (:func:`~bigbatch.batchnorm.running_stats_kept`).

    >>> ExactGradientAccumulation(n_acc=64).window.target_count
    64
    """

    order, run_valid = MixedPrecision.order - 4, False

    def __init__(
        self,
        n_acc: int | None = None,
        *,
        micro_batches: int | None = None,
        count: Literal["samples", "tokens"] = "samples",
        ignore_index: int = -100,
        shift: bool = False,
        reduction: Reduction = "mean",
    ) -> None:
        if count not in ("samples", "tokens"):
            raise ValueError(f"count must be 'samples' or 'tokens', got {count!r}")
        if n_acc is not None and (
            isinstance(n_acc, bool) or not isinstance(n_acc, int | float) or not n_acc > 0
        ):
            raise ValueError(
                f"n_acc is the number of samples (or tokens) per optimizer step, > 0; got "
                f"{n_acc!r}: e.g. ExactGradientAccumulation(n_acc=64), or micro_batches=4 "
                "(batches per step)"
            )
        self.window = adapter_window(micro_batches, n_acc, reduction, count_name="n_acc")
        self.unit = count
        self.ignore_index = ignore_index
        self.shift = shift
        self.optimizer_step = 0
        self._settling = False
        self._kept = contextlib.ExitStack()

    def before_backward(self) -> None:
        # A checkpointed model's recomputation must not move BatchNorm's statistics again.
        self._kept.enter_context(running_stats_kept())

    def after_backward(self) -> None:
        self._kept.close()

    def before_fit(self) -> None:
        self._kept.close()  # one a failed fit's backward left open
        if any(isinstance(cb, GradientAccumulation) for cb in self.learn.cbs):
            # Both would cancel steps: fastai's until its own count, this one until the window
            # is full; together no update happens at all.
            raise RuntimeError(
                "ExactGradientAccumulation replaces fastai's GradientAccumulation; remove "
                "GradientAccumulation from the Learner's callbacks (learn.remove_cb"
                "(GradientAccumulation)) and keep ExactGradientAccumulation(n_acc=...)"
            )
        self.window.reset()
        self.optimizer_step = 0
        warn_inexact_layers(self.learn.model, stacklevel=2)

    def _count(self) -> MicroBatchCount:
        if self.unit == "samples":
            return resolve_count(int(find_bs(self.learn.yb)))
        labels = self.learn.yb[0]
        return resolve_count(labels=labels, ignore_index=self.ignore_index, shift=self.shift)

    def after_loss(self) -> None:
        if not self.learn.training or not len(self.learn.yb):
            return
        self.learn.loss_grad = self.learn.loss_grad * self.window.add(self._count())

    def before_step(self) -> None:
        if not self._settling and not self.window.full:
            raise CancelBatchException()  # keep the gradients: no step, no zero_grad
        factor = self.window.close()
        if factor is None:
            self._discard()
            raise CancelBatchException()
        scale_grads_(self._params(), factor)
        self.optimizer_step += 1

    def _discard(self) -> None:
        warnings.warn(
            "an optimizer step was skipped: the window's total count is 0 (every label was "
            "padding); its gradient is discarded",
            EmptyWindowWarning,
            stacklevel=3,
        )
        self.learn.opt.zero_grad()

    def after_train(self) -> None:
        if self.window.micro == 0:
            return
        if float(self.window.count) <= 0:
            self.window.reset()
            self._discard()
            return
        # The epoch's last, partial window: step it now, through the same events (so that
        # MixedPrecision unscales and GradientClip clips it), before validation runs.
        self._settling = True
        try:
            self.learn._with_events(self.learn._step, "step", CancelStepException)
            self.learn.opt.zero_grad()
        finally:
            self._settling = False

    def _params(self) -> list[torch.Tensor]:
        opt: Any = self.learn.opt
        return [p for group in opt.param_lists for p in group]


def plan_learner(
    learn: Any,
    target_batch: int,
    budget: str | int,
    *,
    device: str = "",
    overhead: int | None = None,
) -> Any:
    """Plan the micro-batch for a ``Learner`` under a memory budget, by prediction (no trial
    OOMs): the model, one sample's shape from the first training batch, the optimizer (Adam-
    like or SGD) and fastai's ``MixedPrecision`` if it is among the callbacks.

    Then rebuild the loaders with ``bs=plan.micro_batch`` and train with
    ``ExactGradientAccumulation(n_acc=target_batch)``. Returns a
    :class:`bigbatch.memory.plan.Plan` (``plan.summary()`` says why). ``overhead``: bytes the
    process holds besides the step (default: measured, as ``bigbatch plan`` does).
    ``device``: the kind planned for, by default the one the Learner's loaders put its batches
    on (fastai's ``default_device()``: a GPU where there is one). With a ``Learner`` already
    built::

        plan = plan_learner(learn, target_batch=256, budget="16GB")
        learn.dls = dblock.dataloaders(path, bs=plan.micro_batch)
        learn.fit_one_cycle(5, cbs=ExactGradientAccumulation(n_acc=256))
    """
    import copy

    xb = next(iter(learn.dls.train))[0]  # one batch: the sample shape and dtype
    if not isinstance(xb, torch.Tensor):
        raise TypeError(f"plan_learner plans models with one tensor input, got {type(xb).__name__}")
    device = device or xb.device.type  # where the Learner trains, not the CPU by default
    mp = next((cb for cb in learn.cbs if isinstance(cb, MixedPrecision)), None)
    precision = "fp32" if mp is None else ("bf16" if "bf16" in str(mp.amp_mode) else "fp16")
    optimizer = "sgd" if getattr(learn.opt_func, "__name__", "") == "SGD" else "adamw"
    model = learn.model

    def spec_at(b: int) -> StepSpec:
        return StepSpec(
            lambda: copy.deepcopy(model).to("meta"),
            tuple(xb.shape[1:]),
            b,
            optimizer=optimizer,
            precision=precision,  # type: ignore[arg-type]
            device=device,
            input_dtype=xb.dtype,
        )

    # By prediction alone, as documented: no real calibration steps on the user's Learner.
    return plan_under_budget(
        spec_at, target_batch, budget, device=device, overhead=overhead, calibrate=False
    )
