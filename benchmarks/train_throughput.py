"""Throughput of `bigbatch train` against a hand-written timm training loop.

Both train the same timm model on the same generated image folder, with the same transforms
(bigbatch's own), micro-batch, accumulation, optimizer, schedule, threads and data loading
(in-process), evaluate on the same validation images after every epoch and save checkpoints
after it (the hand loop best.pt and last.pt with torch.save, unless `--no-hand-checkpoints`;
bigbatch its own, written off the training thread). bigbatch also plans (one fake-tensor step
for a fixed micro-batch), scans the images, writes history.csv and the plot: that is its
overhead. Runs are paired and alternated in one process; `ratio_vs_hand_loop` is the median of
hand / bigbatch seconds per epoch (training and validation: the loop; 1.0 is as fast, the
target >= 0.97) and `whole_run_ratio` the same for whole runs, bigbatch's fixed costs
included; `first_step_seconds` those fixed costs apart (the time to each loop's first
optimizer step), and `fraction_of_loaderless` each loop's last epoch against the step alone
with its batch already on the device (`loaderless_images_per_s`).

    python benchmarks/train_throughput.py            # resnet10t at 32 px, 768 images, 2 epochs
    python benchmarks/train_throughput.py --json     # {"ratio_vs_hand_loop": ..., ...}

On a GPU (``--device cuda``) the hand loop is the one a Kaggle practitioner writes for speed:
a DataLoader with ``--workers`` persistent, pinned workers, ``non_blocking`` copies,
channels_last, autocast and GradScaler; bigbatch train runs with its defaults (workers,
threads, pinning chosen for the machine). The default GPU workload is the one issue 35
measured: resnet50 at 224 px, batch 128, fp16, 3000 JPEGs of 256 px in 10 classes:

    python benchmarks/train_throughput.py --device cuda --precision fp16 --arch resnet50 \
        --size 224 --batch 128 --micro 128 --classes 10 --per-class 300 --stored-size 256 \
        --format jpg --epochs 3 --workers 8

Where the loader limits (JPEGs of 512 px, 4 cores: ``--stored-size 512 --workers 4
--same-workers``), ``decode=auto`` moves decoding to the GPU after the first epoch and keeps
it where the next epoch was faster; its lines (``decode_said``) give the figures it measured,
and ``--decode cpu|gpu`` fixes either path.

Steady state (``--passes N``): each epoch trains on the training images N times over, in both
loops, so that an epoch of tens of thousands of images dwarfs what starts it (workers, the first
kernels, validation); the scan is then outside bigbatch's run, as it is outside the hand loop's
epochs. ``--profile`` says where each loop's host time goes (``split_seconds``: waiting for
data, the steps, validation, checkpoints and plots).

A user's command pays what a run inside this process does not (its imports are made once, by
the warm-up): ``--from-command`` runs each loop once more in a process of its own and reports
the seconds from that process's start to its first optimizer step and to its end
(``from_command``; ``--rounds 0 --from-command``: those alone).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import bigbatch.train.stepping as stepping
from bigbatch.train.config import load_config
from bigbatch.train.data import split_items
from bigbatch.train.loop import train
from bigbatch.train.tasks.classification.data import (
    ImageDataset,
    build_transforms,
    load_items,
    resolve_data_config,
)


def write_images(
    root: Path, per_class: int, size: int, classes: int = 3, suffix: str = "png"
) -> None:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, (size, size, 3))
            pixels[..., c % 3] += 150
            Image.fromarray(pixels.astype(np.uint8)).save(root / f"class{c}" / f"{i}.{suffix}")


@dataclass(frozen=True)
class Device:
    """Where both loops train, and how the hand loop feeds it."""

    name: str = "cpu"
    precision: str = "fp32"
    workers: int = 0  # the hand loop's loader workers (bigbatch chooses its own on a GPU)
    # With ``--same-workers``, bigbatch's too (a machine with that many cores per GPU: a Kaggle
    # notebook's 4); and bigbatch's ``decode=`` (auto: its own choice, measured).
    same_workers: bool = False
    decode: str = "auto"
    # Steady state: each epoch trains on the training files this many times over (the same
    # files, read again), so an epoch is long enough that the loaders' start, the first
    # kernels and validation are a small part of it; both loops alike.
    passes: int = 1

    @property
    def gpu(self) -> bool:
        return self.name != "cpu"

    def sync(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()


CPU = Device()


def split_for(data: Path, dev: Device) -> tuple[Any, Any]:
    """The images' seeded split (both loops': the same files), the training items repeated
    ``dev.passes`` times."""
    train_items, valid_items = split_items(load_items(str(data)), 0.2, 42)
    if dev.passes > 1:
        train_items = train_items.subset(list(range(len(train_items))) * dev.passes)
    return train_items, valid_items


class Workload(NamedTuple):
    """What both loops train: the timm model, the image side, the batch and micro-batch."""

    arch: str
    size: int
    batch: int
    micro: int
    epochs: int


def hand_loop(
    data: Path, work: Workload, dev: Device = CPU, out: Path | None = None
) -> tuple[float, list[float]]:
    """The loop a practitioner writes: timm model, AdamW, OneCycle, `loss / N` accumulation;
    on a GPU with persistent pinned workers, channels_last, cuDNN's benchmark mode, autocast,
    GradScaler and torch's fused AdamW (Trainer's default, and bigbatch train's on a card).
    With ``out``, the checkpoints such a loop saves after each epoch's validation, as
    bigbatch's run does its own: ``best.pt`` (the weights, where the validation loss improved)
    and ``last.pt`` (weights, optimizer and schedule), with torch.save."""
    import timm

    arch, size, batch, micro, epochs = work
    t0 = time.perf_counter()
    torch.backends.cudnn.benchmark = dev.gpu  # as timm's train.py (bigbatch's auto: the same)
    train_items, valid_items = split_for(data, dev)
    torch.manual_seed(42)
    model = timm.create_model(arch, num_classes=len(train_items.classes))
    # The model's own data config (timm's resolve_model_data_config: resnet50's bicubic
    # resizing, its mean and std), as a timm user's loop and bigbatch's both take it.
    data_config = resolve_data_config(lambda: timm.create_model(arch))
    train_ds = ImageDataset(
        train_items.files,
        train_items.labels,
        build_transforms(size, "squish", train=True, augment=True, data=data_config),
    )
    valid_ds = ImageDataset(
        valid_items.files,
        valid_items.labels,
        build_transforms(size, "squish", train=False, augment=False, data=data_config),
    )
    fmt = torch.channels_last if dev.gpu else torch.contiguous_format
    model = model.to(dev.name, memory_format=fmt)
    steps = epochs * -(-len(train_ds) // batch)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, weight_decay=0.01, fused=True if dev.gpu else None
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps)
    accum = -(-batch // micro)
    dtype, scaler = amp_for(dev)
    feed: dict[str, Any] = {"num_workers": dev.workers, "pin_memory": dev.gpu}
    feed["persistent_workers"] = dev.workers > 0
    loader = torch.utils.data.DataLoader(train_ds, batch_size=batch, shuffle=True, **feed)
    valid_loader = torch.utils.data.DataLoader(valid_ds, batch_size=2 * micro, **feed)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.to(dev.name, non_blocking=True, memory_format=fmt)
        with torch.autocast(dev.name, dtype=dtype or torch.float32, enabled=dtype is not None):
            return F.cross_entropy(model(x), y.to(dev.name, non_blocking=True))

    # A function each, so that a profile (--profile) says where the time goes, as bigbatch's
    # step_window and evaluate do.
    def train_window(x: torch.Tensor, y: torch.Tensor) -> None:
        for xm, ym in zip(x.split(micro), y.split(micro), strict=True):
            loss = loss_of(xm, ym) / accum
            (scaler.scale(loss) if scaler else loss).backward()
        optimizer_step(opt, scaler)
        sched.step()

    def validate() -> float:
        model.eval()
        total = torch.zeros((), device=dev.name)
        with torch.no_grad():
            for x, y in valid_loader:
                total += loss_of(x, y).float() * len(y)
        return float(total)  # one read, after the last batch

    def save_checkpoints(valid_loss: float, best: float) -> None:
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        if valid_loss < best:
            torch.save(model.state_dict(), out / "best.pt")
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        torch.save(state | {"scheduler": sched.state_dict()}, out / "last.pt")

    epoch_s: list[float] = []
    first_step_s = None
    best = float("inf")
    for _ in range(epochs):
        e0 = time.perf_counter()
        model.train()
        for x, y in loader:
            train_window(x, y)
            if first_step_s is None:
                dev.sync()
                first_step_s = time.perf_counter() - t0
        valid_loss = validate()
        epoch_s.append(time.perf_counter() - e0)
        save_checkpoints(valid_loss, best)  # after the epoch's time, as bigbatch's
        best = min(best, valid_loss)
    FIRST_STEP["hand"] = first_step_s or 0.0
    return time.perf_counter() - t0, epoch_s


def bigbatch_run(
    data: Path, out: Path, work: Workload, dev: Device = CPU, said: list[str] | None = None
) -> tuple[float, list[float]]:
    """One ``bigbatch train`` run with its defaults; ``said`` collects its ``decode:`` lines
    (where ``decode=auto`` chose to decode the JPEGs and, after a move to the GPU, whether it
    kept it, with the measured figures)."""
    overrides = [f"data={data}", f"arch={work.arch}", f"size={work.size}", f"batch={work.batch}"]
    overrides += [f"micro_batch={work.micro}", f"epochs={work.epochs}", "mode=fit", "log_every=0"]
    overrides += [f"device={dev.name}", f"precision={dev.precision}"]
    if not dev.gpu:  # the CPU comparison: the same threads, loading in-process
        overrides += ["num_workers=0", f"threads={torch.get_num_threads()}"]
    elif dev.same_workers:
        overrides += [f"num_workers={dev.workers}"]
    overrides += [f"decode={dev.decode}"] if dev.gpu else []
    cfg = load_config(overrides=overrides)
    t0 = time.perf_counter()

    def log(line: str) -> None:
        if said is not None and line.startswith("decode:"):
            said.append(line)

    # The command's fixed costs (scan, plan, model, workers): the time to its first optimizer
    # step, read where the loop's first window returns.
    real_window = stepping.run_window
    first: list[float] = []

    def timed_window(*args: Any, **kwargs: Any) -> Any:
        result = real_window(*args, **kwargs)
        if not first:
            dev.sync()
            first.append(time.perf_counter() - t0)
        return result

    # Steady state: the same repeated items as the hand loop's (the scan, a fixed cost, is
    # skipped then, as the hand loop's own is outside its epochs).
    items = split_for(data, dev) if dev.passes > 1 else None
    stepping.run_window = timed_window  # type: ignore[assignment]
    try:
        result = train(cfg, out, log=log, progress=False, data=items)
    finally:
        stepping.run_window = real_window
    FIRST_STEP["bigbatch"] = first[0] if first else 0.0
    # Each epoch's seconds in history.csv: training and validation, as the hand loop's.
    return time.perf_counter() - t0, [float(row["seconds"]) for row in result.history]


PROFILED_STAGES = {
    "_setup", "plan_for", "plan_validation", "_train_epoch", "step_window", "_finish_epoch",
    "checkpoint_state", "write_epoch_files", "wait",
}  # fmt: skip
FIRST_STEP: dict[str, float] = {}  # each loop's last run: seconds to its first optimizer step


def child_argv(args: argparse.Namespace) -> list[str]:
    """The workload's flags, for a run of one loop in a process of its own (``--child``)."""
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "arch", "size", "batch", "micro", "epochs", "device", "precision", "workers", "decode",
        "classes", "passes",
    )]  # fmt: skip
    argv += ["--same-workers"] if args.same_workers else []
    return [*argv, "--hand-checkpoints" if args.hand_checkpoints else "--no-hand-checkpoints"]


def from_command(loop: str, argv: list[str], data: Path, out: Path) -> dict[str, float]:
    """One run of ``loop`` in a process of its own, as a user's command starts it: seconds
    from the process's start to its first optimizer step and to its end, its imports
    included (torch and timm for the hand loop, with the transforms it shares from bigbatch;
    bigbatch's too for `bigbatch train`, whose setup imports torchmetrics)."""
    start = time.time()
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--child", loop, "--data-dir", str(data),
         "--child-out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"the {loop} run in its own process failed: {done.stderr[-1500:]}")
    child = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "to_first_step": round(child["first_step_at"] - start, 2),
        "to_end": round(child["end_at"] - start, 2),
    }


def run_child(loop: str, data: Path, out: Path, work: Workload, dev: Device) -> None:
    """``--child``: one run of ``loop``, printing when its first optimizer step and its end
    came (seconds since the epoch, for the parent that started this process)."""
    w0 = time.time()
    if loop == "hand":
        hand_loop(data, work, dev, out)
    else:
        bigbatch_run(data, out, work, dev)
    end = time.time()
    print(json.dumps({"first_step_at": w0 + FIRST_STEP[loop], "end_at": end}))


def amp_for(dev: Device) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """Autocast's dtype (None: fp32) and fp16's GradScaler, as both loops train."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dev.precision)
    return dtype, torch.amp.GradScaler(dev.name) if dev.precision == "fp16" else None


def optimizer_step(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """The optimizer's step (through fp16's scaler) and the gradients cleared."""
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def loaderless_images_per_s(
    arch: str,
    size: int,
    micro: int,
    dev: Device,
    steps: int,
    *,
    warmup: int = 3,
    fused: bool | None = None,
) -> float:
    """The step alone, its batch already on the device (channels_last and autocast on a GPU, as
    both loops): the images per second no loader can beat, that each loop is a fraction of.
    ``fused``: torch's fused AdamW (default: on a GPU, as both loops) or the multi-tensor one."""
    import timm

    fmt = torch.channels_last if dev.gpu else torch.contiguous_format
    model = timm.create_model(arch, num_classes=10).to(dev.name, memory_format=fmt)
    fused = dev.gpu if fused is None else fused
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True if fused else None)
    dtype, scaler = amp_for(dev)
    x = torch.randn(micro, 3, size, size, device=dev.name).to(memory_format=fmt)
    y = torch.randint(0, 10, (micro,), device=dev.name)

    def step() -> None:
        with torch.autocast(dev.name, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        optimizer_step(opt, scaler)

    for _ in range(warmup):
        step()
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dev.sync()
    return steps * micro / (time.perf_counter() - t0)


def profile_of(run: Any) -> dict[str, Any]:
    """Where one run's main thread spends its time (cProfile): the seconds spent waiting for the
    loader's next batch, and the functions with the most time of their own. On a GPU the
    kernels run beside it: what shows here is the host's share (waits, reads, Python)."""
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = [
        (tottime, cumtime, calls, f"{Path(file).name}:{line}({func})")
        for (file, line, func), (_, calls, tottime, cumtime, _) in stats.items()
    ]
    waits = [cum for _, cum, _, name in rows if "dataloader.py" in name and "(__next__)" in name]
    rows.sort(reverse=True)
    # bigbatch's own stages, each the time under it (the hand loop has none of these).
    stages = {
        name.split("(")[1][:-1]: round(cum, 3)
        for _, cum, _, name in rows
        if name.startswith(("loop.py:", "planning.py:", "checkpoint.py:", "io.py:", "run_dir.py:"))
        and name.split("(")[1][:-1] in PROFILED_STAGES
    }

    def under(*names: str) -> float:
        """The seconds under the functions of these names (their cumulative time)."""
        return round(sum(cum for _, cum, _, name in rows if name.split("(")[1][:-1] in names), 3)

    return {
        "seconds": round(sum(r[0] for r in rows), 2),
        # Where the time goes, each loop's own functions (the hand loop's train_window and
        # validate; bigbatch's step_window, the task's evaluate, the run folder's files). The
        # loaders' waits are inside the epoch (training's) and inside validation (its own).
        "split_seconds": {
            "data_wait": round(max(waits, default=0.0), 3),
            "step": under("train_window", "step_window"),
            "validation": under("validate", "evaluate"),
            # The hand loop's torch.save calls; bigbatch's host copies and its wait for the
            # last files at the end (io.py's BackgroundWriter.wait), the writes running beside.
            "checkpoints_and_plots": round(
                under("save_checkpoints", "checkpoint_state") + stages.get("wait", 0), 3
            ),
        },
        "stages_seconds": stages,
        "top_own_time": [
            {"seconds": round(t, 3), "calls": n, "function": name} for t, _, n, name in rows[:25]
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", default="resnet10t")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--per-class", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--workers", type=int, default=8, help="the hand loop's workers on a GPU")
    p.add_argument("--same-workers", action="store_true", help="bigbatch loads with --workers too")
    p.add_argument("--decode", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--stored-size", type=int, default=0, help="the images' side (default: --size)")
    p.add_argument("--format", default="png", choices=["png", "jpg"])
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="steady state: each epoch trains on the training images this many times over "
        "(both loops; the scan is then outside bigbatch's run, as it is the hand loop's)",
    )
    p.add_argument(
        "--limit-steps",
        type=int,
        default=10,
        help="steps timed for the loader-less limit (the step alone, its batch on the device)",
    )
    p.add_argument(
        "--hand-checkpoints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the hand loop saves best.pt and last.pt after each epoch, as bigbatch saves its "
        "own (the same work in both whole runs); --no-hand-checkpoints: it saves none",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="then one run of each under cProfile (alone: --rounds 0)",
    )
    p.add_argument(
        "--from-command",
        action="store_true",
        help="then one run of each in a process of its own: seconds from its start (imports "
        "included) to the first optimizer step and to the end (`from_command`)",
    )
    p.add_argument("--child", choices=["hand", "bigbatch"], help=argparse.SUPPRESS)
    p.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)  # the child's images
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    workers = args.workers if args.device != "cpu" else 0
    if args.passes < 1:
        p.error("--passes must be 1 or more")
    dev = Device(args.device, args.precision, workers, args.same_workers, args.decode, args.passes)
    if args.child:
        shape = Workload(args.arch, args.size, args.batch, args.micro, args.epochs)
        out = args.child_out if args.child == "bigbatch" or args.hand_checkpoints else None
        run_child(args.child, args.data_dir, out, shape, dev)
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "images"
        stored = args.stored_size or args.size
        write_images(data, args.per_class, stored, args.classes, args.format)
        shape = Workload(args.arch, args.size, args.batch, args.micro, args.epochs)
        hand_loop(data, shape, dev)  # warm-up: imports, kernel choices, file cache
        ratios, epoch_ratios, hand_s, ours_s = [], [], [], []
        first_steps: dict[str, list[float]] = {"hand": [], "bigbatch": []}
        steady_ratios: list[float] = []
        said: list[str] = []
        epochs_s: dict[str, list[list[float]]] = {"hand": [], "bigbatch": []}
        for r in range(args.rounds):
            hand_out = Path(tmp) / f"hand{r}" if args.hand_checkpoints else None
            h, h_epochs = hand_loop(data, shape, dev, hand_out)
            b, b_epochs = bigbatch_run(data, Path(tmp) / f"run{r}", shape, dev, said)
            hand_s.append(h)
            ours_s.append(b)
            for loop in first_steps:
                first_steps[loop].append(FIRST_STEP[loop])
            ratios.append(h / b)
            epoch_ratios += [x / y for x, y in zip(h_epochs, b_epochs, strict=True)]
            steady_ratios += [x / y for x, y in zip(h_epochs[1:], b_epochs[1:], strict=True)]
            epochs_s["hand"].append([round(x, 3) for x in h_epochs])
            epochs_s["bigbatch"].append([round(x, 3) for x in b_epochs])
        limit = 0.0
        if args.rounds:
            limit = loaderless_images_per_s(args.arch, args.size, args.micro, dev, args.limit_steps)
        commands = {}
        if args.from_command:
            for loop in ("hand", "bigbatch"):
                out = Path(tmp) / f"{loop}-command"
                commands[loop] = from_command(loop, child_argv(args), data, out)
        profiles = {}
        if args.profile:
            hand_out = Path(tmp) / "hand-profiled" if args.hand_checkpoints else None
            profiles["hand"] = profile_of(lambda: hand_loop(data, shape, dev, hand_out))
            out = Path(tmp) / "profiled"
            profiles["bigbatch"] = profile_of(lambda: bigbatch_run(data, out, shape, dev))
    images = args.classes * args.per_class * args.passes  # trained per epoch, / 0.8
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "precision": args.precision,
        "workload": f"{args.arch} @ {args.size} px, {images} images, "
        f"batch {args.batch} = {-(-args.batch // args.micro)} x {args.micro}, {args.epochs} epochs"
        + (f", each the training images {args.passes} times over" if args.passes > 1 else ""),
    }
    if profiles:
        result["profile"] = profiles
    if commands:  # each loop from its own process's start: what a user's command waits
        h, b = commands["hand"], commands["bigbatch"]
        result["from_command"] = {
            **commands,
            "first_step_ratio": round(h["to_first_step"] / b["to_first_step"], 3),
            "whole_run_ratio": round(h["to_end"] / b["to_end"], 3),
        }
    if not args.rounds:  # --rounds 0 --profile: where the time goes, nothing timed side by side
        print(json.dumps(result, indent=1))
        return
    result |= {
        # Training images per second of an epoch (training and validation), the median.
        "images_per_s": {
            "hand": round(0.8 * images / statistics.median(h_epochs), 1),
            "bigbatch": round(0.8 * images / statistics.median(b_epochs), 1),
        },
        "rounds": args.rounds,
        "median_seconds": {
            "hand": statistics.median(hand_s),
            "bigbatch": statistics.median(ours_s),
        },
        # The loop: an epoch of training and validation, bigbatch's against the hand loop's.
        "ratio_vs_hand_loop": statistics.median(epoch_ratios),
        # The same after each run's first epoch (workers and kernels started): the pipeline's.
        "steady_ratio": statistics.median(steady_ratios) if steady_ratios else None,
        "epoch_seconds": epochs_s,
        # The whole run, with bigbatch's fixed costs (scan, plan check, plots), both loops'
        # checkpoints (unless --no-hand-checkpoints).
        "whole_run_ratio": statistics.median(ratios),
        "hand_loop_checkpoints": args.hand_checkpoints,
        # The fixed costs apart: from the start to the first optimizer step.
        "first_step_seconds": {k: round(statistics.median(v), 3) for k, v in first_steps.items()},
        # The step alone, its batch on the device; each loop's epochs as a fraction of it (the
        # target on a GPU: bigbatch >= 0.9 where decoding can feed it).
        "loaderless_images_per_s": round(limit, 1),
        "fraction_of_loaderless": {
            loop: round(0.8 * images / statistics.median(r[-1] for r in runs) / limit, 3)
            for loop, runs in epochs_s.items()
        },
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # decode=auto's choice in each run, with the figures it measured in the first epoch.
        "decode_said": said,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(result["workload"])
    print(
        f"per epoch: ratio {result['ratio_vs_hand_loop']:.3f} (hand / bigbatch; 1.0 is as fast)\n"
        f"whole run: hand loop {result['median_seconds']['hand']:.2f} s, bigbatch train "
        f"{result['median_seconds']['bigbatch']:.2f} s, ratio {result['whole_run_ratio']:.3f}"
    )


if __name__ == "__main__":
    main()
