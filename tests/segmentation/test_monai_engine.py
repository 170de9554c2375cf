"""MONAI as the segmentation engine: its networks and per-sample losses accumulate exactly (the
naive loss / N does not), per-case scores are the challenge's, and the planner traces MONAI's
networks (DynUNet shares a module between two parents)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from bigbatch.segmentation.losses import per_sample_loss
from bigbatch.segmentation.metrics import CaseScores, parse_regions
from bigbatch.segmentation.networks import build_network, size_multiple
from bigbatch.verify import verify

pytest.importorskip("monai")


def volumes(n: int, classes: int, void: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, 8, 8, 8, generator=g)
    labels = torch.randint(0, classes, (n, 8, 8, 8), generator=g)
    if void is not None:
        labels[:, :2] = void  # a void slab in every volume
    return x, labels


def segresnet() -> nn.Module:
    return build_network("segresnet", 2, 3, dims=3, size=8, widths=(4, 8), norm="group")


def dynunet() -> nn.Module:
    return build_network("dynunet", 2, 3, dims=3, size=8, widths=(4, 8, 8), norm="instance")


CASES: dict[str, tuple[Callable[[], nn.Module], str, int | None]] = {
    "segresnet_dice_ce": (segresnet, "dice_ce", None),
    "dynunet_dice_focal": (dynunet, "dice_focal", None),
    "dynunet_dice_ce_void": (dynunet, "dice_ce", 255),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_monai_networks_and_losses_accumulate_exactly_and_naive_does_not(name: str) -> None:
    build, loss_name, void = CASES[name]
    torch.manual_seed(0)
    x, y = volumes(3, 3, void)
    loss = per_sample_loss(loss_name, num_classes=3, ignore_index=void)
    results = verify(
        build(), x, y, [1, 2], loss, methods=("bigbatch", "naive"),
        dtypes=(torch.float64, torch.float32),
    )  # fmt: skip
    got = {(r.method, r.dtype): r for r in results}
    assert got[("bigbatch", "float64")].max_rel <= 1e-12
    ours = got[("bigbatch", "float32")]
    assert ours.passed and ours.tolerance <= 4 * max(ours.roundoff, 2.5e-7)
    # The negative control: loss / N weights the lone sample like the pair, and fails the same check.
    assert not got[("naive", "float64")].passed and not got[("naive", "float32")].passed


def test_void_voxels_count_nowhere_in_the_loss() -> None:
    loss = per_sample_loss("dice_ce", num_classes=3, ignore_index=255)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 6, 6))
    y[:, 0] = 255
    changed = x.clone()
    changed[:, :, 0] += 100.0  # the void row's logits, whatever they are
    assert torch.allclose(loss(x, y), loss(changed, y), rtol=0, atol=1e-12)


def test_binary_loss_takes_one_sigmoid_channel() -> None:
    loss = per_sample_loss("dice_focal", num_classes=1)
    perfect = torch.full((2, 1, 4, 4), -20.0, dtype=torch.float64)
    mask = torch.zeros(2, 4, 4, dtype=torch.long)
    perfect[:, :, :2] = 20.0
    mask[:, :2] = 1
    assert float(loss(perfect, mask)) < 1e-4
    with pytest.raises(ValueError, match="not one of"):
        per_sample_loss("tversky", num_classes=1)


def test_scores_are_per_case_means_not_pooled() -> None:
    # Case 1: a 4-pixel structure found exactly; case 2: 28 of a 60-pixel one found. Pooled Dice
    # is dominated by the large case; the challenge's mean over cases weights both alike.
    truth = torch.zeros(2, 8, 8, dtype=torch.long)
    truth[0, :2, :2] = 1
    truth[1, :, :] = 1
    truth[1, 0, :4] = 0
    pred = truth.clone()
    pred[1, 4:, :] = 0
    logits = torch.where(pred[:, None] == 1, 5.0, -5.0)
    s = CaseScores(num_classes=1, hd95=False)
    s.update(logits, truth)
    per_case = [1.0, 2 * 28 / (60 + 28)]
    assert math.isclose(s.compute()["dice"], sum(per_case) / 2, rel_tol=1e-6)


def test_regions_score_nested_unions_and_hd95_follows_the_conventions() -> None:
    regions = parse_regions("wt:1,2,3;tc:1,3;et:3")
    truth = torch.zeros(1, 8, 8, 8, dtype=torch.long)
    truth[0, 2:6, 2:6, 2:6] = 2  # oedema
    truth[0, 3:5, 3:5, 3:5] = 1  # necrotic core, inside; no enhancing tumour
    logits = torch.nn.functional.one_hot(truth, 4).movedim(-1, 1).float() * 10
    s = CaseScores(num_classes=4, regions=regions, spacing=(1.0, 1.0, 2.0))
    s.update(logits, truth)
    row = s.compute()
    assert row["dice_wt"] == pytest.approx(1.0) and row["dice_tc"] == pytest.approx(1.0)
    assert row["dice_et"] == 1.0 and row["hd95_et"] == 0.0  # absent from both: perfect
    wrong = logits.clone()
    wrong[:, 3] += 100 * (truth == 1)[:, None].squeeze(1).float()  # the core called enhancing
    s2 = CaseScores(num_classes=4, regions=regions)
    s2.update(wrong, truth)
    row2 = s2.compute()
    assert row2["dice_et"] == 0.0 and row2["hd95_et"] == pytest.approx(math.sqrt(3 * 64))
    with pytest.raises(ValueError, match="name:labels"):
        parse_regions("wt=1,2,3")


def test_every_network_builds_in_2d_and_its_size_multiple_holds() -> None:
    for arch in ("unet", "segresnet", "dynunet", "unetr", "swinunetr"):
        widths = (12, 24, 24) if arch != "swinunetr" else ()
        size = 2 * size_multiple(arch, widths)
        net = build_network(arch, 1, 2, dims=2, size=size, widths=widths)
        assert net(torch.zeros(1, 1, size, size)).shape == (1, 2, size, size), arch
    with pytest.raises(ValueError, match="divide by 12"):
        build_network("swinunetr", 1, 2, dims=2, size=64, widths=(16, 32))
    with pytest.raises(ValueError, match="norm='layer'"):
        build_network("unet", 1, 2, dims=2, size=16, norm="layer")


@pytest.mark.slow
def test_the_planner_traces_swinunetr_whose_constructor_reads_a_value_back() -> None:
    """SwinUNETR's constructor reads its stochastic depth rates back (``.item()``), which the
    meta device cannot: it is built on the CPU and kept as shapes, then traced as any other
    (before, ``bigbatch plan`` and ``bigbatch train arch=swinunetr`` stopped there)."""
    from bigbatch.memory.meta import build_on_meta
    from bigbatch.memory.predict import predict_peak
    from bigbatch.memory.step import StepSpec

    def swin() -> torch.nn.Module:
        return build_network("swinunetr", 1, 2, dims=2, size=64, widths=(12, 24))

    assert all(p.is_meta for p in build_on_meta(swin).parameters())
    assert predict_peak(StepSpec(swin, (1, 64, 64), 2, optimizer="sgd")).peak_bytes > 0


def test_the_planner_traces_dynunet_whose_output_block_has_two_parents() -> None:
    from bigbatch.memory.predict import predict_peak
    from bigbatch.memory.step import StepSpec

    spec = StepSpec(dynunet, (2, 16, 16, 16), 2, optimizer="sgd")
    prediction = predict_peak(spec)
    unique = sum(p.numel() * p.element_size() for p in dynunet().parameters())
    assert prediction.parameters == unique  # the shared block counted once
    assert prediction.peak_bytes > unique


def test_a_batch_loss_is_exact_through_gradient_caching_and_not_without() -> None:
    from bigbatch import Accumulator
    from bigbatch.backoff import OOMBackoff, run_coupled_window, run_window
    from bigbatch.segmentation.losses import batch_loss

    loss = batch_loss("dice_ce_batch", num_classes=3, ignore_index=255)
    x, y = volumes(4, 3, void=255)
    x, y = x.double(), y

    def step(runner: str, micro_batch: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = dynunet().double()
        acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
        backoff = OOMBackoff(micro_batch=micro_batch)
        if runner == "coupled":
            run_coupled_window(acc, (x, y), model, loss, backoff)
        else:
            run_window(acc, (x, y), lambda b: loss(model(b[0]), b[1]), backoff)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    big = step("plain", 4)  # one micro-batch: the big batch itself
    cached = step("coupled", 1)
    plain = step("plain", 1)

    def rel(a: dict[str, torch.Tensor]) -> float:
        return max(float((a[n] - big[n]).abs().max() / big[n].abs().max()) for n in big)

    assert rel(cached) <= 1e-12
    assert rel(plain) > 1e-6  # per micro-batch, the batch Dice is another objective


@pytest.mark.slow
def test_bigbatch_plan_takes_monai_networks_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from bigbatch.cli.main import main

    args = ["plan", "--arch", "segresnet,dynunet", "--input-shape", "2,16,16,16", "--widths",
            "4,8,16", "--num-classes", "3", "--batch", "4", "--budget", "1GB", "--overhead", "0",
            "--no-calibrate"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "segresnet" in out and "dynunet" in out and "4 x 1" in out
    assert main([*args[:4], "2,15,16,16", *args[5:]]) == 2
    assert "divisible by 4" in capsys.readouterr().err
