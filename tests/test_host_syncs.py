"""The device is never waited for per micro-batch: a window's host syncs (reading a tensor's
value on the host) do not grow with its number of micro-batches. On a GPU each one drains the
queue the CPU fills ahead of it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bigbatch import Accumulator, OOMBackoff, run_window

READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _syncs_per_window(monkeypatch: pytest.MonkeyPatch, micro_batch: int) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    acc = Accumulator(torch.optim.AdamW(model.parameters(), lr=1e-3))
    window = (torch.randn(32, 8), torch.randint(0, 3, (32,)))
    reads = 0

    def counted(name: str) -> Any:
        real = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any) -> Any:
            nonlocal reads
            reads += 1
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
    return reads


def test_a_windows_host_syncs_do_not_grow_with_its_micro_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    two = _syncs_per_window(monkeypatch, 16)
    sixteen = _syncs_per_window(monkeypatch, 2)
    assert sixteen == two  # the finite check of the step, whatever the split
