"""nnU-Net's planned micro-batch refitted to the measured peak after the first steps, as
`bigbatch train` refits its own: simulated here (a CUDA allocator's figures handed in), for
real in a GPU session."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bigbatch.backoff import OOMBackoff

nnunet = pytest.importorskip("bigbatch.integrations.nnunet")

# The plan's predictions: about 1000 + 100 per sample; 2000 of a 2500 budget usable.
PLAN = SimpleNamespace(
    curve=[(1, 1100), (8, 1800)],
    usable_bytes=2000,
    budget_bytes=2500,
    overhead_bytes=250,
    predicted_peak_bytes=1800,
)


def _trainer(lines: list[str]) -> Any:
    """What check_memory reads of the trainer: batch 16 planned in micro-batches of 8."""
    return SimpleNamespace(
        plan=PLAN,
        backoff=OOMBackoff(micro_batch=8, max_micro_batch=8, grow_after=0),
        accumulator=SimpleNamespace(optimizer_step=0),
        memory_checked=False,
        device=torch.device("cuda"),
        batch_size=16,
        print_to_log_file=lines.append,
    )


def _after_steps(
    monkeypatch: pytest.MonkeyPatch,
    measured: tuple[int, bool],
    card: tuple[int, int] | None = None,
    benchmark: bool = False,
) -> tuple[Any, list[str], list[int]]:
    resets: list[int] = []
    lines: list[str] = []
    trainer = _trainer(lines)
    monkeypatch.setattr(nnunet, "peak_memory_bytes", lambda device: measured)
    monkeypatch.setattr(nnunet, "card_memory", lambda device: card)
    monkeypatch.setattr(
        nnunet,
        "reset_peak_memory",
        lambda device: resets.append(trainer.accumulator.optimizer_step),
    )
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", benchmark)
    for step in (1, 2, 3, 4):
        trainer.accumulator.optimizer_step = step
        nnunet.nnUNetTrainerBigBatch.check_memory(trainer)
    return trainer, lines, resets


def test_a_step_over_the_plan_shrinks_the_micro_batch_before_an_oom(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer, lines, _ = _after_steps(monkeypatch, (2400, False))  # a third over the prediction
    assert trainer.backoff.micro_batch < 8 and trainer.backoff.max_micro_batch < 8
    assert len(lines) == 1 and "after 3 steps" in lines[0] and "micro-batch 8 ->" in lines[0]


def test_a_step_far_under_the_plan_grows_the_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, lines, _ = _after_steps(monkeypatch, (900, False))
    assert trainer.backoff.micro_batch == 16  # the whole batch: half the prediction fits it
    assert "micro-batch 8 -> 16" in lines[0]


def test_memory_beside_the_allocator_lowers_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """As planned, but NCCL holds 900 of the card's 2500 outside PyTorch's allocator."""
    as_planned, _, _ = _after_steps(monkeypatch, (1800, False))
    assert as_planned.backoff.micro_batch == 8
    beside_nccl, _, _ = _after_steps(monkeypatch, (1800, False), card=(2500, 900))
    assert beside_nccl.backoff.micro_batch < 8


def test_nothing_is_refitted_on_a_cpu_or_after_an_oom(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, lines, _ = _after_steps(monkeypatch, (10**9, True))  # a process's resident memory
    assert trainer.backoff.micro_batch == 8 and not lines and trainer.memory_checked
    lines = []
    trainer = _trainer(lines)
    trainer.backoff.events.append("an OOM halved it already")
    monkeypatch.setattr(nnunet, "peak_memory_bytes", lambda device: (2400, False))
    trainer.accumulator.optimizer_step = 3
    nnunet.nnUNetTrainerBigBatch.check_memory(trainer)
    assert trainer.backoff.micro_batch == 8 and not lines


def test_cudnn_benchmark_trials_are_left_out_of_the_measured_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, _, resets = _after_steps(monkeypatch, (1800, False), benchmark=True)
    assert resets == [1]  # the peak restarts after the first step, whose trials it held
    _, _, resets = _after_steps(monkeypatch, (1800, False), benchmark=False)
    assert resets == []
