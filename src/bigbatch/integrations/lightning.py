"""Exact gradient accumulation inside Lightning's ``Trainer.fit``.

Lightning's ``accumulate_grad_batches=N`` backpropagates ``loss / N`` for each batch, so the
update is the big-batch update only when every batch has the same count and the epoch fills
its last window. This adapter keeps ``Trainer.fit`` and uses Lightning's manual optimisation,
the one place where Lightning lets the module decide how a loss becomes gradients:

.. code-block:: python

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False               # (1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            exact_backward(self, loss, count=len(y))          # (2) instead of `return loss`
            return loss

    trainer = L.Trainer(callbacks=[ExactAccumulation(4)])  # (3) instead of accumulate_grad_batches=4

:func:`exact_backward` weights the loss by its count and runs ``self.manual_backward`` (so
Lightning's precision plugin scales it under fp16); :class:`ExactAccumulation` steps the
optimizer through Lightning (``trainer.global_step`` counts optimizer steps, so ``max_steps``,
checkpointing and logging work as usual) once per window, normalised by the window's true count,
settles the last partial window at the epoch's end, steps schedulers per optimizer step
(``interval="step"``) or per epoch, clips once per window after fp16 unscaling, and under DDP
runs every micro-batch inside ``no_sync`` and all-reduces once per window.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from bigbatch.accumulate import Accumulator, LastWindow, Reduction, StepResult
from bigbatch.batchnorm import running_stats_kept
from bigbatch.counts import MicroBatchCount
from bigbatch.integrations import require

require("lightning.pytorch", "lightning")
from lightning.pytorch.callbacks import Callback  # noqa: E402

__all__ = ["ExactAccumulation", "exact_backward"]


class ExactAccumulation(Callback):
    """A ``Trainer`` callback that replaces ``accumulate_grad_batches`` with exact accumulation.

    ``micro_batches`` is an int or an ``{epoch: N}`` schedule, as ``accumulate_grad_batches``
    takes; or give ``target_count`` (samples or tokens per optimizer step). The module must use
    manual optimisation and call :func:`exact_backward` in ``training_step``.
    ``log_window_loss=True`` logs each window's exact mean loss as ``window_loss``;
    ``last_step`` holds the last :class:`bigbatch.StepResult`.

    >>> ExactAccumulation({0: 8, 4: 2}).micro_batches
    {0: 8, 4: 2}
    """

    def __init__(
        self,
        micro_batches: int | Mapping[int, int] | None = None,
        *,
        target_count: float | None = None,
        reduction: Reduction = "mean",
        last_window: LastWindow = "renorm",
        clip_grad_norm: float | None = None,
        log_window_loss: bool = False,
    ) -> None:
        if micro_batches is None and target_count is None:
            raise ValueError(
                "say how big a window is: ExactAccumulation(4) (micro-batches per optimizer "
                "step), ExactAccumulation({0: 8, 4: 2}) or ExactAccumulation(target_count=256)"
            )
        self.micro_batches = micro_batches
        self.target_count = target_count
        self.reduction: Reduction = reduction
        self.last_window: LastWindow = last_window
        self.clip_grad_norm = clip_grad_norm
        self.log_window_loss = log_window_loss
        self.accumulator: Accumulator | None = None
        self.last_step: StepResult | None = None
        self._ddp: torch.nn.Module | None = None
        self._no_sync = contextlib.ExitStack()
        self._stepped_in_batch = False
        self._micro_step_at_batch_start = 0
        # Set while this callback steps the optimizer: any other step (an optimizer.step() in
        # training_step) would update on a partial window.
        self._stepping = False
        self._step_hook: Any = None

    # ------------------------------------------------------------------ checks and setup
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if pl_module.automatic_optimization:
            raise RuntimeError(
                "ExactAccumulation needs manual optimisation, where the module decides how its "
                "loss becomes gradients: set `self.automatic_optimization = False` in your "
                "LightningModule's __init__ and call `exact_backward(self, loss, count=len(y))` "
                "in training_step"
            )
        if len(trainer.optimizers) != 1:
            raise RuntimeError(
                f"ExactAccumulation steps one optimizer; configure_optimizers returned "
                f"{len(trainer.optimizers)}"
            )
        ddp = trainer.strategy.model
        self._ddp = ddp if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else None
        if self._ddp is None and torch.distributed.is_initialized():
            raise RuntimeError(
                f"ExactAccumulation supports one process or strategy='ddp'/'ddp_spawn', not "
                f"{type(trainer.strategy).__name__}"
            )
        if self._step_hook is not None:
            self._step_hook.remove()
        self._step_hook = trainer.optimizers[0].register_step_pre_hook(self._check_step)
        self.accumulator = Accumulator(
            pl_module.optimizers(),  # Lightning's wrapper: its step() runs the precision plugin
            micro_batches=self.micro_batches,
            target_count=self.target_count,
            reduction=self.reduction,
            last_window=self.last_window,
            model=self._ddp if self._ddp is not None else pl_module,
            # Every micro-batch runs inside no_sync; one all-reduce per window at step time.
            sync="step",
        )

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _check_step(self, *_: Any) -> None:
        if not self._stepping:
            raise RuntimeError(
                "optimizer.step() was called in training_step, but ExactAccumulation steps the "
                "optimizer itself, once per window: remove optimizer.step() (and zero_grad()) "
                "from training_step and call only exact_backward(self, loss, count=len(y))"
            )

    # ------------------------------------------------------------------ per micro-batch
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stepped_in_batch = False
        self._micro_step_at_batch_start = self._acc().micro_step
        if self._ddp is not None:
            # DDP decides at forward time whether the backward all-reduces.
            self._no_sync.enter_context(self._acc().no_sync(self._ddp))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._no_sync.close()
        if self._acc().micro_step == self._micro_step_at_batch_start:
            raise RuntimeError(
                "training_step did not call exact_backward(self, loss, count=len(y)): with "
                "ExactAccumulation nothing else makes gradients or steps the optimizer. Call it "
                "in training_step instead of `return loss` or self.manual_backward(loss)"
            )
        if self.log_window_loss and self._stepped_in_batch and self.last_step is not None:
            # The exact window mean loss (count-weighted), as "window_loss"; reading it waits
            # for the device, so it is off unless asked for.
            pl_module.log("window_loss", self.last_step.loss, prog_bar=True, on_step=True)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Called by Lightning after fp16 unscaling: the window's normalised, true gradient.
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(pl_module.parameters(), self.clip_grad_norm)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._no_sync.close()
        if self._acc().epoch == trainer.current_epoch:
            # Not settled in the epoch's last batch (its end was not known then). Lightning
            # counts an optimizer step only inside its manual-optimisation loop: enter it.
            manual = trainer.fit_loop.epoch_loop.manual_optimization
            manual.on_run_start()
            try:
                self._settle(trainer, self._acc().end_epoch)
            finally:
                manual.on_run_end()
        for config in trainer.lr_scheduler_configs:
            if config.interval != "epoch":
                continue
            if config.reduce_on_plateau:
                metric = trainer.callback_metrics.get(config.monitor)
                if metric is not None:
                    config.scheduler.step(metric)
            elif (trainer.current_epoch + 1) % config.frequency == 0:
                config.scheduler.step()

    # ------------------------------------------------------------------ stepping
    def _acc(self) -> Accumulator:
        if self.accumulator is None:
            raise RuntimeError(
                "ExactAccumulation is not set up: pass it to Trainer(callbacks=[...])"
            )
        return self.accumulator

    def _settle(self, trainer: Any, run: Any) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale_before = scaler.get_scale() if scaler is not None else None
        self._stepping = True
        try:
            result = run()
        finally:
            self._stepping = False
        if result is None:
            return
        # GradScaler lowers its scale exactly when it found inf/nan and skipped the step.
        skipped = scaler is not None and scaler.get_scale() < (scale_before or 0.0)
        self.last_step = result
        self._stepped_in_batch = True
        if skipped:
            return
        steps = self._acc().optimizer_step
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and steps % config.frequency == 0:
                config.scheduler.step()

    def _backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor, **count: Any) -> None:
        acc = self._acc()

        def backward(weighted: torch.Tensor) -> None:
            with running_stats_kept():  # a checkpointed model's recomputation
                pl_module.manual_backward(weighted)

        acc.backward(loss, backward=backward, **count)
        if acc.window_full:
            self._settle(trainer, acc.step)
        epoch_loop = trainer.fit_loop.epoch_loop
        if (
            epoch_loop.batch_progress.is_last_batch
            or epoch_loop.batch_idx + 1 >= trainer.num_training_batches
        ):
            # Settle the partial window now, inside the last batch, so that the epoch-end
            # validation and checkpoint see the epoch's last update.
            self._settle(trainer, acc.end_epoch)


def exact_backward(
    module: Any,
    loss: torch.Tensor,
    count: int | torch.Tensor | MicroBatchCount | None = None,
    *,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    weight: float | torch.Tensor | None = None,
) -> None:
    """Backpropagate one batch's loss inside ``training_step``, weighted by its true count, and
    step the optimizer when the window is full (see :class:`ExactAccumulation`). In a
    ``LightningModule`` with ``self.automatic_optimization = False``::

        def training_step(self, batch, batch_idx):
            x, y = batch
            exact_backward(self, F.cross_entropy(self(x), y), count=len(y))

    and ``L.Trainer(callbacks=[ExactAccumulation(4)])``.

    Say what the loss averages over as with :meth:`bigbatch.Accumulator.backward`:
    ``count=len(y)``, ``labels=labels`` (tokens), ``labels=labels, shift=True`` (a causal LM that
    shifts inside) or ``weight=w.sum()``.
    """
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        raise RuntimeError("exact_backward(self, loss, ...) runs inside training_step during fit")
    callbacks = [c for c in trainer.callbacks if isinstance(c, ExactAccumulation)]
    if len(callbacks) != 1:
        raise RuntimeError(
            "exact_backward needs exactly one ExactAccumulation callback: "
            "L.Trainer(callbacks=[ExactAccumulation(4)]) (found "
            f"{len(callbacks)})"
        )
    callbacks[0]._backward(
        trainer,
        module,
        loss,
        count=count,
        labels=labels,
        ignore_index=ignore_index,
        shift=shift,
        weight=weight,
    )
