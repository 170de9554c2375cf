"""The planner's choice fits: one real step at the chosen micro-batch stays under the budget."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import pytest
from torch import nn

from bigbatch.memory.budget import format_bytes, parse_bytes
from bigbatch.memory.calibrate import calibrate
from bigbatch.memory.measure import measure_step_peak
from bigbatch.memory.plan import DoesNotFitError, plan_micro_batch
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def spec_at(b: int) -> StepSpec:
    return StepSpec(cnn, (3, 32, 32), b)


@pytest.mark.slow
def test_chosen_micro_batch_fits_when_really_run() -> None:
    budget = 40 * 2**20
    cal = calibrate(spec_at(2))
    plan = plan_micro_batch(spec_at, 256, budget, overhead=0, calibration=cal)
    assert 1 <= plan.micro_batch < 256
    assert (
        plan.micro_batches * plan.micro_batch >= 256 > (plan.micro_batches - 1) * plan.micro_batch
    )
    assert plan.predicted_peak_bytes <= plan.usable_bytes
    # Measured as windows of two micro-batches: the second holds the first's gradients.
    measured = measure_step_peak(spec_at(plan.micro_batch).in_window(256))
    assert measured <= budget, f"measured {format_bytes(measured)} over the budget"
    # The fewest steps: one step fewer needs a micro-batch that is predicted over the budget.
    fewer = math.ceil(256 / (plan.micro_batches - 1))
    fewer_spec = spec_at(fewer).in_window(256)
    assert predict_peak(fewer_spec, calibration=cal).planning_bytes > plan.usable_bytes
    # Peak memory is close to affine in the micro-batch: the floor, the whole target (alone,
    # then as a later micro-batch, the line's end), the confirmation of where the line meets
    # the budget, and the check that one step fewer does not fit (a search took about 8).
    assert plan.predictions <= 5 and plan.to_dict()["predictions"] == plan.predictions


def test_whole_target_when_it_fits() -> None:
    plan = plan_micro_batch(spec_at, 8, "1GiB", overhead=0)
    assert (plan.micro_batch, plan.micro_batches, plan.predictions) == (8, 1, 2)


def test_a_cpu_plan_without_room_for_glibcs_heap_says_to_return_freed_memory() -> None:
    roomy = plan_micro_batch(spec_at, 8, "1GiB", overhead=0)
    assert roomy.heap_growth_bytes > 0 and not roomy.return_freed_memory
    tight = plan_micro_batch(spec_at, 256, 40 * 2**20, overhead=2**20)
    assert tight.predicted_peak_bytes + tight.heap_growth_bytes > tight.usable_bytes
    assert tight.return_freed_memory and tight.to_dict()["return_freed_memory"]
    assert "return_freed_cpu_memory()" in tight.summary()
    # An overhead of 0 budgets the step's tensors alone (the demo's budgets): no process heap.
    assert not plan_micro_batch(spec_at, 256, 40 * 2**20, overhead=0).return_freed_memory
    # A GPU's caching allocator is predicted by its model: no heap growth to allow for.
    cuda = plan_micro_batch(
        lambda b: StepSpec(cnn, (3, 32, 32), b, device="cuda"), 8, "1GiB", device="cuda", overhead=0
    )
    assert cuda.heap_growth_bytes == 0 and not cuda.return_freed_memory


def test_micro_batches_are_balanced() -> None:
    plan = plan_micro_batch(spec_at, 100, "1GiB", overhead=0, max_micro_batch=40)
    assert (plan.micro_batches, plan.micro_batch) == (3, 34)  # not 40 + 40 + 20


def test_budget_below_the_floor_explains_the_floor() -> None:
    with pytest.raises(
        DoesNotFitError, match=r"even micro-batch 1 does not fit.*weights.*adamw state.*try"
    ):
        plan_micro_batch(spec_at, 64, 200_000, overhead=0)


def test_overhead_larger_than_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves nothing"):
        plan_micro_batch(spec_at, 64, "100MiB", overhead=200 * 2**20)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8GB", 8 * 10**9),
        ("16GiB", 16 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5G", int(1.5 * 2**30)),
        (" 10 mb ", 10**7),
        ("2000000", 2 * 10**6),  # bytes, without a unit, from 1 MiB
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["eight gigs", "8XB", "-1GB", "0", ""])
def test_parse_bytes_rejects_with_the_fix(text: str) -> None:
    with pytest.raises(ValueError, match=r"GB|positive"):
        parse_bytes(text)


def test_a_number_without_a_unit_too_small_for_a_budget_is_refused() -> None:
    """'24' meant 24 GB: read as 24 bytes it would be refused later as leaving nothing, or
    plan for nothing; it is refused where it is read, with the units to write."""
    with pytest.raises(
        ValueError, match="'24' has no unit, so it is 24 bytes: write 24GB or 24GiB"
    ):
        parse_bytes("24")
    assert parse_bytes("0", allow_zero=True) == 0  # overhead=0 needs no unit


def test_top_level_plan_and_its_micro_batches() -> None:
    import bigbatch
    from bigbatch.memory.plan import plan_under_budget

    assert bigbatch.plan is plan_under_budget
    plan = plan_micro_batch(
        lambda b: StepSpec(model=lambda: nn.Linear(8, 2), input_shape=(8,), batch_size=b),
        16,
        "1GiB",
        overhead=0,
    )
    assert plan.to_dict()["micro_batches"] == plan.micro_batches == 1
    assert "accum_steps" not in plan.to_dict()  # the name before micro_batches is gone


def test_a_plan_traces_its_floor_once_and_never_micro_batch_4_for_the_calibration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The floor is traced uncalibrated, bounds the calibration's step at 4 (not traced), and is
    replayed calibrated: the plan equals the one whose every prediction was traced."""
    from bigbatch.memory import plan as plan_module

    budget = 40 * 2**20
    sizes = whole_traces(monkeypatch)
    plan = plan_module.plan_under_budget(spec_at, 256, budget, overhead=0)
    assert sizes.count(1) == 1 and 4 not in sizes, sizes
    traced = plan_micro_batch(spec_at, 256, budget, overhead=0, calibration=plan.calibration)
    assert (plan.micro_batch, plan.predicted_peak_bytes, plan.floor_bytes, plan.curve) == (
        traced.micro_batch,
        traced.predicted_peak_bytes,
        traced.floor_bytes,
        traced.curve,
    )
    assert plan.calibration_note == ""  # the bound let micro-batch 4 be measured


@pytest.mark.parametrize("quadratic", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sizes_on_the_line_between_traces_choose_what_tracing_every_size_chooses(
    monkeypatch: pytest.MonkeyPatch, quadratic: bool
) -> None:
    """The search replays sizes between two traces on their line and traces the size it
    chooses: the same plan as tracing every size, with fewer traces. Where memory is not on
    the line (a batch x batch similarity), the chosen size's trace differs from the line and
    the search runs again on traces alone: still the same plan."""
    from test_predict import BatchBySimilarity

    from bigbatch.memory import plan as plan_module

    def spec(b: int) -> StepSpec:
        return StepSpec(BatchBySimilarity, (64,), b) if quadratic else spec_at(b)

    usable_at = 37 if quadratic else 45  # a budget where the line through 1 and 256 is off
    budget = int((predict_peak(spec(usable_at)).peak_bytes + 1) / 0.9) + 1
    traced = whole_traces(monkeypatch)
    confirmed: list[bool] = []
    confirm = plan_module._Predictions.confirm

    def recording(self: Any, b: int) -> bool:
        confirmed.append(confirm(self, b))
        return confirmed[-1]

    monkeypatch.setattr(plan_module._Predictions, "confirm", recording)
    plan = plan_micro_batch(spec, 256, budget, overhead=0)
    assert confirmed == [not quadratic]  # the line held, or was caught where it did not
    with_line = len(traced)
    traced.clear()
    monkeypatch.setattr(plan_module, "interpolate_log", lambda *args: None)
    every = plan_micro_batch(spec, 256, budget, overhead=0)
    assert (plan.micro_batch, plan.predicted_peak_bytes) == (
        every.micro_batch,
        every.predicted_peak_bytes,
    )
    if not quadratic:
        assert with_line < len(traced), (with_line, traced)


class FrozenBase(nn.Module):
    """A large frozen layer under a small trainable head, as LoRA's base and adapters: the
    weights take most of the memory and the gradients little."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.head = nn.Linear(width, 4)

    def forward(self, x: Any) -> Any:
        return self.head(self.base(x).relu())


def whole_traces(mp: pytest.MonkeyPatch, *, alone: bool = False) -> list[int]:
    """The micro-batches of the whole steps traced from here on (not live_peak's bounds;
    with ``alone``, only those of a window's only micro-batch)."""
    from bigbatch.memory import predict as predict_module

    traced: list[int] = []
    trace = predict_module._predict_on_fake

    def counting(s: StepSpec, *args: object, live_only: bool = False, **kw: Any) -> object:
        if not live_only and not (alone and s.held_gradients):
            traced.append(s.batch_size)
        return trace(s, *args, live_only=live_only, **kw)  # type: ignore[arg-type]

    mp.setattr(predict_module, "_predict_on_fake", counting)
    return traced


@pytest.mark.parametrize(("device", "width"), [("cpu", 512), ("cuda", 2048)])
def test_where_the_weights_dominate_the_whole_target_is_not_traced_when_ruled_out(
    monkeypatch: pytest.MonkeyPatch, device: str, width: int
) -> None:
    """The whole target alone is at least the next size's step on the held line less its
    gradients twice: where that does not fit, its trace is not made, and the plan is the one
    the trace would have made (a CUDA plan too, made on this CPU: the allocator's model)."""
    from bigbatch.memory import plan as plan_module

    def spec(b: int) -> StepSpec:
        # On CUDA the workspaces (128 MiB) and 2 MiB segments ask for larger steps.
        return StepSpec(functools.partial(FrozenBase, width), (64, width), b, device=device)

    held = [predict_peak(spec(b).in_window(8)) for b in (1, 2)]
    alone = whole_traces(monkeypatch, alone=True)
    # Micro-batch 1 fits, 2 does not, and the floor is above half the budget.
    tight = held[0].planning_bytes + (held[1].planning_bytes - held[0].planning_bytes) // 4
    ruled_out_below = held[1].planning_bytes - 2 * held[1].gradients
    assert held[0].planning_bytes <= tight < ruled_out_below < 2 * held[0].planning_bytes
    plan = plan_micro_batch(spec, 8, tight, device=device, overhead=0, margin=0)
    assert (plan.micro_batch, plan.micro_batches, alone) == (1, 8, [])
    monkeypatch.setattr(plan_module, "_whole_ruled_out", lambda *args: False)  # the trace made
    traced = plan_micro_batch(spec, 8, tight, device=device, overhead=0, margin=0)
    assert alone == [8] and traced.micro_batch == 1
    assert traced.predicted_peak_bytes == plan.predicted_peak_bytes
    assert predict_peak(spec(8)).planning_bytes > tight  # what ruled it out holds
    # With room for the next size less its gradients twice, the target alone is traced again.
    monkeypatch.undo()
    alone = whole_traces(monkeypatch, alone=True)
    plan_micro_batch(spec, 8, ruled_out_below, device=device, overhead=0, margin=0)
    assert alone == [8]


def test_a_cuda_size_its_live_tensors_rule_out_is_not_traced() -> None:
    """On CUDA, where the floor's step with its activations once more does not fit, the next
    size is bounded from below first (live_peak: its later micro-batch alone, a third of the
    trace): over the budget, it is ruled out without its trace (nor the whole target's), and
    the plan is the one the traces make; where the bound fits, the size is traced as before."""
    from bigbatch.memory import plan as plan_module
    from bigbatch.memory.predict import live_peak

    def spec(b: int) -> StepSpec:
        # 64 MiB of activations a sample: the live tensors outgrow CUDA's 128 MiB of handles.
        return StepSpec(functools.partial(FrozenBase, 2048), (8192, 2048), b, device="cuda")

    floor = predict_peak(spec(1).in_window(8))
    bound = live_peak(spec(2).in_window(8))
    assert bound is not None
    usable = (floor.planning_bytes + bound.planning_bytes) // 2
    assert floor.planning_bytes + floor.activations > usable > floor.planning_bytes
    with pytest.MonkeyPatch.context() as mp:
        full = whole_traces(mp)
        plan = plan_micro_batch(spec, 8, usable, device="cuda", overhead=0, margin=0)
        assert (plan.micro_batch, full) == (1, [1])
        full.clear()
        mp.setattr(plan_module._Predictions, "beyond", lambda *args: None)  # traced instead
        traced = plan_micro_batch(spec, 8, usable, device="cuda", overhead=0, margin=0)
        assert full == [1, 2] and traced.micro_batch == 1
        assert predict_peak(spec(2).in_window(8)).planning_bytes > usable  # what it ruled out
    assert traced.predicted_peak_bytes == plan.predicted_peak_bytes
    # Room for the bound: the size is traced, and the plan is the traces' as before.
    with pytest.MonkeyPatch.context() as mp:
        full = whole_traces(mp)
        plan_micro_batch(spec, 8, bound.planning_bytes, device="cuda", overhead=0, margin=0)
        assert full[:2] == [1, 2]


def test_a_cuda_target_its_live_tensors_rule_out_alone_is_not_traced() -> None:
    """Where the line through two traced sizes says the whole target's live tensors would not
    fit, the target as a window's only micro-batch is bounded from below first (traced until
    they pass the usable memory): over it, the target is not traced, and the plan is the one
    its trace makes. With one traced size there is no line: traced, as before."""
    from bigbatch.memory import plan as plan_module
    from bigbatch.memory.predict import live_peak

    def spec(b: int) -> StepSpec:
        # 64 MiB of activations a sample; the floor above half the budget, so micro-batch 2
        # is traced before the whole target is tried.
        return StepSpec(functools.partial(FrozenBase, 2048), (8192, 2048), b, device="cuda")

    usable = predict_peak(spec(2).in_window(16)).planning_bytes  # 2 fits, the whole 16 not
    alone_spec = replace(spec(16).in_window(16), held_gradients=False)
    bound = live_peak(alone_spec, stop_above=usable)
    assert bound is not None and bound.planning_bytes > usable
    assert predict_peak(alone_spec).planning_bytes > usable  # what the bound rules out holds
    with pytest.MonkeyPatch.context() as mp:
        alone = whole_traces(mp, alone=True)
        plan = plan_micro_batch(spec, 16, usable, device="cuda", overhead=0, margin=0)
        assert (plan.micro_batch, alone) == (2, [])
        mp.setattr(
            plan_module._Predictions, "whole", lambda self, b, *args: self.alone(b)
        )  # traced instead
        traced = plan_micro_batch(spec, 16, usable, device="cuda", overhead=0, margin=0)
        assert alone == [16]
    assert (traced.micro_batch, traced.predicted_peak_bytes) == (2, plan.predicted_peak_bytes)
    assert dict(plan.curve) == {b: n for b, n in traced.curve if b < 16}  # the target's bound
    assert plan.predictions == traced.predictions  # a bound for a trace
    # An image model's floor is under half the budget: the whole target is tried on the floor
    # alone, no line yet, and traced.
    usable = predict_peak(spec(4).in_window(8)).planning_bytes
    with pytest.MonkeyPatch.context() as mp:
        alone = whole_traces(mp, alone=True)
        assert (
            plan_micro_batch(spec, 8, usable, device="cuda", overhead=0, margin=0).micro_batch == 4
        )
        assert alone == [8]


def test_a_cuda_size_one_step_fewer_would_take_is_bounded_before_it_is_traced() -> None:
    """Past the chosen micro-batch, the size one step fewer would take is only compared with
    the budget: where the chosen step grown to it does not fit, it is bounded from below
    first, and over the budget, not traced; the plan is the one its trace makes."""
    from bigbatch.memory import plan as plan_module

    def spec(b: int) -> StepSpec:
        # The floor above half the budget: the line through micro-batches 1 and 2 chooses 2.
        return StepSpec(functools.partial(FrozenBase, 2048), (8192, 2048), b, device="cuda")

    usable = predict_peak(spec(2).in_window(16)).planning_bytes
    with pytest.MonkeyPatch.context() as mp:
        full = whole_traces(mp)
        plan = plan_micro_batch(spec, 16, usable, device="cuda", overhead=0, margin=0)
        assert (plan.micro_batch, full) == (2, [1, 2])
        full.clear()
        mp.setattr(plan_module._Predictions, "bounded", lambda self, b, usable: self.peak(b))
        traced = plan_micro_batch(spec, 16, usable, device="cuda", overhead=0, margin=0)
        assert full == [1, 2, 3]  # 3 traced, and over the budget
    assert (traced.micro_batch, traced.predicted_peak_bytes) == (2, plan.predicted_peak_bytes)
    assert dict(traced.curve)[3] > usable
