"""The device is never waited for per micro-batch: a window's host syncs (reading a tensor's
value on the host) do not grow with its number of micro-batches. On a GPU each one drains the
queue the CPU fills ahead of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bigbatch import Accumulator, OOMBackoff, run_window

READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _window_reads(
    monkeypatch: pytest.MonkeyPatch,
    micro_batch: int,
    optimizer: Callable[[Any], torch.optim.Optimizer] = lambda p: torch.optim.AdamW(p, lr=1e-3),
    scaler: Any = None,
    counts: Callable[[], bool] = lambda: True,
) -> tuple[int, Any]:
    """One window of 32 samples through run_window; returns the host reads made while
    ``counts()`` said to count them, and the window's result."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    acc = Accumulator(optimizer(model.parameters()), scaler=scaler)
    window = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
    reads = 0

    def counted(name: str) -> Any:
        real = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any) -> Any:
            nonlocal reads
            reads += counts()
            return real(self, *args)

        return read

    with monkeypatch.context() as m:
        for name in READS:
            m.setattr(torch.Tensor, name, counted(name))
        result = run_window(
            acc,
            window,
            lambda b: F.cross_entropy(model(b[0]), b[1]),
            OOMBackoff(micro_batch=micro_batch),
        )
    assert result.micro_batches == 32 // micro_batch
    return reads, result


def test_a_windows_host_syncs_do_not_grow_with_its_micro_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    two, _ = _window_reads(monkeypatch, 16)
    sixteen, _ = _window_reads(monkeypatch, 2)
    assert sixteen == two  # the finite check of the step, whatever the split


@pytest.mark.parametrize("scaled", [False, True])
def test_nothing_is_read_from_the_device_once_the_optimizer_step_is_queued(
    monkeypatch: pytest.MonkeyPatch, scaled: bool
) -> None:
    """A read after the step would wait for it: the GPU then idles while the CPU queues the
    next micro-batch. With a GradScaler whether it skipped is known before the step."""
    stepped = False

    class Watched(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            nonlocal stepped
            out = super().step(closure)  # its own reads: the step counts on the host
            stepped = True
            return out

    scaler = torch.amp.GradScaler("cpu") if scaled else None
    reads_after_step, result = _window_reads(
        monkeypatch, 8, lambda p: Watched(p, lr=1e-3), scaler, counts=lambda: stepped
    )
    assert stepped and not result.skipped
    assert reads_after_step == 0
