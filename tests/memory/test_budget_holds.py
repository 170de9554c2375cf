"""The budget holds at run time: measured after the first optimizer steps and adjusted before any
OOM, evaluation planned under the same budget (its worst shape), and evaluation's OOM back-off
leaving every output and metric as it was. CUDA is simulated where it must be (no GPU in CI;
tests/gpu runs it on a card)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import bigbatch.train.planning as planning
from bigbatch.backoff import EvalBackoff, OOMBackoff, OutOfMemoryAtMinimumError, infer_fitting
from bigbatch.memory.evaluate import plan_evaluation_batch, predict_evaluation_peak
from bigbatch.memory.plan import refit_micro_batch
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec
from bigbatch.models import timm_factory
from bigbatch.train.planning import MemoryCheck, PlanChoice
from bigbatch.train.tasks.base import Placement, Task

MIB = 2**20
CURVE = [(1, 1100 * MIB), (32, 4510 * MIB), (64, 8000 * MIB)]  # ~1000 MiB + ~110 MiB a sample


# -- measure, then adjust ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("measured", "expected", "why"),
    [
        (8000, 64, "as predicted: kept"),
        (7000, 64, "12 % under: not far enough to grow"),
        (9600, 43, "20 % over: 51 fit, balanced over 256 (6 x 43)"),
        (4000, 128, "half the prediction: grows, at most twice"),
        (90000, 1, "nothing fits: the smallest"),
    ],
)
def test_the_measured_peak_refits_the_micro_batch(measured: int, expected: int, why: str) -> None:
    new = refit_micro_batch(CURVE, 64, measured * MIB, 8000 * MIB, target=256, top=256)
    assert new == expected, why


def test_refitting_respects_the_top_the_smallest_and_a_fixed_micro_batch() -> None:
    assert refit_micro_batch(CURVE, 64, 4000 * MIB, 8000 * MIB, target=256, top=96) == 86  # 3 x 86
    assert (
        refit_micro_batch(CURVE, 64, 4000 * MIB, 8000 * MIB, target=256, top=256, grow=False) == 64
    )
    assert (
        refit_micro_batch(CURVE, 64, 90000 * MIB, 8000 * MIB, target=256, top=64, smallest=2) == 2
    )
    assert refit_micro_batch([], 64, 9000, 8000, target=256, top=64) == 64  # nothing to scale


def test_a_refit_moves_the_back_offs_cap_too() -> None:
    backoff = OOMBackoff(micro_batch=64, max_micro_batch=64)
    backoff.refit(2, 43)
    assert (backoff.micro_batch, backoff.max_micro_batch) == (43, 43)  # never above it again
    assert [(e.old, e.new, e.reason) for e in backoff.events] == [(64, 43, "measured")]
    backoff.refit(3, 86)
    assert (backoff.micro_batch, backoff.max_micro_batch) == (86, 86)
    backoff.refit(4, 86)
    assert len(backoff.events) == 2  # no change, no event


def _choice(**changes: object) -> PlanChoice:
    choice = PlanChoice(
        micro_batch=64,
        max_micro_batch=64,
        predicted_peak_bytes=8000 * MIB,
        overhead_bytes=500 * MIB,
        budget_bytes=10000 * MIB,
        usable_bytes=8500 * MIB,
        curve=tuple(CURVE),
        planned=True,
    )
    return choice._replace(**changes)  # type: ignore[arg-type]


@pytest.fixture
def simulated_peak(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The device's peak as the test sets it: (bytes, whether the whole process counts)."""
    peak: dict[str, object] = {"value": None, "resets": 0, "card": None}

    def reset(device: torch.device) -> bool:
        peak["resets"] = int(peak["resets"]) + 1  # type: ignore[call-overload]
        return True

    monkeypatch.setattr(planning, "reset_peak_memory", reset)
    monkeypatch.setattr(planning, "peak_memory_bytes", lambda device: peak["value"])
    # (total, outside the allocator) of the card; None: not measured (a real GPU's is not read).
    monkeypatch.setattr(planning, "card_memory", lambda device: peak["card"])
    return peak


def test_a_cuda_step_over_the_plan_shrinks_after_the_first_steps_and_says_so(
    simulated_peak: dict[str, object], tmp_path: Path
) -> None:
    (tmp_path / "plan.json").write_text(json.dumps({"micro_batch": 64}))
    lines: list[str] = []
    check = MemoryCheck(_choice(), torch.device("cuda"), 256, lines.append, tmp_path)
    assert simulated_peak["resets"] == 1  # the run's peak is its own, not the planning's
    backoff = OOMBackoff(micro_batch=64)
    simulated_peak["value"] = (9600 * MIB, False)  # 20 % over the prediction, over usable
    check.after_window(1, backoff)  # the state exists, but no steady step has run yet
    assert backoff.micro_batch == 64 and not lines
    check.after_window(2, backoff)
    assert backoff.micro_batch == 52 and backoff.events[-1].reason == "measured"  # 5 x 52
    assert lines == [
        "memory: after 2 optimizer steps at micro-batch 64, measured 9.38 GiB (allocator "
        "reserved peak), predicted 7.81 GiB, limit 8.30 GiB: micro-batch 64 -> 52"
    ]
    recorded = json.loads((tmp_path / "plan.json").read_text())["first_steps"]
    assert recorded["measured_peak_bytes"] == 9600 * MIB and recorded["new_micro_batch"] == 52
    check.after_window(3, backoff)  # once a run
    assert len(lines) == 1


def test_memory_the_card_holds_beside_the_allocator_past_the_plan_lowers_the_limit(
    simulated_peak: dict[str, object], tmp_path: Path
) -> None:
    """NCCL's communicators take device memory beside PyTorch's allocator, which no plan sees:
    a step measured as predicted still shrinks when the card has less left than the plan
    thought, and the log and plan.json say what it holds."""
    (tmp_path / "plan.json").write_text(json.dumps({"micro_batch": 64}))
    lines: list[str] = []
    simulated_peak["value"] = (8000 * MIB, False)  # as predicted, under the usable 8500 MiB
    simulated_peak["card"] = (10000 * MIB, 500 * MIB)  # the planned context alone
    backoff = OOMBackoff(micro_batch=64)
    MemoryCheck(_choice(), torch.device("cuda"), 256, lines.append, None).after_window(2, backoff)
    assert backoff.micro_batch == 64
    simulated_peak["card"] = (10000 * MIB, 2000 * MIB)  # 1.5 GiB of NCCL's besides
    check = MemoryCheck(_choice(), torch.device("cuda"), 256, lines.append, tmp_path)
    check.after_window(2, backoff)
    assert backoff.micro_batch == 52  # under 10 GiB less its 10 % margin and the 2 GiB outside
    assert lines[-1].endswith(
        "limit 6.84 GiB; the card holds 1.95 GiB outside the allocator (planned 500.0 MiB): "
        "micro-batch 64 -> 52"
    )
    recorded = json.loads((tmp_path / "plan.json").read_text())["first_steps"]
    assert recorded["outside_allocator_bytes"] == 2000 * MIB and recorded["limit_bytes"] == (
        7000 * MIB
    )


def test_what_the_window_holds_beside_the_step_is_measured_not_refitted(
    simulated_peak: dict[str, object], tmp_path: Path
) -> None:
    """A coupled loss's cache and DDP's gradient buckets are held for the whole window: the
    measured peak holds them; the curve (the step's) and the usable memory do not, the plan
    kept them out. A step measured as predicted, plus them, keeps its micro-batch; read as
    the step's own peak (held_bytes 0), the same measurement shrinks it."""
    (tmp_path / "plan.json").write_text(json.dumps({"micro_batch": 64}))
    held = 1500 * MIB
    choice = _choice(budget_bytes=11700 * MIB, usable_bytes=8530 * MIB, held_bytes=held)
    simulated_peak["value"] = (8000 * MIB + held, False)  # as predicted, with what is held
    lines: list[str] = []
    backoff = OOMBackoff(micro_batch=64)
    MemoryCheck(choice, torch.device("cuda"), 256, lines.append, tmp_path).after_window(2, backoff)
    assert backoff.micro_batch == 64
    assert lines[-1].endswith("predicted 9.28 GiB, limit 9.79 GiB: micro-batch kept")
    unheld = OOMBackoff(micro_batch=64)
    choice = choice._replace(held_bytes=0)
    MemoryCheck(choice, torch.device("cuda"), 256, print, None).after_window(2, unheld)
    assert unheld.micro_batch < 64
    # A CPU process: its overhead and what is held, both out of the budget.
    simulated_peak["value"] = (500 * MIB + 8000 * MIB + held, True)
    cpu = OOMBackoff(micro_batch=64)
    choice = choice._replace(held_bytes=held, budget_bytes=10000 * MIB)
    MemoryCheck(choice, torch.device("cpu"), 256, print, None).after_window(2, cpu)
    assert cpu.micro_batch == 64


@pytest.mark.slow
def test_a_ddp_rank_plans_its_share_beside_its_gradient_buckets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun each rank's DDP holds its buckets, a copy of the trainable weights'
    gradients, from its construction on: the plan keeps them out of the rank's usable memory
    and plans the rank's share of the window. The buckets are DDP's own (its logging data,
    on a fake process group)."""
    from bigbatch.distributed import ddp_bucket_bytes
    from bigbatch.memory.fsdp import fake_ranks
    from bigbatch.train.config import load_config

    factory = timm_factory("resnet10t", num_classes=3)
    model = factory()
    model.get_classifier().bias.requires_grad_(False)  # a frozen weight has no bucket
    with fake_ranks(2):
        logged = nn.parallel.DistributedDataParallel(model)._get_ddp_logging_data()
    buckets = sum(int(n) for n in str(logged["bucket_sizes"]).split(","))
    assert buckets == ddp_bucket_bytes(model) and not logged["gradient_as_bucket_view"]
    cfg = load_config(overrides=["data=x", "arch=resnet10t", "size=32", "batch=16"])
    monkeypatch.setattr(planning, "_budget", lambda cfg, device: 4000 * MIB)
    monkeypatch.setattr(planning, "default_overhead", lambda budget, device: 500 * MIB)
    cuda, lines = torch.device("cuda"), []
    one = planning.plan_for(cfg, factory, cuda, "fp16", print)
    two = planning.plan_for(cfg, factory, cuda, "fp16", lines.append, world=2)
    assert one.held_bytes == 0 and two.held_bytes == ddp_bucket_bytes(factory())
    assert two.usable_bytes == (one.usable_bytes or 0) - two.held_bytes
    assert lines[0] == "distributed: 2 ranks x 8 samples per window = target batch 16"
    assert "DDP's gradient buckets hold 18.8 MiB on each rank" in lines[1]
    assert (one.micro_batch, two.micro_batch) == (16, 8)  # a rank's share of the window
    said: list[str] = []  # a window given is the rank's own: no share of cfg.batch is said
    three = planning.plan_for(cfg, factory, cuda, "fp16", said.append, target=4, world=2)
    assert three.micro_batch == 4 and not [s for s in said if s.startswith("distributed:")]


def test_under_torchrun_every_rank_refits_from_the_largest_peak(
    simulated_peak: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks measure different peaks (and may back off on their own): each takes the largest
    of all ranks' peaks and of what their cards hold outside the allocator, and none refits
    where any rank backed off, so every rank goes on at one micro-batch (the collectives are
    stood in for: another rank measured ``other``)."""
    other = {"peak": 9600 * MIB, "outside": 500 * MIB, "events": 0}

    def across_ranks(values: list[int], device: torch.device) -> list[int]:
        # one collective for the three figures: peak, outside, back-offs
        calls.append(("peak", "outside", "events"))
        return [max(v, other[k]) for v, k in zip(values, calls[-1], strict=True)]

    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(planning, "maxima_over_ranks", across_ranks)
    simulated_peak["value"] = (8000 * MIB, False)  # this rank: as predicted
    simulated_peak["card"] = (10000 * MIB, 500 * MIB)
    backoff = OOMBackoff(micro_batch=64)
    MemoryCheck(_choice(), torch.device("cuda"), 256, print, None).after_window(2, backoff)
    assert len(calls) == 1
    assert backoff.micro_batch == 52  # the other rank's 9600 MiB decided, as on that rank
    calls.clear()
    other["events"] = 1  # the other rank backed off: no rank refits
    backoff = OOMBackoff(micro_batch=64)
    MemoryCheck(_choice(), torch.device("cuda"), 256, print, None).after_window(2, backoff)
    assert backoff.micro_batch == 64 and not backoff.events


def test_in_cudnn_benchmark_mode_the_first_steps_trials_are_not_measured(
    simulated_peak: dict[str, object],
) -> None:
    """Benchmark mode's trials took whatever memory was free on the first step (the recorded
    peak holds them): the peak is measured again from there, over the steady steps after."""
    check = MemoryCheck(_choice(), torch.device("cuda"), 256, print, None, cudnn_benchmark=True)
    backoff = OOMBackoff(micro_batch=64)
    simulated_peak["value"] = (20000 * MIB, False)  # a trial's workspace, 12 GiB over usable
    check.after_window(1, backoff)
    assert simulated_peak["resets"] == 2 and not check.done  # reset after the first step
    simulated_peak["value"] = (8000 * MIB, False)  # the steady step, as predicted
    check.after_window(2, backoff)
    assert check.done and backoff.micro_batch == 64 and not backoff.events
    # Without benchmark mode the same first-step peak would have shrunk the micro-batch.
    plain = MemoryCheck(_choice(), torch.device("cuda"), 256, print, None)
    simulated_peak["value"] = (20000 * MIB, False)
    plain.after_window(2, backoff)
    assert backoff.micro_batch < 64


def test_a_cuda_step_far_under_the_plan_grows_and_a_fixed_one_does_not(
    simulated_peak: dict[str, object],
) -> None:
    simulated_peak["value"] = (4000 * MIB, False)
    backoff = OOMBackoff(micro_batch=64, max_micro_batch=64)
    MemoryCheck(_choice(max_micro_batch=256), torch.device("cuda"), 256, print, None).after_window(
        2, backoff
    )
    assert backoff.micro_batch == 128
    fixed = OOMBackoff(micro_batch=64)
    MemoryCheck(_choice(planned=False), torch.device("cuda"), 256, print, None).after_window(
        2, fixed
    )
    assert fixed.micro_batch == 64


def test_the_back_off_having_acted_or_no_plan_leaves_the_micro_batch(
    simulated_peak: dict[str, object],
) -> None:
    simulated_peak["value"] = (9600 * MIB, False)
    backoff = OOMBackoff(micro_batch=64)
    backoff.shrink(1, "CUDA out of memory")
    check = MemoryCheck(_choice(), torch.device("cuda"), 256, print, None)
    check.after_window(2, backoff)
    assert backoff.micro_batch == 32  # the OOM's, not the measurement's
    unplanned = MemoryCheck(
        _choice(predicted_peak_bytes=None), torch.device("cuda"), 256, print, None
    )
    assert unplanned.done  # a fixed micro-batch without a budget: nothing to compare


def test_a_cpu_process_shrinks_only_over_its_whole_budget(
    simulated_peak: dict[str, object],
) -> None:
    """On a CPU the resident peak counts data and libraries besides the step: only the whole
    budget is its limit there, and it never grows."""
    cpu = torch.device("cpu")
    simulated_peak["value"] = (9800 * MIB, True)  # over usable + overhead, under the budget
    backoff = OOMBackoff(micro_batch=64)
    MemoryCheck(_choice(), cpu, 256, print, None).after_window(2, backoff)
    assert backoff.micro_batch == 64
    simulated_peak["value"] = (11000 * MIB, True)  # the process over the budget
    MemoryCheck(_choice(), cpu, 256, print, None).after_window(2, backoff)
    assert backoff.micro_batch < 64
    step_only = OOMBackoff(micro_batch=64)  # overhead=0: a budget for the step's tensors alone
    MemoryCheck(_choice(overhead_bytes=0), cpu, 256, print, None).after_window(2, step_only)
    assert step_only.micro_batch == 64
    low = OOMBackoff(micro_batch=64, max_micro_batch=256)
    simulated_peak["value"] = (2000 * MIB, True)
    MemoryCheck(_choice(max_micro_batch=256), cpu, 256, print, None).after_window(2, low)
    assert low.micro_batch == 64


# -- evaluation planned ---------------------------------------------------------------------------


def _convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 32 * 32, 10)
    )


def test_the_no_grad_step_holds_weights_and_state_but_no_gradients() -> None:
    spec = StepSpec(_convnet, (3, 32, 32), 16, optimizer="adamw")
    evaluation = predict_evaluation_peak(spec)
    training = predict_peak(spec)
    assert evaluation.gradients == 0 and training.gradients > 0
    assert evaluation.optimizer_state == 2 * evaluation.parameters  # Adam's two moments
    assert evaluation.peak_bytes < training.peak_bytes
    with_ema = predict_evaluation_peak(spec, state_copies=3)
    assert with_ema.peak_bytes - evaluation.peak_bytes == evaluation.parameters
    held = predict_evaluation_peak(spec, held_bytes=10 * MIB)
    assert held.peak_bytes - evaluation.peak_bytes == 10 * MIB
    cuda = predict_evaluation_peak(StepSpec(_convnet, (3, 32, 32), 16, "adamw", "fp16", "cuda"))
    assert cuda.reserved_bytes >= cuda.peak_bytes > 0  # through the allocator's model


def test_evaluation_batch_is_the_largest_that_fits() -> None:
    def peak(b: int) -> int:
        return 100 + 10 * b

    assert plan_evaluation_batch(peak, 64, 10_000, (3, 8, 8)).batch == 64
    plan = plan_evaluation_batch(peak, 64, 500, (3, 8, 8))
    assert (plan.batch, plan.predicted_peak_bytes, plan.fits) == (40, 500, True)
    over = plan_evaluation_batch(peak, 64, 50, (3, 8, 8))
    assert (over.batch, over.fits) == (1, False)
    assert "over the budget even at 1" in over.summary()
    lumpy = plan_evaluation_batch(lambda b: 100 + 10 * b + (400 if b > 30 else 0), 64, 500, (1,))
    assert lumpy.batch == 30  # not on one line: searched
    traced: list[int] = []

    def language_model(b: int) -> int:  # weights held, a batch's logits past the budget soon
        traced.append(b)
        return 15_000 + 2_000 * b

    assert plan_evaluation_batch(language_model, 16, 20_000, (1024,)).batch == 2
    assert traced == [1, 2, 3]  # the line through 1 and 2 confirmed: 16 and 9 never traced
    concave = plan_evaluation_batch(lambda b: 100 + int(100 * b**0.5), 64, 800, (1,))
    assert concave.batch == 49  # past the line's guess (5): the rest searched


class _Toy(Task):
    """A task whose validation meets a bigger input than training's (whole images after
    crops)."""

    name = "toy"

    def __init__(self, valid_side: int) -> None:
        self.valid_side = valid_side
        self.classes = ["a", "b"]

    def input_shape(self) -> tuple[int, ...]:
        return (3, 32, 32)

    def valid_shape(self, valid_items: object) -> object:
        from bigbatch.train.tasks.base import ValidShape

        side = self.valid_side
        return ValidShape((3, side, side), what=f"whole images of {side}x{side}")


def _cfg(**kw: object) -> object:
    from bigbatch.train.config import TrainConfig

    return TrainConfig(data="d", batch=64, **kw)  # type: ignore[arg-type]


def _fcn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 2, 1))


def test_validation_is_planned_for_its_worst_shape_under_the_same_budget() -> None:
    lines: list[str] = []
    cpu = torch.device("cpu")
    probe = predict_evaluation_peak(StepSpec(_fcn, (3, 32, 32), 1, optimizer="adamw"))
    choice = _choice(micro_batch=8, usable_bytes=probe.peak_bytes * 30)
    same = planning.plan_validation(_cfg(), _fcn, cpu, "fp32", choice, _Toy(32), [0] * 10, print)
    bigger = planning.plan_validation(
        _cfg(), _fcn, cpu, "fp32", choice, _Toy(128), [0] * 10, lines.append
    )
    assert same.valid_batch > bigger.valid_batch >= 1
    assert bigger.valid_shape == (3, 128, 128) and bigger.valid_predicted_peak_bytes
    assert bigger.valid_predicted_peak_bytes <= choice.usable_bytes
    assert lines[0].startswith(f"plan: validation batch {bigger.valid_batch} (inputs of 3x128x128)")
    assert lines[0].endswith("(whole images of 128x128)")
    unplanned = _choice(micro_batch=8, usable_bytes=None)
    fixed = planning.plan_validation(_cfg(), _fcn, cpu, "fp32", unplanned, _Toy(128), [0], print)
    assert fixed.valid_batch == 16 and fixed.valid_predicted_peak_bytes is None


# -- evaluation's back-off ------------------------------------------------------------------------


class _Tally:
    def __init__(self) -> None:
        self.total = torch.zeros((), dtype=torch.float64)
        self.count = 0

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.total += (logits.argmax(1) == targets).sum()
        self.count += len(targets)

    def as_dict(self) -> dict[str, float]:
        return {"valid_loss": 0.0, "accuracy": float(self.total) / self.count}


class _Scored(Task):
    name = "scored"

    def __init__(self) -> None:
        self.classes = ["a", "b", "c"]

    def metrics(self) -> _Tally:
        return _Tally()


class _RunsOutAbove(nn.Module):
    """A model that runs out of memory on more than ``most`` samples at once."""

    def __init__(self, most: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
        self.most = most

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.most:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.net(x)


def test_validation_backs_off_on_oom_with_the_same_metrics() -> None:
    torch.manual_seed(1)
    batches = [(torch.randn(8, 5), torch.randint(0, 3, (8,))) for _ in range(3)]
    where = Placement(torch.device("cpu"))
    fits = _RunsOutAbove(most=100)
    tight = _RunsOutAbove(most=3)
    tight.load_state_dict(fits.state_dict())
    expected = _Scored().evaluate(fits, batches, where).as_dict()
    assert _Scored().evaluate(tight, batches, where).as_dict() == expected
    assert tight.training  # put back in train mode


@pytest.mark.slow
def test_the_evaluation_back_off_stops_at_one_sample() -> None:
    def never(x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    backoff = EvalBackoff()
    with pytest.raises(OutOfMemoryAtMinimumError, match="evaluating a single sample"):
        infer_fitting(never, torch.zeros(4, 2), backoff)
    assert [e.new for e in backoff.events] == [2, 1]
    with pytest.raises(ValueError, match="not an OOM"):
        infer_fitting(
            lambda x: (_ for _ in ()).throw(ValueError("not an OOM")), torch.zeros(2), backoff
        )


@pytest.mark.slow
def test_sliding_window_validation_backs_off_to_one_patch_then_gathers_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("monai")
    import monai.inferers

    from bigbatch.train.tasks.segmentation.task import sliding_window_fitting

    torch.manual_seed(0)
    net = nn.Conv3d(1, 2, 3, padding=1)
    x = torch.randn(1, 1, 12, 12, 12)
    # What one patch a pass gives (another batch size differs by the kernels' round-off only).
    expected = sliding_window_fitting(net, x, (8, 8, 8), 1, EvalBackoff())
    real = monai.inferers.sliding_window_inference
    seen: list[tuple[int, str]] = []

    def tight(inputs: torch.Tensor, roi: object, sw_batch_size: int, *a: object, **kw: object):
        gather = torch.device(kw.get("device") or inputs.device)  # type: ignore[arg-type]
        seen.append((sw_batch_size, str(gather)))
        if gather.type != "cpu":  # "meta" stands for the GPU: its whole output does not fit
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(inputs, roi, sw_batch_size, *a, **kw)

    monkeypatch.setattr(monai.inferers, "sliding_window_inference", tight)
    backoff = EvalBackoff()
    got = sliding_window_fitting(net, x, (8, 8, 8), 8, backoff, gather=torch.device("meta"))
    assert seen == [(8, "meta"), (4, "meta"), (2, "meta"), (1, "meta"), (1, "cpu")]
    assert backoff.chunk == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# -- the worst shape ------------------------------------------------------------------------------


def test_a_kaggle_run_validates_whole_images_at_the_largest_size_its_headers_give() -> None:
    from types import SimpleNamespace

    from bigbatch.train.tasks.segmentation.kaggle import KaggleSegmentationTask

    task = KaggleSegmentationTask.__new__(KaggleSegmentationTask)
    task.shape, task.crop = None, (64, 64)
    items = SimpleNamespace(shapes=[(250, 300), (320, 200)])
    shape = task.valid_shape(items)  # type: ignore[arg-type]
    assert shape.shape == (3, 320, 320) and shape.largest == 1  # sizes differ: one at a time
    assert shape.what == "whole images of up to 320x300"
    task.shape = (256, 400)
    same = task.valid_shape(items)  # type: ignore[arg-type]
    assert same.shape == (3, 256, 416) and same.largest is None


def test_a_volume_run_plans_patches_beside_its_largest_volume(tmp_path: Path) -> None:
    pytest.importorskip("monai")
    from bigbatch.train.config import load_config
    from bigbatch.train.tasks.segmentation.data import SegItems
    from bigbatch.train.tasks.segmentation.task import SegmentationTask

    files = []
    for i, shape in enumerate([(20, 30, 40), (50, 10, 30)]):
        np.save(tmp_path / f"v{i}.npy", np.zeros(shape, np.float32))
        files.append((tmp_path / f"v{i}.npy",))
    cfg = load_config(overrides=["task=segmentation", f"data={tmp_path}", "size=32"])
    task = SegmentationTask(cfg)
    task.dims, task.channels, task.num_classes = 3, 1, 3
    items = SegItems(files, [tmp_path / "m.npy"] * 2, 3, 3, 1)
    shape = task.valid_shape(items)
    multiple = task.settings.multiple
    grid = [-(-n // multiple) * multiple for n in (50, 30, 40)]
    assert shape.shape == (1, 32, 32, 32)
    assert shape.held_bytes == 4 * int(np.prod(grid)) * (1 + 2 * 3 + 1)
    assert shape.what.startswith("32^3 patches of volumes up to ")
    assert task.use_valid_batch(6) == 1 and task.window_batch == 6


def test_prediction_takes_the_runs_planned_validation_batch_on_the_same_kind_of_device(
    tmp_path: Path,
) -> None:
    from bigbatch.io import DamagedFileError
    from bigbatch.train.tasks import planned_eval_batch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert planned_eval_batch(tmp_path, cpu) == 64  # no plan.json: an old run
    (tmp_path / "plan.json").write_text(json.dumps({"valid_batch": 48, "device": "cuda:0"}))
    assert planned_eval_batch(tmp_path, cuda) == 48
    assert planned_eval_batch(tmp_path, cpu, default=7) == 7  # planned for another device
    (tmp_path / "plan.json").write_text('{"valid_batch": ')
    with pytest.raises(DamagedFileError, match=r"plan\.json is damaged"):
        planned_eval_batch(tmp_path, cpu)


def test_predict_plans_its_own_batch_under_a_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bigbatch predict --budget``: the no-grad step of the run's model with its weights
    alone, the most images a pass may take under the budget."""
    import bigbatch.memory.plan as plan_module
    from bigbatch.train.config import ConfigError
    from bigbatch.train.tasks.images import predict_batch

    # The budget for the step alone: not whatever this test process holds.
    monkeypatch.setattr(plan_module, "default_overhead", lambda budget, device: 0)
    cpu = torch.device("cpu")
    one = predict_evaluation_peak(StepSpec(_fcn, (3, 64, 64), 1, "sgd"), state_copies=0)
    roomy = predict_batch(_fcn, (3, 64, 64), cpu, "64GB", largest=256)
    tight = predict_batch(_fcn, (3, 64, 64), cpu, str(int(one.planning_bytes * 40 / 0.9)) + "B")
    assert roomy == 256 and 1 <= tight < 64
    with pytest.raises(ConfigError, match=r"--budget lots"):
        predict_batch(_fcn, (3, 64, 64), cpu, "lots")


# -- plan from a measured step on a GPU ------------------------------------------------------------


@pytest.mark.slow
def test_on_a_gpu_a_measured_step_that_fits_is_the_plan_and_else_the_prediction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training run on a CUDA card with budget=auto measures a real step of the whole target
    batch first: where it fits the usable memory it is the plan (no prediction made; the first
    steps' check skipped, since it was measured); where it does not, or runs out of memory, the
    plan is the prediction's, as before. Simulated: the GPU's measurement and budget set here."""
    from bigbatch.train.config import load_config

    cfg = load_config(overrides=["data=x", "arch=resnet10t", "size=32", "batch=8"])
    monkeypatch.setattr(planning, "measures_reserved", lambda device: True)
    monkeypatch.setattr(planning, "_budget", lambda cfg, device: 4000 * MIB)
    monkeypatch.setattr(planning, "default_overhead", lambda budget, device: 500 * MIB)
    measured: list[int] = []

    def measure(spec: StepSpec) -> int:
        measured.append(spec.batch_size)
        return reserved[0]

    monkeypatch.setattr(planning, "measure_step_reserved", measure)
    factory = timm_factory("resnet10t", num_classes=3)
    cuda = torch.device("cuda")
    lines: list[str] = []
    reserved = [300 * MIB]
    choice = planning.plan_for(cfg, factory, cuda, "fp16", lines.append, target=8, measure=True)
    assert measured == [8] and choice.measured and choice.micro_batch == 8
    assert choice.predicted_peak_bytes == 300 * MIB and choice.usable_bytes == 3100 * MIB
    assert "measured on the GPU" in lines[-1]
    assert MemoryCheck(choice, cuda, 8, print, None).done  # measured already
    reserved = [3500 * MIB]  # over the 3100 MiB usable: the prediction plans it
    choice = planning.plan_for(cfg, factory, cuda, "fp16", lines.append, target=8, measure=True)
    assert not choice.measured and "took 3.42 GiB" in lines[-2] and choice.micro_batch == 8

    def out_of_memory(spec: StepSpec) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(planning, "measure_step_reserved", out_of_memory)
    choice = planning.plan_for(cfg, factory, cuda, "fp16", lines.append, target=8, measure=True)
    assert not choice.measured and "ran out of memory" in lines[-2]
    # bigbatch plan (measure off) and an explicit budget never run a step.
    monkeypatch.setattr(planning, "measure_step_reserved", measure)
    measured.clear()
    planning.plan_for(cfg, factory, cuda, "fp16", lines.append, target=8)
    assert measured == []
