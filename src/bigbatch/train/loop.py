"""``bigbatch train``: data -> model -> plan -> exact accumulation with OOM back-off -> checkpoints.

A thin composition of the library: the planner picks micro-batch x accumulation for the target
batch, each window (one target batch) goes through :func:`~bigbatch.memory.oom.run_window`, and
every epoch ends with validation, atomic checkpoints, ``history.csv`` and a plot. A run folder
is resumable: finished epochs are never redone, and the resumed run ends with the same weights.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from bigbatch.accumulate import Accumulator, NonFiniteGradientWarning
from bigbatch.device import (
    auto_device,
    auto_precision,
    autocast_for,
    peak_memory_text,
    set_rng_state,
)
from bigbatch.inexact import find_inexact_layers, freeze_batchnorm
from bigbatch.io import FolderBusyError, atomic_write_text, lock_folder
from bigbatch.memory.budget import format_bytes, parse_bytes
from bigbatch.memory.oom import OOMBackoff, run_window
from bigbatch.memory.plan import (
    DoesNotFitError,
    device_total_bytes,
    plan_under_budget,
    resolve_budget,
)
from bigbatch.memory.predict import check_forward, predict_peak
from bigbatch.memory.step import StepSpec
from bigbatch.train.checkpoint import load_state, save_state, save_weights
from bigbatch.train.config import ConfigError, TrainConfig, check_device, config_from_json
from bigbatch.train.data import make_loader, windows_per_epoch
from bigbatch.train.report import plot_history, write_history
from bigbatch.train.tasks import Metrics, Task, lower_is_better, task_for

__all__ = [
    "TrainResult",
    "TrainingDiverged",
    "resolve_device",
    "resolve_threads",
    "train",
]

Log = Callable[[str], None]


@dataclass
class TrainResult:
    run_dir: Path
    best_metric: float
    history: list[dict[str, Any]] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)


def resolve_device(name: str, what: str = "device") -> torch.device:
    """``auto`` (cuda, then mps, then cpu), or a device this machine has (else ConfigError)."""
    if name != "auto":
        check_device(name, what)
        return torch.device(name)
    return auto_device()


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision != "auto":
        if precision == "fp16" and device.type == "cpu":
            raise ConfigError("precision=fp16 needs a GPU; on CPU use fp32 or bf16")
        return precision
    return auto_precision(device)


def _check_run_dir(run_dir: Path, cfg: TrainConfig, resume: bool) -> dict[str, Any] | None:
    """The saved state to resume from, or None for a fresh run; refuses to mix two configs."""
    saved_cfg = run_dir / "config.json"
    state_path = run_dir / "last.pt"
    if saved_cfg.exists():
        old = config_from_json(saved_cfg.read_text(), str(saved_cfg))
        diff = sorted(k for k, v in cfg.training_keys().items() if old.training_keys().get(k) != v)
        if diff:
            raise ConfigError(
                f"run folder {run_dir} already holds a run with a different config "
                f"({', '.join(f'{k}: {old.to_dict()[k]!r} -> {cfg.to_dict()[k]!r}' for k in diff[:5])}); "
                "choose another --out folder, or pass the same config to resume"
            )
        if not resume and state_path.exists():
            raise ConfigError(
                f"run folder {run_dir} already holds this run; pass --resume {run_dir} to continue it "
                "(finished epochs are kept), or choose another --out folder"
            )
    elif resume:
        raise ConfigError(f"--resume {run_dir}: no run there (config.json is missing)")
    if resume:
        # A kill during an atomic write leaves its temporary file (up to a checkpoint's size).
        for tmp in run_dir.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
    if not (resume and state_path.exists()):
        return None
    try:
        return load_state(state_path)
    except ValueError as exc:
        raise ConfigError(
            f"{exc}. To start this run again from epoch 1, delete {state_path} (best and last "
            ".safetensors stay); to keep it, restore the file"
        ) from exc


def _head_parameters(model: nn.Module) -> set[int]:
    getter = getattr(model, "get_classifier", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Module) or not list(head.parameters()):
        # Not a timm model: the last module with parameters is the head.
        head = [m for m in model.modules() if list(m.parameters(recurse=False))][-1]
    return {id(p) for p in head.parameters()}


def _phases(cfg: TrainConfig) -> list[tuple[str, int]]:
    if cfg.fine_tunes and cfg.freeze_epochs > 0:
        return [("frozen", cfg.freeze_epochs), ("unfrozen", cfg.epochs)]
    return [("all", cfg.epochs)]


def _make_optimizer(
    cfg: TrainConfig, model: nn.Module, phase: str, steps: int
) -> tuple[torch.optim.Optimizer, Any]:
    head = _head_parameters(model)
    for p in model.parameters():
        p.requires_grad_(phase != "frozen" or id(p) in head)
    params = [p for p in model.parameters() if p.requires_grad]
    lr = cfg.lr * (2.0 if phase == "frozen" else 1.0)  # the head alone takes a larger rate
    opt: torch.optim.Optimizer
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    sched: Any
    if cfg.schedule == "one_cycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(1, steps))
    elif cfg.schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    else:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    return opt, sched


# The planner's name for each training optimizer (their state is what differs).
PLAN_OPTIMIZER = {"adamw": "adamw", "sgd": "sgd_momentum"}


def plan_for(
    cfg: TrainConfig,
    factory: Callable[[], nn.Module],
    device: torch.device,
    precision: str,
    log: Log,
    *,
    target: int | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """(micro_batch, max_micro_batch): the configured one, or the planner's under the budget.
    Either way the model runs once on fake tensors first, so a model that cannot take the input
    size fails here, in a second, not after the data is loaded and an epoch is half done. A fixed
    ``micro_batch`` with an explicit ``budget`` is checked against it."""

    def spec_at(b: int) -> StepSpec:
        return StepSpec(
            factory,
            input_shape or (3, cfg.size, cfg.size),
            b,
            PLAN_OPTIMIZER[cfg.optimizer],
            precision,  # type: ignore[arg-type]
            device.type,
        )

    explicit_budget = cfg.budget.strip().lower() != "auto"
    try:
        if cfg.micro_batch and not explicit_budget:
            check_forward(spec_at(min(2, cfg.micro_batch)))
            log(f"micro-batch {cfg.micro_batch} (fixed; set budget= to have it checked)")
            return cfg.micro_batch, cfg.micro_batch
        budget = resolve_budget(cfg.budget, device)
        total = device_total_bytes(device)
        if explicit_budget and total is not None and budget > total:
            raise ConfigError(
                f"budget={cfg.budget} is more than all the memory this {device.type} has "
                f"({format_bytes(total)}): a plan for it would run out of memory; use "
                f"budget=auto (the free memory now) or at most {format_bytes(total)}"
            )
        plan = plan_under_budget(
            spec_at,
            target or cfg.batch,
            budget,
            device=device.type,
            overhead=None if cfg.overhead == "auto" else parse_bytes(cfg.overhead, allow_zero=True),
            max_micro_batch=cfg.micro_batch or None,
        )
        if plan.calibration_note:
            log(f"plan: {plan.calibration_note}")
    except DoesNotFitError as exc:
        raise ConfigError(str(exc)) from exc
    except ConfigError:
        raise
    except (RuntimeError, TypeError, ValueError) as exc:
        if "more than 1 value per channel" in str(exc):
            raise ConfigError(
                f"BatchNorm cannot train on micro-batch 1 ({cfg.model_name} normalises a 1x1 "
                "feature map): set micro_batch >= 2, or freeze_bn=true"
            ) from exc
        raise ConfigError(
            f"{cfg.model_name} cannot train at size {cfg.size}: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    if cfg.micro_batch:
        # The plan predicted the fixed micro-batch already (its cap, tried first), unless a
        # rank's share of the batch under torchrun is smaller.
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
        return cfg.micro_batch, cfg.micro_batch
    log(f"plan: {plan.summary()}")
    return plan.micro_batch, plan.max_micro_batch


def evaluate(
    model: nn.Module,
    loader: Any,
    device: torch.device,
    precision: str,
    metrics: Metrics,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> Metrics:
    """Run the validation set through ``model`` into ``metrics`` (the task's)."""

    model.eval()
    with torch.no_grad():
        for x, y in loader:
            with autocast_for(precision, device.type):
                logits = model(x.to(device, non_blocking=True, memory_format=memory_format))
            metrics.update(logits, y.to(device))
    model.train()
    return metrics


class TrainingDiverged(ConfigError):
    """The training loss became inf or nan; the last good checkpoint is kept."""


def train(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    log: Log = print,
    progress: bool | None = None,
    data: tuple[Any, Any] | None = None,
) -> TrainResult:
    """Train ``cfg`` into ``run_dir`` (resuming it when ``resume``); see the module docstring.
    ``data`` is the task's scanned (train, valid) items when the caller has them already.

    The run folder is locked for the whole run (a second ``train`` on it fails at once), and
    every check that needs no training (config, folder, data, model, plan) runs first.

    Under torchrun it joins the process group (when the caller has not) and leaves it open, so
    one process can train several runs; the caller ends it (see :func:`bigbatch.cli.main.console`)."""
    cfg.validate()
    rank, world = _init_distributed(cfg)
    run_dir = Path(run_dir)
    if rank != 0:  # rank 0 alone logs and writes files
        return _loop(_setup(cfg, run_dir, resume, _silent, False, data, rank, world))

    threads_before = torch.get_num_threads()
    try:
        with lock_folder(run_dir, "run folder"):
            return _loop(_setup(cfg, run_dir, resume, log, progress, data, rank, world))
    except (FolderBusyError, NotADirectoryError, PermissionError) as exc:
        raise ConfigError(str(exc)) from exc
    finally:
        torch.set_num_threads(threads_before)  # the caller's process keeps its own setting


def resolve_threads(cfg: TrainConfig, device: torch.device) -> tuple[int, int]:
    """(torch threads, data-loader workers), chosen rather than left to chance.

    torch's default takes every core, and each loader worker wants one too: on a 2-core machine
    that oversubscription took a small run from 45 s to 3 min 44 s. Auto: on a CPU run with 2
    cores or fewer, load in the training process and give torch every core; with more, a
    quarter of the cores (at most 4) load and the rest compute. On a GPU torch's threads matter
    little: up to 4 loaders, torch keeps the rest."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    workers = cfg.num_workers
    if workers < 0:
        if device.type == "cpu":
            workers = 0 if cores <= 2 else min(4, cores // 4)
        else:
            workers = min(4, max(0, cores - 1))
    threads = cfg.threads or max(1, cores - (workers if device.type == "cpu" else 0))
    return threads, workers


@dataclass
class _Run:
    """What the loop shares between its steps: set up once by :func:`_setup`."""

    cfg: TrainConfig
    run_dir: Path
    log: Log
    progress: bool | None
    task: Task
    rank: int
    world: int
    device: torch.device
    precision: str
    workers: int
    core: nn.Module
    memory_format: torch.memory_format
    pin: bool
    lone_ok: bool
    rank_batch: int
    train_ds: Any
    valid_loader: Any
    has_valid: bool
    monitor: str
    sampler: Any
    scaler: Any
    backoff: OOMBackoff
    state: dict[str, Any] | None
    history: list[dict[str, Any]] = field(default_factory=list)
    best: float = math.inf
    start_epoch: int = 0
    mid: dict[str, Any] | None = None  # where a mid-epoch checkpoint left the epoch in flight
    last_checkpoint: float = 0.0

    @property
    def main_rank(self) -> bool:
        return self.rank == 0


def _loop(run: _Run) -> TrainResult:
    """The loop, after :func:`_setup`: each phase's epochs, each epoch's windows through
    :func:`~bigbatch.memory.oom.run_window`, and after each epoch validation, the history and
    atomic checkpoints."""
    epoch = 0
    for phase, n_epochs in _phases(run.cfg):
        phase_start, epoch = epoch, epoch + n_epochs
        if run.start_epoch < epoch:  # else a finished phase
            _train_phase(run, phase, phase_start, epoch)
    if run.main_rank:
        summary = {"monitor": run.monitor, "best": run.best, "epochs": len(run.history)}
        atomic_write_text(run.run_dir / "done.json", json.dumps(summary))
    return TrainResult(run.run_dir, run.best, run.history, run.task.classes)


def _setup(
    cfg: TrainConfig,
    run_dir: Path,
    resume: bool,
    log: Log,
    progress: bool | None,
    data: tuple[Any, Any] | None,
    rank: int,
    world: int,
) -> _Run:
    """Every check that needs no training, the plan, the model, the data and the saved state."""
    state = _check_run_dir(run_dir, cfg, resume)
    device = resolve_device(cfg.device)
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    precision = resolve_precision(cfg.precision, device)
    threads, workers = _threads_for_run(cfg, device, run_dir, state, log)
    task = task_for(cfg)
    train_items, valid_items = task.prepare(log, data)
    factory = task.model_factory()
    # Every rank holds 1/world of each window: the union over ranks is the target batch.
    rank_batch = math.ceil(cfg.batch / world)
    micro, max_micro = plan_for(
        cfg, factory, device, precision, log, target=rank_batch, input_shape=task.input_shape()
    )
    if world > 1:
        log(
            f"distributed: {world} ranks x {rank_batch} samples per window = target batch {cfg.batch}"
        )
    if cfg.mode == "auto":
        log(
            f"mode: fine_tune (the head alone for {cfg.freeze_epochs} epoch(s), then all: "
            "starting from " + ("pretrained weights)" if cfg.pretrained else "weights=)")
            if cfg.fine_tunes
            else "mode: fit (random weights: every layer trains from the start)"
        )
    if rank == 0:
        plan_info = {
            "micro_batch": micro,
            "max_micro_batch": max_micro,
            "target_batch": cfg.batch,
            "precision": precision,
            "device": str(device),
            "seed": cfg.seed,
            "world_size": world,
            "threads": threads,
            "num_workers": workers,
        }
        atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=1))
        atomic_write_text(run_dir / "classes.json", json.dumps(task.classes))
        atomic_write_text(run_dir / "task.json", json.dumps(task.run_info(), indent=1))
        atomic_write_text(run_dir / "plan.json", json.dumps(plan_info, indent=1))

    torch.manual_seed(cfg.seed)
    core = factory().to(device)
    # NHWC where it helps: convolutions on a GPU (tensor cores want it); opt-in elsewhere.
    has_conv = any(isinstance(m, nn.Conv2d) for m in core.modules())
    use_nhwc = cfg.channels_last == "true" or (
        cfg.channels_last == "auto" and device.type == "cuda" and has_conv
    )
    if use_nhwc:
        core = core.to(memory_format=torch.channels_last)
    pin = device.type == "cuda"  # page-locked batches: copies to a GPU that overlap compute
    _train_mode(core, cfg)
    lone_ok = _note_inexact(core, cfg, log)
    if not lone_ok:
        _check_no_lone_sample(len(train_items), rank_batch, world, log)
    train_ds, valid_ds = task.datasets(train_items, valid_items)
    sampler: Any = None
    if world > 1:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(
            train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed
        )
    has_valid = len(valid_ds) > 0
    run = _Run(
        cfg=cfg,
        run_dir=run_dir,
        log=log,
        progress=progress,
        task=task,
        rank=rank,
        world=world,
        device=device,
        precision=precision,
        workers=workers,
        core=core,
        memory_format=torch.channels_last if use_nhwc else torch.contiguous_format,
        pin=pin,
        lone_ok=lone_ok,
        rank_batch=rank_batch,
        train_ds=train_ds,
        valid_loader=make_loader(
            valid_ds,
            max(1, 2 * micro),
            shuffle=False,
            seed=cfg.seed,
            num_workers=workers,
            pin_memory=pin,
        ),
        has_valid=has_valid,
        monitor=cfg.monitor if has_valid else "train_loss",
        sampler=sampler,
        scaler=torch.amp.GradScaler(device.type) if precision == "fp16" else None,
        backoff=OOMBackoff(
            micro_batch=micro,
            max_micro_batch=max_micro,
            grow_after=cfg.grow_after,
            min_micro_batch=1 if lone_ok else min(2, micro),
        ),
        state=state,
        last_checkpoint=time.perf_counter(),
    )
    if state is not None:
        _restore(run, state)
    return run


def _threads_for_run(
    cfg: TrainConfig, device: torch.device, run_dir: Path, state: Any, log: Log
) -> tuple[int, int]:
    threads, workers = resolve_threads(cfg, device)
    saved_plan = run_dir / "plan.json"
    if state is not None and saved_plan.exists():
        # The thread and worker counts change the last bits (reductions, worker RNG streams):
        # a resumed run keeps the ones it started with, to end bit-identical.
        saved = json.loads(saved_plan.read_text())
        if (saved.get("threads"), saved.get("num_workers")) != (threads, workers):
            log(
                f"resuming with the run's own threads={saved.get('threads', threads)} and "
                f"num_workers={saved.get('num_workers', workers)} (not {threads} and {workers}): "
                "they change the last bits of the result"
            )
        threads = int(saved.get("threads", threads))
        workers = int(saved.get("num_workers", workers))
    torch.set_num_threads(threads)
    log(f"threads: {threads} for torch, {workers} data-loading worker(s)")
    return threads, workers


def _note_inexact(core: nn.Module, cfg: TrainConfig, log: Log) -> bool:
    """Say what keeps accumulation from being exact; return whether a lone sample may train
    (BatchNorm in training cannot normalise one sample: on a 1x1 feature map it raises)."""
    inexact = find_inexact_layers(core)
    bn = sum(1 for layer in inexact if layer.kind == "batchnorm")
    if inexact:
        log(
            f"note: {bn} BatchNorm layer(s): each micro-batch is normalised with its own statistics, "
            "so accumulation is exact for the loss but not for BatchNorm (the update equals the "
            "big batch's only when the whole window fits one micro-batch; freeze_bn=true makes "
            "it exact, best when fine-tuning pretrained weights)"
            if bn
            else "note: dropout draws different masks per micro-batch (exact in distribution)"
        )
    return bn == 0 or cfg.freeze_bn


def _restore(run: _Run, state: dict[str, Any]) -> None:
    run.core.load_state_dict(state["model"])
    run.history = json.loads(state["history"])
    run.best = float(state["best"])
    run.start_epoch = int(state["epoch"]) + 1
    run.backoff.micro_batch = int(state["micro_batch"])
    run.backoff.clean_windows = int(state.get("clean_windows", 0))
    run.backoff.grow_after = int(state.get("grow_after", run.backoff.grow_after))
    run.mid = state.get("mid") or None
    total = sum(n for _, n in _phases(run.cfg))
    run.log(
        f"resuming {run.run_dir} in epoch {run.start_epoch + 1} of {total}, after window "
        f"{run.mid['windows']}"
        if run.mid
        else f"resuming {run.run_dir} after epoch {run.start_epoch} of {total}"
    )
    if run.mid and run.workers > 0:
        run.log(
            "note: resuming mid-epoch with num_workers > 0: the rest of this epoch's "
            "augmentation is drawn by other worker streams (bit-identical with num_workers=0)"
        )


@dataclass
class _Phase:
    """One phase's optimizer, schedule and accumulator (the head-only epochs of fine_tune get
    their own)."""

    name: str
    end_epoch: int
    windows: int  # per epoch
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    plateau: bool
    acc: Accumulator
    checkpoint: Callable[..., None]


def _train_phase(run: _Run, phase: str, phase_start: int, end_epoch: int) -> None:
    cfg = run.cfg
    windows = (
        math.ceil(len(run.sampler) / run.rank_batch)
        if run.sampler is not None
        else windows_per_epoch(len(run.train_ds), cfg.batch, 1 if run.lone_ok else 2)
    )
    opt, sched = _make_optimizer(cfg, run.core, phase, (end_epoch - phase_start) * windows)
    plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    model: nn.Module = run.core
    if run.world > 1:
        # Re-wrapped per phase: DDP fixes the trainable parameters when it is built.
        # No buffer broadcast in forward, so no collective runs inside a micro-batch.
        model = _ddp(run.core)
    if cfg.compile:
        # After DDP, as torch's docs say; the weights stay `core`'s (checkpoints unchanged).
        model = cast(nn.Module, torch.compile(model))
    # On one process model= is not passed: the BatchNorm note replaces the warning.
    acc = Accumulator(
        opt,
        scheduler=None if plateau else sched,
        scaler=run.scaler,
        model=model if run.world > 1 else None,
        sync="step",
    )
    checkpoint = functools.partial(
        _save_checkpoint, run.run_dir, run.core, opt, sched, acc, run.scaler, run.backoff,
        phase=phase,
    )  # fmt: skip
    state = run.state
    if (
        state is not None
        and state["phase"] == phase
        and (run.start_epoch > phase_start or run.mid is not None)
    ):
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        acc.load_state_dict(state["accumulator"])
        if run.scaler is not None and state.get("scaler"):
            run.scaler.load_state_dict(state["scaler"])
    ph = _Phase(phase, end_epoch, windows, model, opt, sched, plateau, acc, checkpoint)
    for e in range(max(phase_start, run.start_epoch), end_epoch):
        t0 = time.perf_counter()
        loss_sum, count = _train_epoch(run, ph, e)
        _finish_epoch(run, ph, e, loss_sum, count, t0)


def _train_epoch(run: _Run, ph: _Phase, e: int) -> tuple[float, float]:
    """One epoch's windows; returns the epoch's loss sum and count (for the exact mean)."""

    cfg, device, acc, backoff = run.cfg, run.device, ph.acc, run.backoff
    # Order, augmentation and dropout depend only on (seed, epoch): a resumed run replays
    # exactly what the uninterrupted run would have done.
    torch.manual_seed(cfg.seed + e)
    _train_mode(run.core, cfg)  # evaluation left the model in train mode, BatchNorm too
    resumed = run.mid if run.mid is not None and e == run.start_epoch else None
    run.mid = None
    loader: Any
    if run.sampler is not None:
        run.sampler.set_epoch(e)
        loader = torch.utils.data.DataLoader(
            run.train_ds, batch_size=run.rank_batch, sampler=run.sampler, num_workers=run.workers
        )
    else:
        loader = make_loader(
            run.train_ds,
            cfg.batch,
            shuffle=True,
            seed=cfg.seed * 1000 + e,
            num_workers=run.workers,
            min_last=1 if run.lone_ok else 2,
            skip=int(resumed["windows"]) if resumed else 0,
            pin_memory=run.pin,
        )
    loss_sum = count = 0.0
    windows_done = 0
    if resumed:
        # Where the checkpoint left the epoch: its windows, sums and random streams.
        windows_done = int(resumed["windows"])
        loss_sum, count = float(resumed["loss_sum"]), float(resumed["count"])
        set_rng_state({"cpu": resumed["rng"], "cuda": resumed.get("cuda_rng")})
    show = _progress(
        run.progress and run.main_rank,
        ph.windows,
        f"epoch {e + 1}/{ph.end_epoch} ({ph.name})",
        log=run.log,
        log_every=cfg.log_every,
    )
    every_steps, every_seconds = cfg.checkpoint_interval()

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with autocast_for(run.precision, device.type):
            logits = ph.model(
                batch[0].to(device, non_blocking=True, memory_format=run.memory_format)
            )
        return run.task.loss(logits, batch[1].to(device, non_blocking=True))

    for x, y in loader:
        with warnings.catch_warnings():
            # Said below as TrainingDiverged, with the epoch and what was kept.
            warnings.simplefilter("ignore", NonFiniteGradientWarning)
            result = run_window(acc, (x, y), loss_fn, backoff, device=device)
        if result.skipped and not result.non_finite:
            continue  # fp16 loss scaling's routine skip, or an all-padding window
        if result.non_finite or not math.isfinite(result.loss):
            show.close()
            raise TrainingDiverged(
                f"training diverged: the loss became {result.loss} at epoch {e + 1}, "
                f"optimizer step {acc.optimizer_step} (lr {ph.opt.param_groups[0]['lr']:.3g}). "
                f"Nothing of epoch {e + 1} was saved"
                + (f"; {run.run_dir / 'last.pt'} holds epoch {e}" if run.history else "")
                + ". Lower lr (e.g. lr="
                + f"{cfg.lr / 10:g}), or use precision=fp32 if it was bf16/fp16"
            )
        loss_sum += result.loss * result.count
        count += result.count
        windows_done += 1
        now = time.perf_counter()
        due = (every_steps and acc.optimizer_step % every_steps == 0) or (
            every_seconds and now - run.last_checkpoint >= every_seconds
        )
        # One process only: a DistributedSampler cannot skip the windows already done.
        if due and run.world == 1 and windows_done < ph.windows:
            run.last_checkpoint = now
            ph.checkpoint(
                epoch=e - 1,
                best=run.best,
                history=run.history,
                mid={
                    "windows": windows_done,
                    "loss_sum": loss_sum,
                    "count": count,
                    "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                },
            )
        show.advance(
            len(y),
            backoff.micro_batch,
            acc_steps=math.ceil(len(y) / backoff.micro_batch),
            device=device,
        )
    acc.end_epoch()  # under DDP: ranks with fewer windows join the others' steps
    show.close()
    return loss_sum, count


def _finish_epoch(run: _Run, ph: _Phase, e: int, loss_sum: float, count: float, t0: float) -> None:
    """Validation, the plateau schedule, the history, the best and last checkpoints, the log."""
    row: dict[str, Any] = {"epoch": e + 1, "phase": ph.name, "train_loss": loss_sum / max(count, 1)}
    if run.has_valid:
        # Every rank evaluates the whole validation set: identical metrics everywhere.
        metrics = evaluate(
            run.core, run.valid_loader, run.device, run.precision, run.task.metrics(),
            run.memory_format,
        )  # fmt: skip
        row |= metrics.as_dict()  # valid_loss, then the task's scores
    if ph.plateau:
        ph.sched.step(row["valid_loss" if run.has_valid else "train_loss"])
    row |= {
        "lr": ph.opt.param_groups[0]["lr"],
        "micro_batch": run.backoff.micro_batch,
        "optimizer_steps": ph.acc.optimizer_step,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    run.history.append(row)
    value = row[run.monitor]
    sign = 1.0 if lower_is_better(run.cfg.task, run.monitor) else -1.0
    improved = sign * value < sign * run.best if math.isfinite(run.best) else True
    if improved:
        run.best = value
    if not run.main_rank:
        return
    run_dir, cfg = run.run_dir, run.cfg
    if improved:
        save_weights(run.core, run_dir / "best.safetensors")
        atomic_write_text(run_dir / "best.json", json.dumps({"epoch": e + 1, run.monitor: value}))
    save_weights(run.core, run_dir / "last.safetensors")
    ph.checkpoint(epoch=e, best=run.best, history=run.history)
    run.last_checkpoint = time.perf_counter()
    write_history(run.history, run_dir / "history.csv")
    plot_history(run.history, run_dir / "history.png", title=f"{cfg.model_name} @ {cfg.size}")
    scores = run.task.scores(row) if run.has_valid else ""
    run.log(
        f"epoch {e + 1}: train loss {row['train_loss']:.4f}  {scores}"
        f"({row['seconds']} s, micro-batch {run.backoff.micro_batch})"
        + ("  * best" if improved else "")
    )


def _save_checkpoint(
    run_dir: Path,
    core: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    acc: Accumulator,
    scaler: Any,
    backoff: OOMBackoff,
    *,
    epoch: int,
    phase: str,
    best: float,
    history: list[dict[str, Any]],
    mid: dict[str, Any] | None = None,
) -> None:
    """``last.pt``: everything a resumed run needs to end bit-identical. ``epoch`` is the last
    finished epoch; ``mid`` where the epoch in flight stands (windows done, the epoch's loss
    sums, the random streams), for a checkpoint between windows."""
    save_state(
        {
            "model": core.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "accumulator": acc.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else {},
            "epoch": epoch,
            "phase": phase,
            "best": best,
            "micro_batch": backoff.micro_batch,
            "clean_windows": backoff.clean_windows,
            "grow_after": backoff.grow_after,
            "history": json.dumps(history),
            "mid": mid or {},
        },
        run_dir / "last.pt",
    )


def _check_no_lone_sample(n_train: int, rank_batch: int, world: int, log: Log) -> None:
    if n_train < 2 * world:
        raise ConfigError(
            f"{n_train} training image(s) for {world} process(es): a BatchNorm model needs at "
            "least 2 per window (it cannot normalise one sample); add images, or set "
            "freeze_bn=true"
        )
    if world == 1 and n_train > rank_batch and n_train % rank_batch == 1:
        log(
            f"note: {n_train} training images in windows of {rank_batch} leave 1 for the last "
            f"window, which BatchNorm cannot normalise alone: it joins the window before "
            f"({rank_batch + 1} samples)"
        )


def _ddp(core: nn.Module) -> nn.Module:
    """DDP without buffer syncs in forward (newer torch names the option forward_sync_buffers)."""
    import inspect

    ddp = nn.parallel.DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:
        return ddp(core, forward_sync_buffers=False)
    return ddp(core, broadcast_buffers=False)


def _train_mode(model: nn.Module, cfg: TrainConfig) -> None:
    model.train()
    if cfg.freeze_bn:
        freeze_batchnorm(model)


def _silent(_: str) -> None:
    pass


def _init_distributed(cfg: TrainConfig) -> tuple[int, int]:
    """(rank, world size): joins the process group torchrun describes, if there is one."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo"
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


class _Progress:
    """A rich progress bar with samples/s, peak memory and micro-batch x accumulation on a
    terminal; elsewhere (a log file, a notebook, CI) a plain line every ``log_every`` seconds."""

    def __init__(
        self, enabled: bool, total: int, title: str, log: Log = print, log_every: float = 0.0
    ) -> None:
        self.bar: Any = None
        self.samples = 0
        self.windows = 0
        self.total, self.title, self.log, self.log_every = total, title, log, log_every
        self.t0 = self.last_line = time.perf_counter()
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task(title, total=total, info="")

    def advance(self, samples: int, micro: int, *, acc_steps: int, device: torch.device) -> None:
        self.samples += samples
        self.windows += 1
        now = time.perf_counter()
        if self.bar is None and not (self.log_every and now - self.last_line >= self.log_every):
            return
        rate = self.samples / max(now - self.t0, 1e-9)
        info = f"{rate:.0f} samples/s, {acc_steps} x {micro}{peak_memory_text(device)}"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)
            return
        self.last_line = now
        eta = (now - self.t0) / self.windows * (self.total - self.windows)
        self.log(
            f"{self.title}: window {self.windows}/{self.total}, {info}, about {eta:.0f} s left"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _progress(
    enabled: bool | None, total: int, title: str, *, log: Log = print, log_every: float = 0.0
) -> _Progress:
    return _Progress(
        sys.stderr.isatty() if enabled is None else enabled, total, title, log, log_every
    )
