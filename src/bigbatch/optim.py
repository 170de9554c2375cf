"""A drop-in optimizer wrapper for loops you cannot restructure.

Your loop keeps ``loss.backward(); optimizer.step(); optimizer.zero_grad()``; only the step
learns the micro-batch's count: ``optimizer.step(count=len(y))``. The real optimizer steps once
per window, on the count-weighted mean gradient, exactly as a big batch would.

It is a ``torch.optim.Optimizer`` sharing the wrapped optimizer's ``param_groups`` and
``state``, so torch's LR schedulers take it (``StepLR(wrapper, ...)``) and its ``state_dict``
saves the open window too. Attach a scheduler with ``scheduler=`` (or ``wrapper.scheduler =
sched``): it then steps once per optimizer step, never per micro-batch.

The price of not touching ``backward``: each micro-batch's gradient is folded into one extra
gradient-sized buffer (so 2x gradient memory while a window is open). The :class:`Accumulator`
weights the loss before backward instead and needs no buffer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from bigbatch.accumulate import Accumulator, LastWindow, Reduction, StepResult, _params_of
from bigbatch.counts import MicroBatchCount, resolve_count

__all__ = ["AccumulatingOptimizer"]


class AccumulatingOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that it steps once every ``micro_batches`` calls to :meth:`step`,
    on the exact big-batch gradient.

    >>> import torch, torch.nn.functional as F
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2)
    >>> opt.scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> for n in (3, 1):
    ...     x, y = torch.randn(n, 4), torch.zeros(n, dtype=torch.long)
    ...     F.cross_entropy(model(x), y).backward()
    ...     result = opt.step(count=n)   # the only change to the loop: say the count
    ...     opt.zero_grad()
    >>> opt.optimizer_step, opt.param_groups[0]["lr"]
    (1, 0.05)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        micro_batches: int | Mapping[int, int],
        *,
        scheduler: Any = None,
        clip_grad_norm: float | None = None,
        reduction: Reduction = "mean",
        last_window: LastWindow = "renorm",
    ) -> None:
        if isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError("this optimizer is already an AccumulatingOptimizer: wrap it once")
        self.accumulator = Accumulator(
            optimizer,
            micro_batches=micro_batches,
            reduction=reduction,
            last_window=last_window,
            scheduler=scheduler,
            clip_grad_norm=clip_grad_norm,
        )
        # Optimizer's own set-up (hooks, profiling of step), then share the wrapped optimizer's
        # groups and state: an LR scheduler built on the wrapper moves the real learning rate.
        super().__init__([p for g in optimizer.param_groups for p in g["params"]], {})
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._stash: dict[torch.Tensor, torch.Tensor] = {}
        self._warned_no_count = False

    @property
    def scheduler(self) -> Any:
        """The LR scheduler stepped once per optimizer step (settable after construction, for a
        scheduler built on this wrapper)."""
        return self.accumulator.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:
        self.accumulator.scheduler = scheduler

    @property
    def optimizer_step(self) -> int:
        return self.accumulator.optimizer_step

    @property
    def micro_step(self) -> int:
        return self.accumulator.micro_step

    @property
    def samples_seen(self) -> int:
        return self.accumulator.samples_seen

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "optimizer"):  # Optimizer.__init__ builds throw-away groups
            super().add_param_group(param_group)
            return
        self.optimizer.add_param_group(param_group)

    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        *,
        count: int | torch.Tensor | MicroBatchCount | None = None,
        labels: torch.Tensor | None = None,
        ignore_index: int = -100,
        shift: bool = False,
        weight: float | torch.Tensor | None = None,
        loss: torch.Tensor | None = None,
    ) -> StepResult | None:
        """Fold this micro-batch's gradient into the window; step the real optimizer when the
        window is full. Returns the :class:`StepResult` when it stepped, else None.

        Give the count as you would to :meth:`Accumulator.backward`; ``loss`` (optional) makes
        the result carry the exact window mean loss.
        """
        if closure is not None:
            raise TypeError(
                "AccumulatingOptimizer does not take a closure (LBFGS-style optimizers re-evaluate "
                "the loss, which accumulation cannot do); call step(count=...) after backward()"
            )
        if count is None and labels is None and weight is None:
            if not self._warned_no_count:
                warnings.warn(
                    "AccumulatingOptimizer.step() without count= weights every micro-batch "
                    "equally, which is exact only when they all have the same size; pass "
                    "step(count=len(batch)) (or labels=/weight=)",
                    UserWarning,
                    stacklevel=2,
                )
                self._warned_no_count = True
            count = 1
        mb = resolve_count(
            count, labels=labels, ignore_index=ignore_index, shift=shift, weight=weight
        )
        grads = [p for p in _params_of(self.optimizer) if p.grad is not None]
        if not grads:
            raise RuntimeError(
                "step() found no gradients: call loss.backward() before optimizer.step(count=...)"
            )
        factor = self.accumulator.add_micro_batch(mb, loss)
        for p in grads:
            g = cast(torch.Tensor, p.grad)  # grads holds only parameters with a gradient
            if p in self._stash:
                self._stash[p].add_(g * factor)
            else:
                self._stash[p] = g.mul_(factor)  # reuse the first gradient as the buffer
            p.grad = None
        if self.accumulator.window_full:
            return self._finish_window()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the micro-batch's gradients (the window's sum lives in the wrapper)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def end_epoch(self) -> StepResult | None:
        """Settle the last partial window by ``last_window`` (see :class:`Accumulator`)."""
        if self.accumulator.micro_in_window > 0 and self.accumulator.last_window == "renorm":
            self._restore_stash()
        elif self.accumulator.last_window == "drop":
            self._stash.clear()
        return self.accumulator.end_epoch()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, plus (under ``"bigbatch"``) the counters and the open
        window's summed gradient: save it at any micro-batch, resume bit-identically. Loads with
        ``torch.load(..., weights_only=True)``."""
        state = self.optimizer.state_dict()
        window = self.accumulator.state_dict()
        window["grads"] = [
            None if p not in self._stash else self._stash[p].detach().cpu().clone()
            for p in _params_of(self.optimizer)
        ]
        state["bigbatch"] = window
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        window = state.pop("bigbatch", None)
        self.optimizer.load_state_dict(state)
        self._stash = {}
        if window is not None:
            self.accumulator.load_state_dict(window)
            for p in _params_of(self.optimizer):  # the window's sum lives in the stash
                if p.grad is not None:
                    self._stash[p] = p.grad
                    p.grad = None

    def _restore_stash(self) -> None:
        for p, g in self._stash.items():
            p.grad = g
        self._stash = {}

    def _finish_window(self) -> StepResult:
        self._restore_stash()
        return self.accumulator.step()
