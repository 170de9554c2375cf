"""A loss that couples the samples (a batch Dice) holds the window's outputs and their gradient
besides each micro-batch's step: a plan that leaves no room for them runs past its budget, one
that counts them (``extra_bytes=window_cache_bytes(...)``) holds. Measured, on a 3D job."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bigbatch import Accumulator, OOMBackoff
from bigbatch.backoff import run_coupled_window
from bigbatch.memory.measure import measure_peak
from bigbatch.memory.plan import plan_under_budget
from bigbatch.memory.step import StepSpec
from bigbatch.memory.window_cache import window_cache_bytes
from bigbatch.segmentation.losses import batch_loss

SIDE, WINDOW, CLASSES = 24, 32, 4


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, CLASSES, 3, padding=1)
    )


def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return batch_loss("dice_batch", num_classes=CLASSES, ignore_index=None)(outputs.float(), labels)


def measured_window(x: torch.Tensor, y: torch.Tensor, micro_batch: int) -> int:
    """Peak tensor memory of a coupled window at ``micro_batch``, its model's weights included
    (the second of two: SGD's steps allocate nothing)."""
    model = net()
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))

    def window() -> None:
        run_coupled_window(acc, (x, y), model, loss, OOMBackoff(micro_batch=micro_batch))

    window()
    return measure_peak(window, alive=list(model.parameters()))


@pytest.mark.slow
def test_a_coupled_3d_window_holds_its_plan_only_when_the_plan_counts_its_cache() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(WINDOW, 1, SIDE, SIDE, SIDE, generator=g)
    y = torch.randint(0, CLASSES, (WINDOW, SIDE, SIDE, SIDE), generator=g)

    def spec_at(b: int) -> StepSpec:
        return StepSpec(net, (1, SIDE, SIDE, SIDE), b, optimizer="sgd")

    # Two budgets from this CPU's own predictions, so that no CPU's workspaces decide (oneDNN's
    # conv3d ones are 0.4 MiB with AVX-512 and 12 MiB without; on an AMD EPYC a micro-batch of
    # one beside the cache then needed more than the whole window's step, so no one budget both
    # gave the plan blind to the cache the whole window and held one that counts it). Blind: a
    # budget a quarter of the window's step fits by 2 %, which that plan takes and the cache
    # then overruns (it holds every sample's outputs, their copy and gradient, ~20 MiB).
    extra = window_cache_bytes(loss, (CLASSES, SIDE, SIDE, SIDE), y)
    assert extra >= 3 * x.numel() * CLASSES * 4  # outputs, their copy, their gradient
    quarter = plan_under_budget(spec_at, WINDOW // 4, "1GiB", overhead=0).predicted_peak_bytes
    blind = plan_under_budget(spec_at, WINDOW, math.ceil(quarter * 1.02 / 0.9), overhead=0)
    assert WINDOW // 4 <= blind.micro_batch < WINDOW
    assert measured_window(x, y, blind.micro_batch) > blind.usable_bytes  # it runs past

    # Counted: a budget where a micro-batch of one fits beside the cache by 2 %.
    floor = plan_under_budget(spec_at, 1, "1GiB", overhead=0).predicted_peak_bytes
    budget = math.ceil((floor + extra) * 1.02 / 0.9)
    counted = plan_under_budget(spec_at, WINDOW, budget, overhead=0, extra_bytes=extra)
    assert counted.micro_batch < WINDOW
    assert measured_window(x, y, counted.micro_batch) <= counted.usable_bytes + extra
