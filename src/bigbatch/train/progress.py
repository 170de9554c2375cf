"""Progress while training: a rich bar on a terminal, a plain line now and then elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from bigbatch.device import peak_memory_text

__all__ = ["Progress", "progress"]

Log = Callable[[str], None]
T = TypeVar("T")


# Past this share of the time waiting for batches (after the first few windows), the run says
# once that the loader is the bottleneck: the device idles that much.
SLOW_DATA_SHARE = 0.25
SLOW_DATA_AFTER = 8  # windows


class Progress:
    """A rich progress bar with samples/s, the share of the time spent waiting for data, peak
    memory and micro-batch x accumulation on a terminal; elsewhere (a log file, a notebook, CI)
    a plain line every ``log_every`` seconds. With ``slow_data_fix``, a loader that keeps the
    step waiting is said once, with that fix."""

    def __init__(
        self,
        enabled: bool,
        total: int,
        title: str,
        log: Log = print,
        log_every: float = 0.0,
        slow_data_fix: str = "",
    ) -> None:
        self.bar: Any = None
        self.samples = 0
        self.windows = 0
        self.total, self.title, self.log, self.log_every = total, title, log, log_every
        self.t0 = self.last_line = time.perf_counter()
        self.slow_data_fix = slow_data_fix
        self.waited = 0.0  # seconds spent waiting for batches, from the second one on
        self.t_data: float | None = None  # when the first batch came
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

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """``loader``'s batches, timing how long the step waits for each: the first batch's
        wait (workers starting, the first reads) is not the steady pipeline's, so the share
        counts from the second."""
        batches = iter(loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            now = time.perf_counter()
            if self.t_data is None:
                self.t_data = now
            else:
                self.waited += now - start
            yield batch

    @property
    def data_share(self) -> float:
        """The share of the time since the first batch spent waiting for the next."""
        if self.t_data is None:
            return 0.0
        return self.waited / max(time.perf_counter() - self.t_data, 1e-9)

    def advance(self, samples: int, micro: int, *, acc_steps: int, device: torch.device) -> None:
        self.samples += samples
        self.windows += 1
        now = time.perf_counter()
        share = self.data_share
        if self.slow_data_fix and self.windows >= SLOW_DATA_AFTER and share > SLOW_DATA_SHARE:
            self.log(
                f"note: training waited for data {share:.0%} of the time: the loader is the "
                f"bottleneck; {self.slow_data_fix}"
            )
            self.slow_data_fix = ""  # said once
        if self.bar is None and not (self.log_every and now - self.last_line >= self.log_every):
            return
        rate = self.samples / max(now - self.t0, 1e-9)
        info = (
            f"{rate:.0f} samples/s, data wait {share:.0%}, {micro} x {acc_steps}"
            f"{peak_memory_text(device)}"
        )
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
    enabled: bool | None,
    total: int,
    title: str,
    *,
    log: Log = print,
    log_every: float = 0.0,
    slow_data_fix: str = "",
) -> Progress:
    return Progress(
        sys.stderr.isatty() if enabled is None else enabled,
        total,
        title,
        log,
        log_every,
        slow_data_fix,
    )
