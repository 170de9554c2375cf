"""The training command's micro-batch: fixed, or planned under ``budget=`` before any data is
loaded (the model runs once on fake tensors, so a model that cannot take the size fails in a
second)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from bigbatch.backoff import OOMBackoff
from bigbatch.device import (
    card_memory,
    measures_reserved,
    peak_memory_bytes,
    reset_peak_memory,
    return_freed_cpu_memory,
    total_bytes,
    uses_cudnn_benchmark,
)
from bigbatch.distributed import (
    ddp_bucket_bytes,
    is_distributed,
    maxima_over_ranks,
    rank_share,
    share_line,
)
from bigbatch.memory.budget import format_bytes, parse_bytes
from bigbatch.memory.evaluate import STATE_COPIES, plan_evaluation_batch, predict_evaluation_peak
from bigbatch.memory.measure import measure_step_reserved
from bigbatch.memory.meta import build_on_meta
from bigbatch.memory.oom import is_oom
from bigbatch.memory.plan import (
    DoesNotFitError,
    batchnorm_on_one_sample,
    default_overhead,
    limit_on_card,
    plan_under_budget,
    refit_micro_batch,
    resolve_budget,
    usable_bytes,
)
from bigbatch.memory.predict import check_forward, predict_peak
from bigbatch.memory.step import Precision, StepSpec
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.optim import plan_optimizer
from bigbatch.train.run_dir import add_to_plan, measured_as
from bigbatch.train.tasks import Placement, Task

__all__ = ["MemoryCheck", "PlanChoice", "model_factory_for", "plan_for", "plan_validation"]

Log = Callable[[str], None]


def model_factory_for(task: Task, cfg: TrainConfig) -> Callable[[], nn.Module]:
    """``task.model_factory()``, with activation checkpointing where ``cfg.grad_checkpointing``
    asks for it, by the model's library's switch or torch's checkpoint_wrapper around its
    blocks (:func:`~bigbatch.models.grad_checkpointed`): what the loop trains and the planner
    traces, alike. A model with neither is refused (ConfigError) when first built.

    >>> from bigbatch.train.config import load_config
    >>> cfg = load_config(overrides=["data=x", "arch=resnet18", "grad_checkpointing=true"])
    >>> import timm
    >>> from types import SimpleNamespace
    >>> task = SimpleNamespace(model_factory=lambda: lambda: timm.create_model("resnet18"))
    >>> model_factory_for(task, cfg)().grad_checkpointing
    True
    """
    from bigbatch.models import grad_checkpointed

    factory = task.model_factory()
    if not cfg.grad_checkpointing:
        return factory
    return grad_checkpointed(factory, refused=ConfigError, said="grad_checkpointing=true")


class PlanChoice(NamedTuple):
    """What the run trains with, and what it was predicted to need (plan.json records both
    beside the measured peak)."""

    micro_batch: int
    max_micro_batch: int  # the OOM back-off grows back up to this
    predicted_peak_bytes: int | None = None  # the step at micro_batch; None: not planned
    overhead_bytes: int | None = None  # the process's memory besides the step, as planned
    budget_bytes: int | None = None
    usable_bytes: int | None = None  # what the step may take: the budget less margin, overhead
    curve: tuple[tuple[int, int], ...] = ()  # the plan's (micro-batch, predicted peak) points
    valid_batch: int = 0  # validation's forward passes (plan_validation)
    valid_predicted_peak_bytes: int | None = None
    valid_shape: tuple[int, ...] | None = None  # the input validation was planned for
    planned: bool = False  # the planner chose micro_batch (a fixed one is never grown)
    measured: bool = False  # predicted_peak_bytes is a real step's, measured on the GPU
    # Held beside each step for the whole window (a coupled loss's cache, DDP's buckets): in
    # a measured peak, not in the curve's predictions, out of usable_bytes already.
    held_bytes: int = 0


def plan_for(
    cfg: TrainConfig,
    factory: Callable[[], nn.Module],
    device: torch.device,
    precision: str,
    log: Log,
    *,
    target: int | None = None,
    task: Task | None = None,
    measure: bool = False,
    world: int = 1,
) -> PlanChoice:
    """The micro-batch (the configured one, or the planner's under the budget), the largest
    the back-off may grow to, and the prediction behind them.
    Either way the model runs once on fake tensors first, so a model that cannot take the input
    size fails here, in a second, not after the data is loaded and an epoch is half done. A fixed
    ``micro_batch`` with an explicit ``budget`` is checked against it. A task whose loss couples
    the samples holds the window's outputs and their gradients besides each step
    (``task.window_cache_bytes``): the plan leaves room for them. A task that gives an
    ``example_batch`` is planned on its own ``step``, else on the generic step of its input
    shape. ``target`` is a rank's window: by default, over ``world`` > 1 ranks (DDP), its
    share of ``cfg.batch``, said first. Over ranks its gradient buckets are held too
    (:func:`~bigbatch.distributed.ddp_bucket_bytes`). With ``measure`` (a training run), on a
    CUDA device with ``budget=auto``, one process, no window cache: a real step of the whole
    target batch is measured on the GPU first (:func:`_measured_choice`), and where it fits no
    prediction is made."""
    if target is None and world > 1:
        log(share_line(cfg.batch, world))
    target = rank_share(cfg.batch, world) if target is None else target  # each rank's share
    input_shape = task.input_shape() if task is not None else (3, cfg.size, cfg.size)
    spec_at = _spec_maker(cfg, factory, device, precision, task, input_shape)
    explicit_budget = cfg.budget.strip().lower() != "auto"
    try:
        if cfg.micro_batch and not explicit_budget:
            check_forward(spec_at(min(2, cfg.micro_batch)))
            log(f"micro-batch {cfg.micro_batch} (fixed; set budget= to have it checked)")
            return PlanChoice(cfg.micro_batch, cfg.micro_batch)
        extra = _window_cache(task, target, precision, log)
        extra += _ddp_buckets(factory, world, log)
        if measure and not (extra or explicit_budget or cfg.micro_batch):
            measured = _measured_choice(cfg, spec_at(target), device, log)
            if measured is not None:
                return measured
        plan = plan_under_budget(
            spec_at,
            target,
            _budget(cfg, device),
            device=device.type,
            overhead=_given_overhead(cfg),
            max_micro_batch=cfg.micro_batch or None,
            extra_bytes=extra,
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
    else:  # the shape it was planned for: training's worst is its configured size or crop
        log(f"plan: {plan.summary()}; inputs of {'x'.join(map(str, input_shape))}")
    if plan.return_freed_memory:
        _return_freed_memory(plan, log)
    micro = cfg.micro_batch or plan.micro_batch
    predicted = dict(plan.curve).get(micro) if cfg.micro_batch else plan.predicted_peak_bytes
    top = cfg.micro_batch or plan.max_micro_batch
    curve = tuple(plan.curve)
    return PlanChoice(
        micro, top, predicted, plan.overhead_bytes, plan.budget_bytes, plan.usable_bytes, curve
    )._replace(planned=not cfg.micro_batch, held_bytes=extra)


def plan_validation(
    cfg: TrainConfig,
    factory: Callable[[], nn.Module],
    device: torch.device,
    precision: str,
    choice: PlanChoice,
    task: Task,
    valid_items: Any,
    log: Log,
) -> PlanChoice:
    """``choice`` with validation's batch: the largest whose no-grad step fits the same usable
    memory as training's (the weights, the optimizer state and an EMA copy alive meanwhile;
    :func:`~bigbatch.memory.evaluate.predict_evaluation_peak`), for the largest input
    validation meets (:meth:`Task.valid_shape`: whole images after training on crops, a whole
    volume's logits beside its patches), up to the target batch. Unplanned (a fixed
    micro-batch without a budget): twice the training micro-batch. An OOM still backs off."""
    shape = task.valid_shape(valid_items) if len(valid_items) else None
    unplanned = 2 * choice.micro_batch
    cap = (shape.largest if shape else None) or max(unplanned, cfg.batch)
    if shape is None or choice.usable_bytes is None:
        return choice._replace(valid_batch=min(cap, unplanned))
    optimizer, held = plan_optimizer(cfg.optimizer, device), shape.held_bytes
    copies = STATE_COPIES[optimizer] + (1 if cfg.ema else 0)

    def peak_at(b: int) -> int:
        spec = StepSpec(
            factory,
            shape.shape,
            b,
            optimizer,
            cast(Precision, precision),
            device.type,
            cudnn_benchmark=uses_cudnn_benchmark(cfg.cudnn_benchmark, device),
        )
        return predict_evaluation_peak(spec, state_copies=copies, held_bytes=held).planning_bytes

    try:
        plan = plan_evaluation_batch(peak_at, cap, choice.usable_bytes, shape.shape)
    except Exception as exc:  # an op fake tensors cannot run: training's plan stands
        log(
            f"plan: validation batch {min(cap, unplanned)}, not predicted "
            f"({type(exc).__name__}: {str(exc)[:160]}); an OOM there backs off"
        )
        return choice._replace(valid_batch=min(cap, unplanned))
    log(f"plan: {plan.summary()} ({shape.what})")
    return choice._replace(
        valid_batch=plan.batch,
        valid_predicted_peak_bytes=plan.predicted_peak_bytes,
        valid_shape=shape.shape,
    )


@dataclass
class MemoryCheck:
    """Measure, then adjust: after the run's first ``after_steps`` optimizer steps (the
    optimizer state exists, and a steady step has run beside it), the step's measured peak
    against its prediction. Over the usable memory (on a CPU: the process over the whole
    budget), the micro-batch shrinks now, before an OOM; far under the prediction (on a GPU),
    it grows toward what the measured ratio says fits
    (:func:`~bigbatch.memory.plan.refit_micro_batch`). The update is the same either way.
    ``plan.json`` gets the measurement (``first_steps``) and the log one line.

    In cuDNN's benchmark mode (``cudnn_benchmark``) the first step's trials take workspaces
    from whatever memory is free (and give it back), which a card's reserved peak counts; so
    the peak is measured from the first optimizer step on, over the steps after it."""

    choice: PlanChoice
    device: torch.device
    target: int  # the window's samples (a rank's share)
    log: Log
    run_dir: Path | None  # where plan.json is (the main rank's), else None
    after_steps: int = 2
    cudnn_benchmark: bool = False
    done: bool = field(default=False, init=False)
    _windows: int = field(default=0, init=False)  # seen by this run (a resumed one's too)

    def __post_init__(self) -> None:
        # Without a prediction or a resettable peak there is nothing to compare; a step measured
        # on the GPU at plan time was checked then.
        c = self.choice
        self.done = c.predicted_peak_bytes is None or not c.curve or c.usable_bytes is None
        self.done = self.done or c.measured
        if not self.done:
            self.done = not reset_peak_memory(self.device)

    def after_window(self, optimizer_step: int, backoff: OOMBackoff) -> None:
        self._windows += 1
        if not self.done and self.cudnn_benchmark and self._windows == 1:
            reset_peak_memory(self.device)  # the trials were this run's first step's
            return
        if self.done or optimizer_step < self.after_steps:
            return
        self.done = True
        measured = peak_memory_bytes(self.device)
        if measured is None:
            return
        # Under torchrun every rank refits to the same micro-batch: the largest peak, the most
        # held beside the allocator and any rank's back-off decide (collectives every rank makes).
        card = None if measured[1] else card_memory(self.device)
        agreed = [measured[0], card[1] if card else 0, len(backoff.events)]
        peak, outside, backoffs = maxima_over_ranks(agreed, self.device)
        card = None if card is None else (card[0], outside)
        if backoffs:
            return  # the OOM back-off has had its say already
        c, whole_process = self.choice, measured[1]
        if whole_process and not c.overhead_bytes:
            return  # overhead=0: the budget is the step's tensors alone, not the process's
        # What the measured peak holds beside the step the curve predicts: a CPU process's
        # overhead, and what the window holds (a coupled loss's cache, DDP's buckets), which
        # the plan kept out of the usable memory too.
        beside_step = ((c.overhead_bytes or 0) if whole_process else 0) + c.held_bytes
        # A CPU process holds data and libraries besides the step: only the whole budget is
        # its limit there, and the heap does not give back what a larger step would free. A
        # card's limit is the plan's, less what it holds outside the allocator beyond the plan.
        if whole_process:
            limit = (c.budget_bytes or 0) - beside_step
        else:
            usable, budget = int(c.usable_bytes or 0), c.budget_bytes or 0
            limit = limit_on_card(usable, budget, c.overhead_bytes or 0, card)
        new = refit_micro_batch(
            list(c.curve),
            backoff.micro_batch,
            peak - beside_step,
            limit,
            target=self.target,
            top=max(c.max_micro_batch, backoff.micro_batch),
            smallest=backoff.min_micro_batch,
            grow=c.planned and not whole_process,
        )
        self._record(
            optimizer_step,
            backoff.micro_batch,
            (peak, whole_process),
            limit + beside_step,
            new,
            card,
        )
        backoff.refit(optimizer_step, new)

    def _record(
        self,
        step: int,
        micro: int,
        measured: tuple[int, bool],
        limit: int,
        new: int,
        card: tuple[int, int] | None,
    ) -> None:
        c, (peak, whole_process) = self.choice, measured
        what = measured_as(whole_process)
        predicted = dict(c.curve).get(micro, c.predicted_peak_bytes or 0) + c.held_bytes
        if whole_process:
            predicted += c.overhead_bytes or 0
        action = "kept" if new == micro else f"{micro} -> {new}"
        # A step-only prediction (overhead=0) is not what a process's resident peak measures.
        of = " for the step alone" if whole_process and not c.overhead_bytes else ""
        # What the card holds beside the allocator (context, NCCL, other processes), against
        # the overhead the plan kept out: the one figure of the step no trace can predict.
        outside = ""
        if card is not None:
            outside = (
                f"; the card holds {format_bytes(card[1])} outside the allocator (planned "
                f"{format_bytes(c.overhead_bytes or 0)})"
            )
        self.log(
            f"memory: after {step} optimizer steps at micro-batch {micro}, measured "
            f"{format_bytes(peak)} ({what}), predicted {format_bytes(predicted)}{of}, limit "
            f"{format_bytes(limit)}{outside}: micro-batch {action}"
        )
        if self.run_dir is None:
            return
        first_steps = {
            "optimizer_steps": step,
            "micro_batch": micro,
            "measured_peak_bytes": peak,
            "measured": what,
            "predicted_peak_bytes": predicted,
            "limit_bytes": limit,
            "new_micro_batch": new,
        }
        if card is not None:
            first_steps["outside_allocator_bytes"] = card[1]
        add_to_plan(self.run_dir, {"first_steps": first_steps})


def _spec_maker(
    cfg: TrainConfig,
    factory: Callable[[], nn.Module],
    device: torch.device,
    precision: str,
    task: Task | None,
    input_shape: tuple[int, ...],
) -> Callable[[int], StepSpec]:
    """The run's training step at each micro-batch size, as the planner and the measurement
    take it."""
    step, batch = _task_step(task)

    def spec_at(b: int) -> StepSpec:
        return StepSpec(
            factory,
            input_shape,
            b,
            plan_optimizer(cfg.optimizer, device),
            cast(Precision, precision),
            device.type,
            step=step,
            batch=batch,
            cudnn_benchmark=uses_cudnn_benchmark(cfg.cudnn_benchmark, device),
        )

    return spec_at


def _measured_choice(
    cfg: TrainConfig, spec: StepSpec, device: torch.device, log: Log
) -> PlanChoice | None:
    """The whole target batch as one micro-batch, where a real step of it, measured on the GPU
    (:func:`~bigbatch.memory.measure.measure_step_reserved`), fits the usable memory: on a card
    with the memory for it, a second's steps (whose kernel choices and cuDNN trials training
    then reuses) instead of tracing the step on the CPU several times. None (predict instead)
    where there is no GPU here, under torchrun (each rank would measure its own figure), or
    where the step does not fit or runs out of memory."""
    if not measures_reserved(device) or is_distributed():
        return None
    budget, overhead = _budget(cfg, device), _given_overhead(cfg)
    if overhead is None:  # as plan_under_budget takes it
        overhead = default_overhead(cfg.budget, device)
    usable = usable_bytes(budget, overhead, device)
    t0 = time.perf_counter()
    try:
        reserved = measure_step_reserved(spec)
    except Exception as exc:
        if not is_oom(exc):
            raise
        reserved = None  # the exception (and the frames it holds) dropped before predicting
    b, seconds = spec.batch_size, time.perf_counter() - t0
    if reserved is None or reserved > usable:
        what = "ran out of memory" if reserved is None else f"took {format_bytes(reserved)}"
        log(
            f"plan: a real step of {b} {what} on the GPU ({format_bytes(usable)} usable): predicting"
        )
        return None
    log(
        f"plan: target batch {b} in one micro-batch, measured on the GPU in {seconds:.1f} s: "
        f"{format_bytes(reserved)} reserved of {format_bytes(usable)} usable (budget "
        f"{format_bytes(budget)}); inputs of {'x'.join(map(str, spec.input_shape))}"
    )
    curve = ((b, reserved),)
    return PlanChoice(b, b, reserved, overhead, budget, usable, curve, planned=True, measured=True)


def _given_overhead(cfg: TrainConfig) -> int | None:
    """``overhead=`` in bytes; None for ``auto`` (the planner's default for the device)."""
    return None if cfg.overhead == "auto" else parse_bytes(cfg.overhead, allow_zero=True)


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


def _ddp_buckets(factory: Callable[[], nn.Module], world: int, log: Log) -> int:
    """What DDP's buckets hold on each rank (0 on one process)."""
    if world <= 1:
        return 0
    need = ddp_bucket_bytes(build_on_meta(factory))  # the shapes alone: nothing allocated
    log(f"plan: DDP's gradient buckets hold {format_bytes(need)} on each rank beside the step")
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
        predict_peak(
            spec_at(cfg.micro_batch).in_window(plan.target_batch), calibration=plan.calibration
        ).planning_bytes
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
