"""The training process around the loop: device, precision, threads and data-loading workers,
the torchrun process group, and what the model's layers allow (BatchNorm, lone samples)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigbatch.device import (
    auto_device,
    auto_precision,
    cap_cuda_allocator,
    describe_device,
    device_kind,
    emulates_bf16,
    idle_gpus_note,
)
from bigbatch.inexact import find_inexact_layers, freeze_batchnorm
from bigbatch.io import read_json
from bigbatch.memory.budget import format_bytes
from bigbatch.train.config import ConfigError, TrainConfig, check_device

__all__ = [
    "cap_to_budget",
    "check_no_lone_sample",
    "device_for_rank",
    "distributed_sampler",
    "inference_precision",
    "init_distributed",
    "note_inexact",
    "place_model",
    "process_cores",
    "resolve_device",
    "resolve_precision",
    "resolve_threads",
    "run_device",
    "slow_data_fix",
    "threads_for_run",
    "train_mode",
    "training_threads",
    "wrap_ddp",
]

Log = Callable[[str], None]


def resolve_device(name: str, what: str = "device") -> torch.device:
    """``auto`` (cuda, then mps, then cpu), or a device this machine has (else ConfigError).

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if name != "auto":
        check_device(name, what)
        return torch.device(name)
    return auto_device()


def resolve_precision(precision: str, device: torch.device, log: Log | None = None) -> str:
    """``precision=`` on ``device``: ``auto`` chosen (bf16 where the card computes it, else
    fp16); fp16 on a CPU refused; bf16 where the card emulates it said to ``log``.

    >>> resolve_precision("auto", torch.device("cpu"))
    'fp32'
    """
    if precision == "auto":
        return auto_precision(device)
    if precision == "fp16" and device.type == "cpu":
        raise ConfigError("precision=fp16 needs a GPU; on CPU use fp32 or bf16")
    if precision == "bf16" and log is not None and emulates_bf16(device):
        name = torch.cuda.get_device_name(device)
        log(
            f"note: precision=bf16 on {name}, which has no bfloat16 units (before Ampere): torch "
            "emulates it, several times slower than fp16 in the same memory; precision=fp16 "
            "(or auto) trains at the card's speed"
        )
    return precision


def resolve_threads(cfg: TrainConfig, device: torch.device) -> tuple[int, int]:
    """(torch threads, data-loader workers), chosen rather than left to chance, from this
    process's share of the cores (under torchrun, the cores over ``LOCAL_WORLD_SIZE``).

    torch's default takes every core, and each loader worker wants one too: on a 2-core machine
    that oversubscription took a small run from 45 s to 3 min 44 s. On a CPU run with 2 cores
    or fewer, load in the training process and give torch every core; with more, a quarter of
    the cores (at most 4) load and the rest compute. On a GPU the model runs on the device, and
    decoding and augmenting images is the host's work: every core but one loads (at most 16;
    4 loaders fed an H100 at 0.56x a hand-written loop with 8), and the training process keeps
    what is left, so its threads do not compete with the workers.

    >>> from bigbatch.train.config import TrainConfig
    >>> threads, workers = resolve_threads(TrainConfig(threads=2, num_workers=0), torch.device("cpu"))
    >>> (threads, workers)
    (2, 0)
    """
    cores = process_cores()
    workers = cfg.num_workers
    if workers < 0:
        if device.type == "cpu":
            workers = 0 if cores <= 2 else min(4, cores // 4)
        else:
            workers = min(16, max(1, cores - 1))
    threads = cfg.threads or max(1, cores - workers)
    return threads, workers


def process_cores() -> int:
    """The cores this process may use: its affinity, shared among torchrun's local ranks."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def slow_data_fix(workers: int, device: torch.device) -> str:
    """What to do when a run on ``device`` waits for its loader ('' on a CPU run, whose
    loading and training share the cores)."""
    if device.type == "cpu":
        return ""
    cores = process_cores()
    if workers < cores - 1:
        return f"raise num_workers (now {workers}; this process has {cores} cores)"
    return (
        f"all {cores} cores load already: store the images at the training size, or train "
        "on a machine with more cores per GPU"
    )


def training_threads() -> int:
    """The torch threads `bigbatch train` takes for a CPU run here, with its defaults: what a
    plan for it must be calibrated with (CPU workspaces grow with the threads), whatever this
    process's own setting (OMP_NUM_THREADS) is."""
    return resolve_threads(TrainConfig(), torch.device("cpu"))[0]


def threads_for_run(
    cfg: TrainConfig, device: torch.device, run_dir: Path, state: Any, log: Log
) -> tuple[int, int]:
    threads, workers = resolve_threads(cfg, device)
    saved_plan = run_dir / "plan.json"
    if state is not None and saved_plan.exists():
        # The thread and worker counts change the last bits (reductions, worker RNG streams):
        # a resumed run keeps the ones it started with, to end bit-identical.
        saved = read_json(
            saved_plan,
            "bigbatch train wrote it at the run's start; restore it from a copy, or delete it "
            "to resume with this machine's threads and workers (the last bits may differ)",
        )
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


def init_distributed(cfg: TrainConfig) -> tuple[int, int]:
    """(rank, world size): joins the process group torchrun describes, if there is one."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group(device_kind(resolve_device(cfg.device)).distributed_backend)
    return dist.get_rank(), dist.get_world_size()


def wrap_ddp(core: nn.Module) -> nn.Module:
    """DDP without buffer syncs in forward (newer torch names the option forward_sync_buffers)."""
    import inspect

    ddp = nn.parallel.DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:
        return ddp(core, forward_sync_buffers=False)
    return ddp(core, broadcast_buffers=False)


def note_inexact(core: nn.Module, cfg: TrainConfig, log: Log) -> bool:
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


def check_no_lone_sample(n_train: int, rank_batch: int, world: int, log: Log) -> None:
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


def train_mode(model: nn.Module, cfg: TrainConfig) -> None:
    model.train()
    if cfg.freeze_bn:
        freeze_batchnorm(model)


def run_device(cfg: TrainConfig, rank: int, world: int, log: Log) -> tuple[torch.device, str]:
    """A run's device (this rank's under torchrun) and the precision it computes in, said in
    the log first: which GPU, or the CPU where ``device=auto`` found none."""
    device = device_for_rank(cfg.device, rank, world)
    notes: list[str] = []  # a note on the precision reads after the device it is about
    precision = resolve_precision(cfg.precision, device, notes.append)
    log(f"device: {describe_device(device, auto=cfg.device == 'auto')}, {precision}")
    for note in notes:
        log(note)
    if rank == 0 and (note := idle_gpus_note(device, world)):
        log(note)
    return device, precision


def device_for_rank(name: str, rank: int, world: int) -> torch.device:
    """The configured device; under torchrun on GPUs, this rank's own (``LOCAL_RANK``)."""
    device = resolve_device(name)
    if world > 1 and device_kind(device).per_rank_device:
        device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", rank)))
    return device


def place_model(
    model: nn.Module, channels_last: str, device: torch.device
) -> tuple[nn.Module, torch.memory_format]:
    """The model on ``device``, NHWC where it helps (convolutions on a GPU: tensor cores want
    it; opt-in elsewhere with channels_last=true); returns the memory format inputs take."""
    model = model.to(device)
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    pays = device_kind(device).channels_last and has_conv
    if channels_last == "true" or (channels_last == "auto" and pays):
        return model.to(memory_format=torch.channels_last), torch.channels_last
    return model, torch.contiguous_format


def inference_precision(precision: str, device: torch.device) -> str:
    """A trained run's ``precision=`` for its forward passes without gradients on ``device``,
    which may not be the one it trained on: its autocast, as its validation ran, except fp16 on
    a CPU (a run trained on a GPU, predicted on a laptop), which has no fp16 autocast worth
    running: fp32 there.

    >>> inference_precision("fp16", torch.device("cpu")), inference_precision("bf16", torch.device("cpu"))
    ('fp32', 'bf16')
    """
    if precision == "fp16" and device.type == "cpu":
        return "fp32"
    return resolve_precision(precision, device)


def distributed_sampler(dataset: Any, rank: int, world: int, seed: int) -> Any:
    """This rank's share of each epoch under torchrun (None on one process)."""
    if world <= 1:
        return None
    from torch.utils.data.distributed import DistributedSampler

    return DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)


def cap_to_budget(cfg: TrainConfig, device: torch.device, choice: Any, log: Log) -> float | None:
    """An explicit ``budget=`` on CUDA is a cap, not only a plan: the allocator may hold the
    budget less the CUDA context the plan kept out, so the run never takes more of the card
    (a bigger or shared one too), and a step the prediction underestimated runs out of memory
    there, where the OOM back-off retries it with the same update. ``budget=auto`` (the free
    memory) caps nothing. Returns the fraction to put back after the run, None if uncapped."""
    if cfg.budget.strip().lower() == "auto" or not choice.budget_bytes:
        return None
    capped = cap_cuda_allocator(device, choice.budget_bytes - (choice.overhead_bytes or 0))
    if capped is None:
        return None
    cap, before = capped
    log(
        f"memory: this process's CUDA allocator capped at {format_bytes(cap)} (budget "
        f"{format_bytes(choice.budget_bytes)} less the {format_bytes(choice.overhead_bytes or 0)} "
        "CUDA context): past it the back-off shrinks the micro-batch"
    )
    return before
