"""Progress while training: a rich bar on a terminal, a plain line now and then elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bigbatch.device import peak_memory_text

__all__ = ["Progress", "progress"]

Log = Callable[[str], None]


class Progress:
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


def progress(
    enabled: bool | None, total: int, title: str, *, log: Log = print, log_every: float = 0.0
) -> Progress:
    return Progress(
        sys.stderr.isatty() if enabled is None else enabled, total, title, log, log_every
    )
