"""``bigbatch train``: data -> model -> plan -> exact accumulation with OOM back-off -> checkpoints.

A thin composition of the library: the planner picks micro-batch x accumulation for the target
batch, each window (one target batch) goes through :func:`~bigbatch.backoff.run_window`, and
every epoch ends with validation, atomic checkpoints, ``history.csv`` and a plot. A run folder
is resumable: finished epochs are never redone, and the resumed run ends with the same weights.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from bigbatch.accumulate import NonFiniteGradientWarning
from bigbatch.batching import batch_len
from bigbatch.device import (
    cudnn_benchmark_mode,
    pins_memory,
    rng_state,
    set_rng_state,
    uncap_cuda_allocator,
    uses_cudnn_benchmark,
)
from bigbatch.distributed import rank_share
from bigbatch.io import BackgroundWriter, FolderBusyError, atomic_write_text, lock_folder
from bigbatch.train.checkpoint import save_state
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.decode_choice import decode_choice
from bigbatch.train.optim import mode_line, phases
from bigbatch.train.planning import MemoryCheck, model_factory_for, plan_for, plan_validation
from bigbatch.train.progress import progress
from bigbatch.train.run_dir import (
    RunLog,
    check_run_dir,
    record_measured_peak,
    write_epoch_files,
    write_run_files,
)
from bigbatch.train.runtime import (
    Log,
    cap_to_budget,
    check_no_lone_sample,
    distributed_sampler,
    init_distributed,
    note_inexact,
    place_model,
    run_device,
    slow_data_fix,
    threads_for_run,
    train_mode,
)
from bigbatch.train.state import (
    EpochLoss,
    Phase,
    Run,
    RunData,
    TrainResult,
    build_phase,
    diverged,
    finished_result,
    make_backoff,
    make_ema,
    make_valid_loader,
    restore,
)
from bigbatch.train.stepping import step_window
from bigbatch.train.tasks import check_declared_metrics, lower_is_better, prepare_data, task_for
from bigbatch.train.tasks.base import Placement
from bigbatch.train.tracking import report_files, start_report

__all__ = ["train"]


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
    every check that needs no training (config, folder, data, model, plan) runs first. Under
    torchrun it joins the process group (when the caller has not) and leaves it open, so
    one process can train several runs; the caller ends it (see :func:`bigbatch.cli.main.console`).
    From a notebook, as ``bigbatch train run.toml --out runs/b lr=0.001`` does::

        result = train(load_config("run.toml", ["lr=0.001"]), "runs/b")  # result.best_metric
    """
    cfg.validate(refuse_unread=not resume)  # a resumed run trained as its config said
    cfg = cfg.with_absolute_paths()  # predict, ensemble and --resume find the data from anywhere
    rank, world = init_distributed(cfg)
    run_dir = Path(run_dir)
    if resume and (finished := finished_result(cfg, run_dir, log if rank == 0 else _silent)):
        return finished  # every rank: none plans or joins a collective
    if rank != 0:  # rank 0 alone logs and writes files
        return _run(_setup(cfg, run_dir, resume, _silent, False, data, rank, world))

    threads_before = torch.get_num_threads()
    try:
        with lock_folder(run_dir, "run folder"), RunLog(run_dir, log) as run_log:
            return _run(_setup(cfg, run_dir, resume, run_log, progress, data, rank, world))
    except (FolderBusyError, NotADirectoryError, PermissionError) as exc:
        raise ConfigError(str(exc)) from exc
    finally:
        torch.set_num_threads(threads_before)  # the caller's process keeps its own setting


def _run(run: Run) -> TrainResult:
    if run.main_rank:  # log=: the trackers, with the plan the run folder holds now
        run.report = start_report(run.cfg, run.run_dir, run.state is not None, run.log)
    try:  # then an explicit budget's allocator cap comes off: the caller keeps its setting
        with cudnn_benchmark_mode(run.where.cudnn_benchmark), BackgroundWriter() as run.files:
            return _loop(run)
    finally:
        uncap_cuda_allocator(run.where.device, run.fraction_before)
        if run.report is not None:  # a run that raised: its tracker runs end as failed
            run.report.close(failed=True)


def _loop(run: Run) -> TrainResult:
    """After :func:`_setup`: each phase's epochs, each epoch's windows (:func:`_train_epoch`),
    then validation, the history and atomic checkpoints (:func:`_finish_epoch`)."""
    epoch = 0
    for phase, n_epochs in phases(run.cfg):
        phase_start, epoch = epoch, epoch + n_epochs
        if run.start_epoch < epoch:  # else a finished phase
            _train_phase(run, phase, phase_start, epoch)
    if run.main_rank:
        run.files.wait()  # the epoch's files whole: the task reads best.safetensors
        if run.data.has_valid:
            run.task.finish(run.scored, run.data.valid_loader, run.where, run.run_dir, run.log)
        summary = {"monitor": run.monitor, "best": run.best, "epochs": len(run.history)}
        atomic_write_text(run.run_dir / "done.json", json.dumps(summary | {"history": run.history}))
        record_measured_peak(run.run_dir, run.where.device, run.log)
        if run.report is not None:
            run.report.finish(report_files(run.run_dir, run.cfg.log_checkpoint))
    return TrainResult(
        run.run_dir, run.best, run.history, list(run.task.classes), run.monitor, run.backoff.events
    )


# One function on purpose (over 80 lines): the run's setup in the order it must happen (the
# checks that need no training, the plan, the model, the data, the saved state), read top to
# bottom; split, each part would take and return most of the others' values.
def _setup(
    cfg: TrainConfig,
    run_dir: Path,
    resume: bool,
    log: Log,
    progress: bool | None,
    data: tuple[Any, Any] | None,
    rank: int,
    world: int,
) -> Run:
    """Every check that needs no training, the plan, the model, the data and the saved state."""
    state = check_run_dir(run_dir, cfg, resume)
    device, precision = run_device(cfg, rank, world, log)
    benchmark = uses_cudnn_benchmark(cfg.cudnn_benchmark, device)
    threads, workers = threads_for_run(cfg, device, run_dir, state, log)
    task = task_for(cfg)
    train_items, valid_items = prepare_data(task, log, data)
    factory = model_factory_for(task, cfg)
    # Every rank holds 1/world of each window: the union over ranks is the target batch.
    rank_batch = rank_share(cfg.batch, world)
    choice = plan_for(cfg, factory, device, precision, log, task=task, measure=True, world=world)
    choice = plan_validation(cfg, factory, device, precision, choice, task, valid_items, log)
    fraction_before = cap_to_budget(cfg, device, choice, log)
    if cfg.mode == "auto":
        log(mode_line(cfg))
    if rank == 0:
        facts = {"target_batch": cfg.batch, "precision": precision, "device": str(device)}
        facts |= {"world_size": world, "seed": cfg.seed, "threads": threads, "num_workers": workers}
        facts["cudnn_benchmark"] = benchmark
        write_run_files(run_dir, cfg, task, choice._asdict() | facts, (train_items, valid_items))
    torch.manual_seed(cfg.seed)
    core, memory_format = place_model(factory(), cfg.channels_last, device)
    pin = pins_memory(device)
    train_mode(core, cfg)
    lone_ok = note_inexact(core, cfg, log)
    if not lone_ok:
        check_no_lone_sample(len(train_items), rank_batch, world, log)
    train_ds, valid_ds = task.datasets(train_items, valid_items)
    if len(valid_ds):
        task.metrics()  # its library imported now (torchmetrics: seconds), not in epoch 1's time
    sampler = distributed_sampler(train_ds, rank, world, cfg.seed)
    loaders = RunData(
        train_ds,
        make_valid_loader(task, valid_ds, choice.valid_batch, cfg.seed, workers, pin),
        len(valid_ds) > 0,
        task.collate,
        rank_batch,
        workers,
        pin,
        min_last=1 if lone_ok else 2,
        sampler=sampler,
        decode=decode_choice(cfg, task, train_ds, device, world, log),  # where JPEGs decode
    )
    main_dir = run_dir if rank == 0 else None  # where the main rank writes the plan's checks
    run = Run(
        cfg=cfg,
        run_dir=run_dir,
        log=log,
        progress=progress,
        task=task,
        rank=rank,
        world=world,
        where=Placement(device, precision, memory_format, benchmark),
        core=core,
        data=loaders,
        monitor=cfg.monitor if loaders.has_valid else "train_loss",
        scaler=torch.amp.GradScaler(device.type) if precision == "fp16" else None,
        backoff=make_backoff(choice, cfg.grow_after, lone_ok),
        state=state,
        last_checkpoint=time.perf_counter(),
        ema=make_ema(core, cfg.ema),
        fraction_before=fraction_before,
        memory=MemoryCheck(choice, device, rank_batch, log, main_dir, cudnn_benchmark=benchmark),
    )
    if state is not None:
        restore(run, state)
    return run


def _train_phase(run: Run, phase: str, phase_start: int, end_epoch: int) -> None:
    ph = build_phase(run, phase, phase_start, end_epoch)
    for e in range(max(phase_start, run.start_epoch), end_epoch):
        t0 = time.perf_counter()
        loss_sum, count = _train_epoch(run, ph, e)
        _finish_epoch(run, ph, e, loss_sum, count, t0)


def _train_epoch(run: Run, ph: Phase, e: int) -> tuple[float, float]:
    """One epoch's windows; returns the epoch's loss sum and count (for the exact mean)."""
    cfg, device, acc, backoff = run.cfg, run.where.device, ph.acc, run.backoff
    # Order, augmentation and dropout depend only on (seed, epoch): a resumed run replays
    # exactly what the uninterrupted run would have done.
    torch.manual_seed(cfg.seed + e)
    train_mode(run.core, cfg)  # evaluation left the model in train mode, BatchNorm too
    resumed = run.mid if run.mid is not None and e == run.start_epoch else None
    run.mid = None
    loader = run.data.epoch(cfg.seed, e, skip=int(resumed["windows"]) if resumed else 0)
    tally, windows_done = EpochLoss(), 0
    if resumed:
        # Where the checkpoint left the epoch: its windows, sums and random streams.
        windows_done = int(resumed["windows"])
        tally = EpochLoss(float(resumed["loss_sum"]), float(resumed["count"]))
        set_rng_state({"cpu": resumed["rng"], "cuda": resumed.get("cuda_rng")})
    title, shown = f"epoch {e + 1}/{ph.end_epoch} ({ph.name})", run.progress and run.main_rank
    fix = slow_data_fix(run.data.workers, device) if e == run.start_epoch else ""  # said once a run
    show = progress(
        shown, ph.windows, title, log=run.log, log_every=cfg.log_every, slow_data_fix=fix
    )
    every_steps, every_seconds = cfg.checkpoint_interval()

    for window in show.batches(loader):
        window = run.task.transform_window(window)  # Mixup/CutMix, before it splits
        with warnings.catch_warnings():
            # Said below as TrainingDiverged, with the epoch and what was kept.
            warnings.simplefilter("ignore", NonFiniteGradientWarning)
            result = step_window(run, ph, window)
        if result.skipped and not result.non_finite:
            continue  # fp16 loss scaling's routine skip, or an all-padding window
        windows_done += 1
        run.memory.after_window(acc.optimizer_step, backoff)  # measure, then adjust: once
        now = time.perf_counter()
        due = (every_steps and acc.optimizer_step % every_steps == 0) or (
            every_seconds and now - run.last_checkpoint >= every_seconds
        )
        # One process only: a DistributedSampler cannot skip the windows already done.
        due = due and run.world == 1 and windows_done < ph.windows
        bad = result.loss if result.non_finite else tally.add(result, read_now=bool(due))
        if bad is not None:
            show.close()
            raise diverged(run, ph, e, bad)
        if due:
            run.last_checkpoint = now
            rng = rng_state()
            mid = {"windows": windows_done, "loss_sum": tally.loss_sum, "count": tally.count}
            mid |= {"rng": rng["cpu"], "cuda_rng": rng.get("cuda", [])}
            state = ph.checkpoint(epoch=e - 1, best=run.best, history=run.history, mid=mid)
            run.files.submit(save_state, state, run.run_dir / "last.pt")
        samples = batch_len(window)
        if run.report is not None:
            run.report.window(result, samples * run.world, ph.opt.param_groups[0]["lr"])
        acc_steps = math.ceil(samples / backoff.micro_batch)
        show.advance(samples, backoff.micro_batch, acc_steps=acc_steps, device=device)
    acc.end_epoch()  # under DDP: ranks with fewer windows join the others' steps
    show.close()
    if (bad := tally.read()) is not None:
        raise diverged(run, ph, e, bad)
    return tally.loss_sum, tally.count


def _finish_epoch(run: Run, ph: Phase, e: int, loss_sum: float, count: float, t0: float) -> None:
    """Validation, the plateau schedule, the history, the best and last checkpoints, the log."""
    row: dict[str, Any] = {"epoch": e + 1, "phase": ph.name, "train_loss": loss_sum / max(count, 1)}
    if run.data.has_valid:
        # Every rank evaluates the whole validation set: identical metrics everywhere.
        metrics = run.task.evaluate(run.scored, run.data.valid_loader, run.where)
        row |= metrics.as_dict()  # valid_loss, then the task's scores
        check_declared_metrics(run.cfg.task, run.monitor, row)
    if ph.plateau:
        ph.sched.step(row["valid_loss" if run.data.has_valid else "train_loss"])
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
    # Host copies now, written on the writer's thread while the next epoch trains.
    state = ph.checkpoint(epoch=e, best=run.best, history=run.history)
    best = {"epoch": e + 1, run.monitor: value} if improved else None
    rows = [dict(r) for r in run.history]
    run.files.submit(write_epoch_files, run.run_dir, state, best, rows, run.cfg)
    run.last_checkpoint = time.perf_counter()
    if run.report is not None:
        run.report.epoch(row, run.backoff.events, decode=run.data.decode)
    scores = run.task.scores(row) if run.data.has_valid else ""
    run.log(
        f"epoch {e + 1}: train loss {row['train_loss']:.4f}  {scores}"
        f"({row['seconds']} s, micro-batch {run.backoff.micro_batch})"
        + ("  * best" if improved else "")
    )


def _silent(_: str) -> None: ...
