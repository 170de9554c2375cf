"""The run folder: what a fresh run or a resumed one finds there, and ``last.pt``, everything a
resumed run needs to end bit-identical."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigbatch.accumulate import Accumulator
from bigbatch.backoff import OOMBackoff, OutOfMemoryAtMinimumError
from bigbatch.device import peak_memory_bytes
from bigbatch.io import atomic_write_text
from bigbatch.memory.budget import format_bytes
from bigbatch.train.checkpoint import host_copy, load_state, save_state, write_weights
from bigbatch.train.config import ConfigError, TrainConfig, config_from_json
from bigbatch.train.registry import task_entry
from bigbatch.train.report import plot_history, write_history

__all__ = [
    "RunLog",
    "add_to_plan",
    "check_run_dir",
    "check_same_config",
    "checkpoint_state",
    "compare_peaks",
    "measured_as",
    "record_measured_peak",
    "write_epoch_files",
    "write_run_files",
]


class RunLog:
    """A run's log: each line said to ``echo`` and appended to ``train.log`` in the run folder
    with the time it was said, so that what a run said (its device, plan, back-offs, notes and
    the error that stopped it) outlives the notebook or terminal that showed it; each run or
    resume starts with the versions of bigbatch, torch and Python. The file is made at the
    first line, after the folder's checks: a run refused there writes nothing.

    >>> import tempfile
    >>> with RunLog(Path(tempfile.mkdtemp()), echo=lambda line: None) as log:
    ...     log("device: cpu, fp32")
    >>> said = log.path.read_text().splitlines()
    >>> said[0].split(" ", 2)[2].startswith("bigbatch "), said[1].endswith(" device: cpu, fp32")
    (True, True)
    """

    def __init__(self, run_dir: Path, echo: Callable[[str], None]) -> None:
        self.path = run_dir / "train.log"
        self.echo = echo
        self.written = False

    def __call__(self, line: str) -> None:
        self.echo(line)
        self._append(line)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self.ended(exc)

    def ended(self, exc: BaseException) -> None:
        """What stopped the run, in the file only (the caller says it on the console): one
        line for bad input (bigbatch's errors about it are ValueErrors) or Ctrl-C, the
        traceback too for anything unforeseen."""
        if not self.written:
            return
        if isinstance(exc, KeyboardInterrupt):
            said = "interrupted (Ctrl-C); finished epochs are kept for --resume"
        elif isinstance(exc, (ValueError, OutOfMemoryAtMinimumError)):  # bad input, or OOM
            said = f"error: {exc}"  # at micro-batch 1: the message is the fix
        else:
            said = "error:\n" + "".join(traceback.format_exception(exc)).rstrip()
        with contextlib.suppress(OSError):  # a full disk: the run's own error is the one raised
            self._append(said)

    def _append(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        if not self.written:  # each run or resume opens with what a bug report needs first
            text = f"{_versions()}\n{stamp} {text}"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        with os.fdopen(fd, "a", encoding="utf-8") as f:  # whole lines: a kill loses at most one
            f.write(f"{stamp} {text}\n")
        self.written = True


def _versions() -> str:
    from bigbatch import __version__

    return (
        f"bigbatch {__version__}, torch {torch.__version__}, python "
        f"{platform.python_version()} on {platform.system()} {platform.machine()}"
    )


def check_same_config(run_dir: Path, cfg: TrainConfig) -> bool:
    """Whether ``run_dir`` holds a run (its ``config.json``); one of another config than
    ``cfg`` is refused, naming the keys that differ.

    >>> check_same_config(Path("no/such/run"), TrainConfig(data="x"))
    False
    """
    saved_cfg = run_dir / "config.json"
    if not saved_cfg.exists():
        return False
    old = config_from_json(saved_cfg.read_text(), str(saved_cfg))
    diff = sorted(k for k, v in cfg.training_keys().items() if old.training_keys().get(k) != v)
    if diff:
        raise ConfigError(
            f"run folder {run_dir} already holds a run with a different config "
            f"({', '.join(f'{k}: {old.to_dict()[k]!r} -> {cfg.to_dict()[k]!r}' for k in diff[:5])}); "
            "choose another --out folder, or pass the same config to resume"
        )
    return True


def check_run_dir(run_dir: Path, cfg: TrainConfig, resume: bool) -> dict[str, Any] | None:
    """The saved state to resume from, or None for a fresh run; refuses to mix two configs."""
    state_path = run_dir / "last.pt"
    if check_same_config(run_dir, cfg):
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


def checkpoint_state(
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
    ema: Any = None,
) -> dict[str, Any]:
    """What ``last.pt`` holds, copied to host memory now (:func:`host_copy`): everything a
    resumed run needs to end bit-identical. ``epoch`` is the last finished epoch; ``mid`` where
    the epoch in flight stands (windows done, the epoch's loss sums, the random streams), for a
    checkpoint between windows."""
    return host_copy(
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
            "ema": ema.module.state_dict() if ema is not None else {},
        }
    )


def write_epoch_files(
    run_dir: Path,
    state: dict[str, Any],
    best: dict[str, Any] | None,
    history: list[dict[str, Any]],
    cfg: TrainConfig,
) -> None:
    """An epoch's files, off the training thread, in the order a crash between any two leaves
    consistent: ``best.safetensors`` then ``best.json`` (where the epoch improved, ``best`` its
    line), ``last.safetensors``, ``last.pt``, ``history.csv``, ``history.png`` (``cfg``'s task and
    model in its title). ``state`` is :func:`checkpoint_state`'s host copy, ``history``
    the caller's copy of the rows: the training thread changes both next. The weights saved are
    the EMA's where the run keeps one."""
    weights = state["ema"] or state["model"]
    if best is not None:
        write_weights(weights, run_dir / "best.safetensors")
        atomic_write_text(run_dir / "best.json", json.dumps(best))
    write_weights(weights, run_dir / "last.safetensors")
    save_state(state, run_dir / "last.pt")
    write_history(history, run_dir / "history.csv")
    title = f"{cfg.model_name} @ {cfg.size}"
    plot_history(history, run_dir / "history.png", cfg.task, title)


def config_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML that ``bigbatch train`` takes back: ``bigbatch train
    RUN/config.toml --out runs/again`` trains the same run (every value a scalar).

    >>> from bigbatch.train.config import TrainConfig
    >>> config_toml(TrainConfig(data="images")).splitlines()[2]
    'task = "classification"'
    """
    lines = ["# written by bigbatch train: feed it back with `bigbatch train config.toml`", ""]
    for key, value in cfg.to_dict().items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def write_run_files(
    run_dir: Path,
    cfg: TrainConfig,
    task: Any,
    plan_info: dict[str, Any],
    items: tuple[Any, Any] | None = None,
) -> None:
    """config.json and .toml, classes.json, task.json, plan.json, and ``split.json``: the
    samples trained on and those held out for validation (to score or tune by hand)."""
    atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=1))
    atomic_write_text(run_dir / "config.toml", config_toml(cfg))
    atomic_write_text(run_dir / "classes.json", json.dumps(task.classes))
    info = task.run_info()
    package = task_entry(cfg.task).package
    if package:  # a plug-in's run: a machine without it names the package to install
        info = {**info, "package": package}
    atomic_write_text(run_dir / "task.json", json.dumps(info, indent=1))
    atomic_write_text(run_dir / "plan.json", json.dumps(plan_info, indent=1))
    if items is not None:
        split = {"train": task.sample_names(items[0]), "valid": task.sample_names(items[1])}
        if split["train"] or split["valid"]:
            atomic_write_text(run_dir / "split.json", json.dumps(split, indent=1))


def measured_as(whole_process: bool) -> str:
    """What a measured peak is (:func:`bigbatch.device.peak_memory_bytes`' second value)."""
    return "process peak resident" if whole_process else "allocator reserved peak"


def add_to_plan(run_dir: Path, values: dict[str, Any]) -> dict[str, Any]:
    """``plan.json`` with ``values`` added, written back atomically; the whole plan."""
    path = run_dir / "plan.json"
    plan = json.loads(path.read_text()) | values
    atomic_write_text(path, json.dumps(plan, indent=1))
    return dict(plan)


def record_measured_peak(run_dir: Path, device: torch.device, log: Any) -> None:
    """plan.json gets the measured peak beside the predicted one, and the log a line with
    both: each run is a data point for the memory model. On a GPU the allocator's reserved
    peak against the step's prediction; on a CPU the process's peak resident memory against
    the prediction plus the planned overhead."""
    measured = peak_memory_bytes(device)
    plan = json.loads((run_dir / "plan.json").read_text())
    if measured is None or not plan.get("predicted_peak_bytes"):
        return
    peak, with_overhead = measured
    step, overhead = plan["predicted_peak_bytes"], plan["overhead_bytes"] or 0
    predicted = step + overhead * with_overhead
    what = measured_as(with_overhead)
    values = {"measured_peak_bytes": peak, "measured": what, "compared_prediction_bytes": predicted}
    add_to_plan(run_dir, values)
    log(f"memory: {compare_peaks(step, overhead, peak, with_overhead, plan['budget_bytes'])}")


def compare_peaks(
    step_bytes: int, overhead_bytes: int, peak_bytes: int, whole_process: bool, budget_bytes: int
) -> str:
    """A measured peak set against the prediction of the same thing, in words: the allocator's
    reserved peak against the step's prediction (CUDA); the process's resident peak against the
    step plus the planned overhead (a CPU); and where the budget is the step's alone
    (overhead 0), the process's peak said apart, not as a budget blown.

    >>> compare_peaks(100 * 2**20, 0, 1024 * 2**20, True, 200 * 2**20)
    'the step predicted 100.0 MiB under a budget of 200.0 MiB for the step alone (overhead=0); the process peaked at 1.00 GiB resident, the interpreter, libraries and data included, which that budget leaves out'
    """
    fmt = format_bytes
    if not whole_process:
        return (
            f"the step's allocator peak {fmt(peak_bytes)} reserved, predicted {fmt(step_bytes)}, "
            f"budget {fmt(budget_bytes)}"
        )
    if overhead_bytes:
        return (
            f"the process's peak {fmt(peak_bytes)} resident, predicted "
            f"{fmt(step_bytes + overhead_bytes)} (the step {fmt(step_bytes)} + overhead "
            f"{fmt(overhead_bytes)}), budget {fmt(budget_bytes)} for the whole process"
        )
    return (
        f"the step predicted {fmt(step_bytes)} under a budget of {fmt(budget_bytes)} for the "
        f"step alone (overhead=0); the process peaked at {fmt(peak_bytes)} resident, the "
        "interpreter, libraries and data included, which that budget leaves out"
    )
