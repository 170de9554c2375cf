"""Where a run's training images are decoded and augmented: by the CPU loader workers, or on the
GPU (:mod:`bigbatch.train.tasks.device_images`), chosen by measuring.

``decode=auto`` trains the first epoch with the workers and measures it: the rate at which the
run took windows, and the step's own time on the device (a few windows, timed by
:class:`~bigbatch.device.DeviceClock` without making the host wait). With the workers, the step
waits for the slower of the two (they work in parallel); on the GPU, decoding and the step share
the device, so their times add. Where the workers kept up with the step, nothing more is done.
Where they fell behind, the GPU is timed decoding and augmenting a window of the training files,
and where the sum of the times beats the workers' rate by :data:`MARGIN`, the next epoch decodes
on the GPU, measured the same way: where it took windows more slowly than the workers had
delivered them (the estimate leaves out what the two paths do beside decoding), the run goes
back to the workers. Each decision is logged with its figures. A resumed run measures again in
its first epoch.

>>> round(expected_rate(step_seconds=1 / 4000, decode_seconds=1 / 3000))
1714
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.batching import batch_len
from bigbatch.device import DeviceClock, decodes_jpeg, synchronize
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.optim import phases
from bigbatch.train.tasks.device_images import collate_encoded

__all__ = ["MARGIN", "DecodeChoice", "decode_choice", "expected_rate"]

Log = Callable[[str], None]

# The GPU path must promise this much more than the workers delivered: the first epoch's rate
# is measured while the workers warm up, and the choice holds for the rest of the run.
MARGIN = 1.1
STEPS_TIMED = 8  # windows whose step is timed alone (the first, with its autotuning, is not)
PROBE_SAMPLES = 64  # training images decoded on the GPU to time it


def expected_rate(step_seconds: float, decode_seconds: float) -> float:
    """Samples/s on the GPU path, from the step's and the decoding's seconds per sample (they
    share the device, so they add); the CPU path's is measured (the workers' pace, or the
    step's where that is slower)."""
    return 1.0 / (step_seconds + decode_seconds)


@dataclass
class DecodeChoice:
    """A run's decoding path: ``on_device`` once chosen (``decode=gpu``, or ``auto`` after the
    first epoch's measurement); ``images`` and ``augment`` are the task's pair (None where its
    images cannot be decoded on the device). :meth:`timed` wraps a measured epoch's windows."""

    device: torch.device
    images: Any = None
    augment: Any = None
    on_device: bool = False
    pending: bool = False  # auto, and not yet measured
    log: Log = print
    epochs: int = 0  # the run's epochs, all phases: the last one is not measured for nothing
    trial: bool = False  # auto chose the GPU: its first epoch is measured against the workers
    cpu_rate: float = 0.0  # samples/s the workers delivered in the measured epoch

    def decoded(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The device path's windows: each batch of files decoded and augmented on the device."""
        augment = self.augment.on(self.device)
        for batch in loader:
            yield augment(batch)

    def measures(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (from 0) is measured: ``auto`` undecided or on trial, and an
        epoch left after it to use what it shows."""
        return (self.pending or self.trial) and epoch + 1 < self.epochs

    def timed(self, windows: Iterable[Any]) -> Iterator[Any]:
        """``windows``, measuring the epoch (acted on when it ends): the rate at which the run
        took them from the second window's arrival on (before it the workers start and the
        first step warms up), and, to choose (a trial needs only the rate), the device's own
        time for the steps of windows 2 to ``STEPS_TIMED + 1`` (nothing waits for it: the
        loader's pace is measured as it is)."""
        start_time: float | None = None
        samples, step_samples = 0, 0
        clock = DeviceClock(self.device)
        for index, window in enumerate(windows):
            n = batch_len(window)
            if index == 1:
                start_time = time.perf_counter()
            elif index > 1:
                samples += n
            timed = not self.trial and 1 <= index <= STEPS_TIMED
            start = clock.now() if timed else None
            yield window
            if timed:
                clock.add(start, clock.now())
                step_samples += n
        if start_time is None or samples == 0 or (step_samples == 0 and not self.trial):
            return  # an epoch too short to measure: the next one is
        rate = samples / max(time.perf_counter() - start_time, 1e-9)
        if self.trial:
            self.judge(rate)
        else:
            self.choose(rate, clock.seconds() / step_samples)

    def choose(self, cpu_rate: float, step_seconds: float) -> None:
        """Decide from the workers' measured rate and the step's seconds per sample. Where the
        workers kept up with the step, no GPU path can beat them (the step alone is slower):
        the decoder is not started to time it."""
        self.pending, self.cpu_rate = False, cpu_rate
        step_rate = 1 / step_seconds
        if MARGIN * cpu_rate >= step_rate:
            self.log(
                f"decode: JPEGs stay with the CPU workers (they delivered {cpu_rate:.0f} "
                f"images/s, the step takes {step_rate:.0f}: the workers keep up)"
            )
            return
        decode_seconds = self.decode_seconds()
        gpu_rate = expected_rate(step_seconds, decode_seconds)
        self.on_device = self.trial = gpu_rate > MARGIN * cpu_rate
        figures = (
            f"the CPU workers delivered {cpu_rate:.0f} images/s, the step takes "
            f"{step_rate:.0f} images/s and the GPU decodes and augments "
            f"{1 / decode_seconds:.0f} images/s, so about {gpu_rate:.0f} images/s on the GPU"
        )
        if self.on_device:
            self.log(f"decode: JPEGs are decoded on the GPU from the next epoch ({figures})")
        else:
            self.log(f"decode: JPEGs stay with the CPU workers ({figures})")

    def judge(self, gpu_rate: float) -> None:
        """After the GPU path's first epoch: keep it where it took windows faster than the
        workers delivered them, else go back to the workers for the rest of the run."""
        self.trial = False
        self.on_device = gpu_rate > self.cpu_rate
        figures = f"{gpu_rate:.0f} images/s on the GPU, {self.cpu_rate:.0f} from the CPU workers"
        if self.on_device:
            self.log(f"decode: JPEGs stay on the GPU ({figures})")
        else:
            self.log(f"decode: JPEGs go back to the CPU workers from the next epoch ({figures})")

    def decode_seconds(self) -> float:
        """Seconds per training image to decode and augment on the device: up to
        :data:`PROBE_SAMPLES` files, the second of two passes (the first starts the decoder).
        Its random draws come from forked generators: the run's own streams are not moved."""
        n = min(PROBE_SAMPLES, len(self.images))
        with torch.random.fork_rng(devices=[]):
            python_state = random.getstate()
            batch = collate_encoded([self.images[i] for i in range(n)])
            random.setstate(python_state)
        augment = self.augment.on(self.device)
        augment(batch)
        synchronize(self.device)
        start = time.perf_counter()
        augment(batch)
        synchronize(self.device)
        return max(time.perf_counter() - start, 1e-9) / n


def decode_choice(
    cfg: TrainConfig, task: Any, train_ds: Any, device: torch.device, world: int, log: Log
) -> DecodeChoice:
    """The run's :class:`DecodeChoice` for ``cfg.decode``: ``gpu`` checked now (a
    :class:`ConfigError` with the fix where it cannot apply), ``auto`` pending where the GPU
    could decode this task's images, else the CPU's workers."""
    pair = task.device_images(train_ds)
    why = pair if isinstance(pair, str) else ""
    if not decodes_jpeg(device):
        why = f"{device.type} has no JPEG decoder torchvision drives (a CUDA GPU has nvJPEG)"
    elif world > 1:
        why = "under torchrun each rank's loader decodes on the CPU"
    if cfg.decode == "gpu" and why:
        raise ConfigError(f"decode=gpu cannot apply: {why}; use decode=auto or decode=cpu")
    choice = DecodeChoice(device, log=log, epochs=sum(n for _, n in phases(cfg)))
    # An explicit budget plans the step's memory alone: auto keeps the windows' pixels off
    # the GPU there (decode=gpu puts them on it when asked).
    if why or cfg.decode == "cpu" or (cfg.decode == "auto" and cfg.budget != "auto"):
        return choice
    choice.images, choice.augment = pair
    choice.on_device = cfg.decode == "gpu"
    choice.pending = cfg.decode == "auto"
    return choice
