"""What the training loop shares between its steps: the run (set up once) and each phase (the
head-only epochs of fine_tune get their own optimizer, schedule and accumulator)."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from bigbatch.accumulate import Accumulator
from bigbatch.backoff import BackoffEvent, OOMBackoff
from bigbatch.io import read_json
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.data import make_loader, windows_per_epoch
from bigbatch.train.optim import load_optimizer_state, make_optimizer, phases
from bigbatch.train.run_dir import check_run_dir, check_same_config, checkpoint_state
from bigbatch.train.runtime import wrap_ddp
from bigbatch.train.tasks import Placement, Task
from bigbatch.train.tasks.device_images import collate_encoded

__all__ = [
    "EpochLoss",
    "Phase",
    "Run",
    "RunData",
    "TrainResult",
    "TrainingDiverged",
    "build_phase",
    "diverged",
    "finished_result",
    "make_backoff",
    "make_ema",
    "make_valid_loader",
    "restore",
]

Log = Callable[[str], None]


@dataclass
class EpochLoss:
    """An epoch's exact mean loss (count-weighted sums), read from the device every
    :attr:`READ_EVERY` windows, at a checkpoint and at the epoch's end: a window's loss is a
    value on the device until read, and reading it waits for the device to finish the step, so
    reading each one would drain the GPU's queue every optimizer step."""

    loss_sum: float = 0.0
    count: float = 0.0
    pending: list[Any] = field(default_factory=list)  # windows' StepResults not read yet

    READ_EVERY = 32

    def add(self, result: Any, read_now: bool = False) -> float | None:
        """Keep a window's result; when it is time to read, the first non-finite loss read
        (the run diverged) or None."""
        self.pending.append(result)
        return self.read() if read_now or len(self.pending) >= self.READ_EVERY else None

    def read(self) -> float | None:
        pending, self.pending = self.pending, []
        for result in pending:
            if not math.isfinite(result.loss):
                return float(result.loss)
            self.loss_sum += result.loss * result.count
            self.count += result.count
        return None


@dataclass
class TrainResult:
    """What a finished run reports: its folder, the best value of ``monitor`` (``train_loss``
    where there is no validation set), the history, and every change the OOM back-off made."""

    run_dir: Path
    best_metric: float
    history: list[dict[str, Any]] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    monitor: str = "valid_loss"
    backoff_events: list[BackoffEvent] = field(default_factory=list)


def finished_result(
    cfg: TrainConfig, run_dir: Path, log: Callable[[str], None]
) -> TrainResult | None:
    """What a resumed run that has finished (``done.json``, written at its end) reports,
    having said so, or None for one that has not: nothing is planned, trained or reported to
    the trackers again. Its config is checked as every resumed run's is.

    >>> finished_result(TrainConfig(data="x"), Path("no/such/run"), print) is None
    True
    """
    done = run_dir / "done.json"
    if not done.is_file():
        return None
    fix = f"delete {done} and resume the run again: its end (validation, done.json) runs again"
    summary = read_json(done, fix)
    if not isinstance(summary, dict) or not {"monitor", "best"} <= summary.keys():
        raise ConfigError(f"{done} is not one bigbatch wrote (no monitor or best): {fix}")
    if not isinstance(summary.get("history", []), list):
        raise ConfigError(f"{done} is not one bigbatch wrote (its history is no list): {fix}")
    if "history" in summary:  # a checkpoint of a large model takes seconds to read
        check_same_config(run_dir, cfg)
        history = list(summary["history"])
    else:  # done.json of bigbatch 0.1
        state = check_run_dir(run_dir, cfg, resume=True)
        history = json.loads(state["history"]) if state is not None else []
    classes = run_dir / "classes.json"
    monitor, best = str(summary["monitor"]), float(summary["best"])
    said = f"{run_dir} finished earlier ({len(history)} epoch(s), best {monitor} {best:.4f})"
    log(f"{said}: nothing to resume")
    return TrainResult(
        run_dir, best, history, read_json(classes, fix) if classes.is_file() else [], monitor
    )


@dataclass
class RunData:
    """The run's data: the training set, read a window at a time in an order that depends only
    on (seed, epoch), and the validation loader."""

    train_ds: Any
    valid_loader: Any
    has_valid: bool  # a validation set with samples (else best is chosen by train_loss)
    collate: Any  # the task's (None: torch's default)
    window: int  # samples per window on this rank (the target batch, or its share under torchrun)
    workers: int
    pin: bool  # page-locked batches (a GPU run)
    min_last: int  # 2 where BatchNorm cannot train a lone sample, so no window of one is made
    sampler: Any = None  # torchrun's DistributedSampler
    train_loader: Any = None  # with workers: one loader for the run, its workers persistent
    decode: Any = None  # decode_choice.DecodeChoice: where the training images are decoded
    on_device: bool = False  # the loader delivers files, decoded on the device

    def windows_per_epoch(self) -> int:
        if self.sampler is not None:
            return math.ceil(len(self.sampler) / self.window)
        return windows_per_epoch(len(self.train_ds), self.window, self.min_last)

    def epoch(self, seed: int, e: int, skip: int) -> Any:
        """Epoch ``e``'s windows, in an order that depends only on (seed, epoch); ``skip``:
        the windows a mid-epoch checkpoint had done. Decoded where :attr:`decode` says (the
        first epoch of ``decode=auto`` measured for its choice)."""
        if self.sampler is not None:
            self.sampler.set_epoch(e)
            return torch.utils.data.DataLoader(
                self.train_ds,
                batch_size=self.window,
                sampler=self.sampler,
                num_workers=self.workers,
                collate_fn=self.collate,
            )
        decode = self.decode
        on_device = decode is not None and decode.on_device
        if on_device != self.on_device:  # the path changed: the other path's workers end
            self.train_loader, self.on_device = None, on_device
        loader = self._loader(seed * 1000 + e, skip)
        windows = decode.decoded(loader) if on_device else loader
        if decode is not None and decode.measures(e):
            return decode.timed(windows)
        return windows

    def _loader(self, epoch_seed: int, skip: int) -> Any:
        if self.train_loader is not None:  # its workers live on: the next epoch's batches
            self.train_loader.batch_sampler.set_epoch(epoch_seed, skip)
            return self.train_loader
        dataset, collate, pin = self.train_ds, self.collate, self.pin
        if self.on_device:  # files and their draws; pixels come on the device
            dataset, collate, pin = self.decode.images, collate_encoded, False
        loader = make_loader(
            dataset,
            self.window,
            shuffle=True,
            seed=epoch_seed,
            num_workers=self.workers,
            min_last=self.min_last,
            skip=skip,
            pin_memory=pin,
            collate_fn=collate,
        )
        if self.workers > 0:
            self.train_loader = loader
        return loader


@dataclass
class Run:
    """What the loop shares between its steps: set up once by :func:`_setup`."""

    cfg: TrainConfig
    run_dir: Path
    log: Log
    progress: bool | None
    task: Task
    rank: int
    world: int
    where: Placement  # device, precision's autocast, the inputs' memory format
    core: nn.Module
    data: RunData
    monitor: str
    scaler: Any
    backoff: OOMBackoff
    state: dict[str, Any] | None
    history: list[dict[str, Any]] = field(default_factory=list)
    best: float = math.inf
    start_epoch: int = 0
    mid: dict[str, Any] | None = None  # where a mid-epoch checkpoint left the epoch in flight
    last_checkpoint: float = 0.0
    ema: Any = None  # timm's ModelEmaV3 of core, with ema= (validated and saved instead)
    fraction_before: float | None = None  # the allocator's fraction before budget='s cap
    memory: Any = None  # planning.MemoryCheck: the first steps' measured peak against the plan
    report: Any = None  # tracking.RunReport with log=, on rank 0
    files: Any = None  # io.BackgroundWriter: checkpoints and plots off the training thread

    @property
    def main_rank(self) -> bool:
        return self.rank == 0

    @property
    def scored(self) -> nn.Module:
        """The weights validation scores and ``best``/``last.safetensors`` hold: the EMA's."""
        return self.ema.module if self.ema is not None else self.core


@dataclass
class Phase:
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
    checkpoint: Callable[..., dict[str, Any]]  # run_dir.checkpoint_state, copied now


def restore(run: Run, state: dict[str, Any]) -> None:
    run.core.load_state_dict(state["model"])
    if run.ema is not None and state.get("ema"):
        run.ema.module.load_state_dict(state["ema"])
    run.history = json.loads(state["history"])
    run.best = float(state["best"])
    run.start_epoch = int(state["epoch"]) + 1
    run.backoff.micro_batch = int(state["micro_batch"])
    run.backoff.clean_windows = int(state.get("clean_windows", 0))
    run.backoff.grow_after = int(state.get("grow_after", run.backoff.grow_after))
    run.mid = state.get("mid") or None
    total = sum(n for _, n in phases(run.cfg))
    run.log(
        f"resuming {run.run_dir} in epoch {run.start_epoch + 1} of {total}, after window "
        f"{run.mid['windows']}"
        if run.mid
        else f"resuming {run.run_dir} after epoch {run.start_epoch} of {total}"
    )


def build_phase(run: Run, phase: str, phase_start: int, end_epoch: int) -> Phase:
    """The phase's optimizer, schedule and accumulator, the model wrapped for it (DDP, compile),
    restored from ``last.pt`` when the run resumes inside this phase."""
    cfg = run.cfg
    windows = run.data.windows_per_epoch()
    opt, sched = make_optimizer(cfg, run.core, phase, (end_epoch - phase_start) * windows)
    plateau = isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau)
    model: nn.Module = run.core
    if run.world > 1:
        # Re-wrapped per phase: DDP fixes the trainable parameters when it is built.
        # No buffer broadcast in forward, so no collective runs inside a micro-batch.
        model = wrap_ddp(run.core)
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
        checkpoint_state,
        run.core,
        opt,
        sched,
        acc,
        run.scaler,
        run.backoff,
        phase=phase,
        ema=run.ema,
    )
    state = run.state
    if (
        state is not None
        and state["phase"] == phase
        and (run.start_epoch > phase_start or run.mid is not None)
    ):
        load_optimizer_state(opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        acc.load_state_dict(state["accumulator"])
        if run.scaler is not None and state.get("scaler"):
            run.scaler.load_state_dict(state["scaler"])
    return Phase(phase, end_epoch, windows, model, opt, sched, plateau, acc, checkpoint)


def make_backoff(choice: Any, grow_after: int, lone_ok: bool) -> OOMBackoff:
    """The OOM back-off from the plan's micro-batch and ceiling; a model that cannot train on a
    lone sample (BatchNorm) never shrinks below 2."""
    return OOMBackoff(
        micro_batch=choice.micro_batch,
        max_micro_batch=choice.max_micro_batch,
        grow_after=grow_after,
        min_micro_batch=1 if lone_ok else min(2, choice.micro_batch),
    )


def make_valid_loader(
    task: Task, dataset: Any, planned: int, seed: int, workers: int, pin: bool
) -> Any:
    """The validation loader, its batch the task's for validation's ``planned`` forward passes
    (:meth:`Task.use_valid_batch`: whole volumes of different sizes go one at a time). A worker
    loads whole batches, so it has no more workers than batches: the others would never load
    one, yet each is a process of its own for the whole run (validation draws nothing random,
    so its batches are the same whatever the count).

    >>> from bigbatch.train.tasks import Task
    >>> make_valid_loader(Task(), list(range(400)), 256, 0, workers=15, pin=False).num_workers
    2
    """
    batch = task.use_valid_batch(planned)
    return make_loader(
        dataset,
        batch,
        shuffle=False,
        seed=seed,
        num_workers=min(workers, windows_per_epoch(len(dataset), batch)),
        pin_memory=pin,
        collate_fn=task.collate,
    )


def make_ema(core: nn.Module, decay: float) -> Any:
    """timm's exponential moving average of the weights, validated and saved instead of them."""
    from timm.utils import ModelEmaV3

    return ModelEmaV3(core, decay=decay) if decay else None


class TrainingDiverged(ConfigError):
    """The training loss became inf or nan; the last good checkpoint is kept."""


def diverged(run: Run, ph: Phase, e: int, loss: float) -> TrainingDiverged:
    """The error that stops a run whose loss became ``loss``, saying what was kept and what to
    try."""
    return TrainingDiverged(
        f"training diverged: the loss became {loss} at epoch {e + 1}, optimizer step "
        f"{ph.acc.optimizer_step} (lr {ph.opt.param_groups[0]['lr']:.3g}). Nothing of epoch "
        f"{e + 1} was saved"
        + (f"; {run.run_dir / 'last.pt'} holds epoch {e}" if run.history else "")
        + f". Lower lr (e.g. lr={run.cfg.lr / 10:g}), or use precision=fp32 if it was bf16/fp16"
    )
