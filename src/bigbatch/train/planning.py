"""The training command's micro-batch: fixed, or planned under ``budget=`` before any data is
loaded (the model runs once on fake tensors, so a model that cannot take the size fails in a
second)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from bigbatch.device import return_freed_cpu_memory, total_bytes
from bigbatch.memory.budget import format_bytes, parse_bytes
from bigbatch.memory.plan import (
    DoesNotFitError,
    batchnorm_on_one_sample,
    plan_under_budget,
    resolve_budget,
)
from bigbatch.memory.predict import check_forward, predict_peak
from bigbatch.memory.step import StepSpec
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.optim import PLAN_OPTIMIZER
from bigbatch.train.tasks import Placement, Task

__all__ = ["PlanChoice", "plan_for"]

Log = Callable[[str], None]


class PlanChoice(NamedTuple):
    """What the run trains with, and what it was predicted to need (plan.json records both
    beside the measured peak)."""

    micro_batch: int
    max_micro_batch: int  # the OOM back-off grows back up to this
    predicted_peak_bytes: int | None = None  # the step at micro_batch; None: not planned
    overhead_bytes: int | None = None  # the process's memory besides the step, as planned
    budget_bytes: int | None = None


def plan_for(
    cfg: TrainConfig,
    factory: Callable[[], nn.Module],
    device: torch.device,
    precision: str,
    log: Log,
    *,
    target: int | None = None,
    task: Task | None = None,
) -> PlanChoice:
    """The micro-batch (the configured one, or the planner's under the budget), the largest
    the back-off may grow to, and the prediction behind them.
    Either way the model runs once on fake tensors first, so a model that cannot take the input
    size fails here, in a second, not after the data is loaded and an epoch is half done. A fixed
    ``micro_batch`` with an explicit ``budget`` is checked against it. A task whose loss couples
    the samples holds the window's outputs and their gradients besides each step
    (``task.window_cache_bytes``): the plan leaves room for them. A task that gives an
    ``example_batch`` is planned on its own ``step``, else on the generic step of its input
    shape."""
    input_shape = task.input_shape() if task is not None else (3, cfg.size, cfg.size)
    step, batch = _task_step(task)

    def spec_at(b: int) -> StepSpec:
        return StepSpec(
            factory,
            input_shape,
            b,
            PLAN_OPTIMIZER[cfg.optimizer],
            precision,  # type: ignore[arg-type]
            device.type,
            step=step,
            batch=batch,
        )

    explicit_budget = cfg.budget.strip().lower() != "auto"
    try:
        if cfg.micro_batch and not explicit_budget:
            check_forward(spec_at(min(2, cfg.micro_batch)))
            log(f"micro-batch {cfg.micro_batch} (fixed; set budget= to have it checked)")
            return PlanChoice(cfg.micro_batch, cfg.micro_batch)
        plan = plan_under_budget(
            spec_at,
            target or cfg.batch,
            _budget(cfg, device),
            device=device.type,
            overhead=None if cfg.overhead == "auto" else parse_bytes(cfg.overhead, allow_zero=True),
            max_micro_batch=cfg.micro_batch or None,
            extra_bytes=_window_cache(task, target or cfg.batch, precision, log),
        )
        if plan.calibration_note:
            log(f"plan: {plan.calibration_note}")
    except DoesNotFitError as exc:
        raise ConfigError(str(exc)) from exc
    except ConfigError:
        raise
    except (RuntimeError, TypeError, ValueError) as exc:
        if batchnorm_on_one_sample(exc):
            raise ConfigError(
                f"BatchNorm cannot train on micro-batch 1 ({cfg.model_name} normalises a 1x1 "
                "feature map): set micro_batch >= 2, or freeze_bn=true"
            ) from exc
        raise ConfigError(
            f"{cfg.model_name} cannot train on inputs of {'x'.join(map(str, input_shape))}: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    if cfg.micro_batch:
        _check_fixed(cfg, plan, spec_at, log)
    else:
        log(f"plan: {plan.summary()}")
    if plan.return_freed_memory:
        _return_freed_memory(plan, log)
    micro = cfg.micro_batch or plan.micro_batch
    predicted = dict(plan.curve).get(micro) if cfg.micro_batch else plan.predicted_peak_bytes
    top = cfg.micro_batch or plan.max_micro_batch
    return PlanChoice(micro, top, predicted, plan.overhead_bytes, plan.budget_bytes)


def _budget(cfg: TrainConfig, device: torch.device) -> int:
    """``budget=`` in bytes; a ConfigError with the fix where it cannot hold on this device."""
    try:
        budget = resolve_budget(cfg.budget, device)
    except ValueError as exc:  # a card's name on a CPU run, say
        raise ConfigError(f"budget={cfg.budget}: {exc}") from None
    total = total_bytes(device)
    if cfg.budget.strip().lower() != "auto" and total is not None and budget > total:
        raise ConfigError(
            f"budget={cfg.budget} is more than all the memory this {device.type} has "
            f"({format_bytes(total)}): a plan for it would run out of memory; use "
            f"budget=auto (the free memory now) or at most {format_bytes(total)}"
        )
    return budget


def _task_step(task: Task | None) -> tuple[Any, Any]:
    """(step, batch) for :class:`StepSpec`: the task's own step on its example batches, where it
    gives them; made once, so that every micro-batch size's spec shares them (the planner
    caches its traces by step)."""
    if task is None or task.example_batch(1, "meta") is None:  # shapes only: nothing made
        return None, None

    def step(model: nn.Module, micro: Any) -> torch.Tensor:
        # On the device the planner made the batch on (the CPU while a CUDA step is traced);
        # the planner's autocast is around the step already.
        leaves = torch.utils._pytree.tree_flatten(micro)[0]
        first = next(t for t in leaves if isinstance(t, torch.Tensor))
        return task.step(model, micro, Placement(first.device))[0]

    return step, task.example_batch


def _window_cache(task: Task | None, window: int, precision: str, log: Log) -> int:
    """What a coupled window holds besides its steps (0 for a loss of per-sample terms)."""
    if task is None or not task.couples_samples:
        return 0
    need = int(task.window_cache_bytes(window, precision))
    log(
        f"plan: the {task.loss_name} loss couples the samples: {format_bytes(need)} held for "
        f"the window of {window} (its outputs, their gradient, the loss at the whole window)"
    )
    return need


def _return_freed_memory(plan: Any, log: Log) -> None:
    """The budget has no room for glibc's heap to grow past the prediction: have freed memory
    go back to the system from now on, or say that it cannot here."""
    growth = format_bytes(plan.heap_growth_bytes)
    if return_freed_cpu_memory():
        log(
            "plan: large CPU blocks now go back to the system when freed (glibc's heap could "
            f"grow {growth} past the prediction, which the budget has no room for; a CPU step "
            "is about a third slower this way)"
        )
    else:
        log(
            f"plan: warning: this C library's heap may grow up to {growth} past the prediction, "
            "which the budget has no room for: raise the budget or set a smaller micro_batch"
        )


def _check_fixed(cfg: TrainConfig, plan: Any, spec_at: Callable[[int], StepSpec], log: Log) -> None:
    """A fixed ``micro_batch`` with an explicit ``budget``: refused with the largest that fits."""
    # The plan predicted the fixed micro-batch already (its cap, tried first), unless a rank's
    # share of the batch under torchrun is smaller.
    needed = dict(plan.curve).get(cfg.micro_batch) or (
        predict_peak(spec_at(cfg.micro_batch), calibration=plan.calibration).planning_bytes
    )
    if plan.max_micro_batch < cfg.micro_batch:
        raise ConfigError(
            f"micro_batch={cfg.micro_batch} does not fit budget={cfg.budget}: it needs "
            f"{format_bytes(needed)} predicted of {format_bytes(plan.usable_bytes)} usable; "
            f"the largest micro-batch that fits is {plan.max_micro_batch}: set "
            f"micro_batch={plan.max_micro_batch}, or micro_batch=0 to let the planner choose"
        )
    log(
        f"micro-batch {cfg.micro_batch} (fixed) fits budget {cfg.budget}: "
        f"{format_bytes(needed)} predicted of {format_bytes(plan.usable_bytes)} usable"
    )
