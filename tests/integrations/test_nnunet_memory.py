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


def test_an_ignore_labels_cross_entropy_is_weighed_by_the_voxels_kept() -> None:
    """nnU-Net's cross-entropy with an ignore label is a mean over the voxels the batch does
    not ignore: micro-batches of uneven such counts, weighed by their samples, sum to the
    batch's loss only with each one's cross-entropy weighed by its share of those voxels (at
    every deep supervision output), in float64 to 1e-12; weighed by samples alone (the
    control), they do not. (The Dice, whose sums nnU-Net makes in float32, is left out here:
    tests/integrations/test_nnunet.py checks the whole trainer in float64.)"""
    from nnunetv2.training.loss.compound_losses import DC_and_CE_loss
    from nnunetv2.training.loss.deep_supervision import DeepSupervisionWrapper

    dice = {"batch_dice": False, "do_bg": False, "smooth": 1e-5, "ddp": False}
    loss = DeepSupervisionWrapper(
        DC_and_CE_loss(dice, {}, weight_ce=1, weight_dice=0, ignore_label=3), (0.6, 0.4, 0.0)
    )
    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 8), (4, 4), (2, 2)]
    logits = [torch.randn(3, 3, *s, dtype=torch.float64, generator=generator) for s in shapes]
    for x in logits:
        x.requires_grad_(True)
    targets = []
    for s in shapes:
        y = torch.randint(0, 3, (3, 1, *s), generator=generator).double()
        ignored = torch.rand(y.shape, generator=generator, dtype=torch.float64)
        kept = torch.tensor([0.8, 0.1, 0.5], dtype=torch.float64).view(-1, 1, 1, 1)
        targets.append(torch.where(ignored < kept, torch.full_like(y, 3), y))
    batch = torch.autograd.grad(loss(logits, targets), logits[:2])
    split = nnunet.ignore_label_shares(loss, 3, targets)
    assert split is not None

    def accumulated_with(
        weighed: Any, labels: list[torch.Tensor], channels: int = 3
    ) -> tuple[torch.Tensor, ...]:
        total: Any = 0
        for part in (slice(0, 2), slice(2, 3)):  # 2 + 1 samples, weighed by their share
            micro = weighed([x[part, :channels] for x in logits], [y[part] for y in labels])
            total = total + micro * (part.stop - part.start) / 3
        return torch.autograd.grad(total, logits[:2])  # the last output weighs 0

    exact = accumulated_with(split, targets)
    by_samples = accumulated_with(lambda x, y: loss(x, y), targets)
    assert max(float((a - b).abs().max()) for a, b in zip(exact, batch, strict=True)) < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(by_samples, batch, strict=True)) > 1e-4
    # Regions (sigmoid outputs, one-hot labels, the ignore label's channel last): the binary
    # cross-entropy, a mean over the voxels whose last channel is off, weighed the same way.
    from nnunetv2.training.loss.compound_losses import DC_and_BCE_loss

    bce = DeepSupervisionWrapper(
        DC_and_BCE_loss({}, dice, weight_dice=0, use_ignore_label=True), (0.6, 0.4, 0.0)
    )
    # regions 1 and 2, then the ignore label's channel
    onehot = [torch.cat([(y[:, :1] == c).double() for c in (1, 2, 3)], dim=1) for y in targets]
    regions = [x[:, :2] for x in logits]  # one sigmoid output a region
    batch = torch.autograd.grad(bce(regions, onehot), logits[:2])
    split = nnunet.ignore_label_shares(bce, 3, onehot)
    assert split is not None
    exact = accumulated_with(split, onehot, channels=2)
    by_samples = accumulated_with(lambda x, y: bce(x, y), onehot, channels=2)
    # nnU-Net casts the regions' labels to float32, and its BCE is float32 whatever the
    # logits: judged against float32's round-off of the batch's own gradient.
    largest = max(float(g.abs().max()) for g in batch)
    round_off = 8 * torch.finfo(torch.float32).eps * largest
    assert max(float((a - b).abs().max()) for a, b in zip(exact, batch, strict=True)) < round_off
    missed = max(float((a - b).abs().max()) for a, b in zip(by_samples, batch, strict=True))
    assert missed > 1000 * round_off, (missed, round_off)
    # Nothing to weigh without an ignore label; another loss is not weighed, and refused.
    assert nnunet.ignore_label_shares(loss, None, targets) is None
    assert nnunet.ignore_label_shares(torch.nn.MSELoss(), 3, targets) is None
    trainer = SimpleNamespace(
        label_manager=SimpleNamespace(ignore_label=3),
        configuration_manager=SimpleNamespace(batch_dice=False),
        loss=torch.nn.MSELoss(),
    )
    with pytest.raises(ValueError, match=r"ignore label and .*'s loss \(MSELoss\) is not nnU-Net"):
        nnunet.check_exact_loss(trainer)
    trainer.loss = loss
    nnunet.check_exact_loss(trainer)


def test_the_planners_step_for_regions_is_their_trainers() -> None:
    """A dataset of regions (BraTS's) is planned with the step its trainer runs: a sigmoid head
    per region and DC+BCE over the regions' labels one-hot (the ignore label's channel last),
    not DC+CE over one channel of classes (whose cross-entropy takes one channel of labels):
    the step runs on them; and classes with an ignore label as their trainer weighs them."""
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    from bigbatch.integrations.nnunet_step import plan_step_spec
    from bigbatch.memory.step import make_inputs, run_step_loss

    kwargs = {
        "n_stages": 3, "features_per_stage": [4, 8, 8], "conv_op": "torch.nn.modules.conv.Conv3d",
        "kernel_sizes": [[3, 3, 3]] * 3, "strides": [[1, 1, 1], [2, 2, 2], [2, 2, 2]],
        "n_conv_per_stage": [1, 1, 1], "n_conv_per_stage_decoder": [1, 1], "conv_bias": True,
        "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
        "norm_op_kwargs": {"eps": 1e-05, "affine": True}, "dropout_op": None,
        "dropout_op_kwargs": None, "nonlin": "torch.nn.LeakyReLU", "nonlin_kwargs": {},
    }  # fmt: skip
    needs = ("conv_op", "norm_op", "dropout_op", "nonlin")

    def build() -> torch.nn.Module:
        net_class = "dynamic_network_architectures.architectures.unet.PlainConvUNet"
        return get_network_from_plans(
            net_class, kwargs, needs, 1, 3, allow_init=False, deep_supervision=True
        )

    spec = plan_step_spec(
        build, (8, 8, 8), 1, 3, kwargs, device="cpu", precision="fp32", regions=True,
        ignore_label=True,
    )  # fmt: skip
    x, labels = make_inputs(spec, "cpu")
    assert [tuple(t.shape) for t in labels] == [(1, 4, 8, 8, 8), (1, 4, 4, 4, 4)]  # 3 + ignore
    assert all(t.dtype == torch.bool for t in labels)
    loss = run_step_loss(spec, spec.model(), (x, labels), "cpu")
    assert torch.isfinite(loss) and loss.requires_grad
    # Classes with an ignore label (the highest, past the heads): DC+CE leaves its voxels out.
    classes = plan_step_spec(
        build, (8, 8, 8), 1, 3, kwargs, device="cpu", precision="fp32", ignore_label=True
    )
    x, labels = make_inputs(classes, "cpu")
    assert labels[0].shape == (1, 1, 8, 8, 8) and int(labels[0].max()) == 3
    assert torch.isfinite(run_step_loss(classes, classes.model(), (x, labels), "cpu"))


@pytest.mark.parametrize(
    ("curve", "most_asked"),
    [
        (lambda b: 5000 + 900 * b - 4000 * min(b, 8) // 8, 8),  # per sample less past a few
        (lambda b: int(10_000 + 3000 * b - 2000 * b**0.5), 8),  # and less, and less
        (lambda b: 2**21 * -(-(3000 + 170 * b) // 2**6), 8),  # the allocator's rounding: steps
        (lambda b: 1000 + 300 * b + 5 * b * b, 14),  # rising faster at large batches
        (lambda b: 100, 13),  # flat: doubled up to the most, 4096
    ],
)
@pytest.mark.parametrize("usable", [1200, 1700, 20_000, 800_000, 2**22, 2**31])
def test_the_planners_batch_is_the_largest_predicted_to_fit_in_few_predictions(
    curve: Any, most_asked: int, usable: int
) -> None:
    """nnUNetPlannerBigBatch's batch, found by extrapolating the batches that fit: the one a
    prediction of every batch from 1 to 4096 gives, with both it and the next one predicted,
    in a handful of predictions (nnU-Net asks for a batch for each patch it considers; its
    planning of this suite's dataset took 31 by doubling, 19 now)."""
    asked: list[int] = []

    def peak(batch: int) -> int:
        asked.append(batch)
        return int(curve(batch))

    fits = [b for b in range(1, 4097) if curve(b) <= usable]
    expected = max(fits, default=0)
    assert fits == list(range(1, expected + 1))  # the curves rise: the answer is a boundary
    got = nnunet.largest_fitting_batch(peak, usable)
    assert got == expected
    assert got in (0, 4096) or {got, got + 1} <= set(asked)
    assert len(set(asked)) <= most_asked, sorted(set(asked))
