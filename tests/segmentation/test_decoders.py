"""segmentation_models_pytorch's decoders on timm encoders, by name: every arch builds at a
non-square size, the decoders' normalisation follows norm=, and bad names or combinations are
refused before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bigbatch.segmentation.decoders import SMP_ARCHS, smp_factory
from bigbatch.train.config import ConfigError, load_config
from bigbatch.train.tasks.segmentation.task import build_seg_model

pytest.importorskip("segmentation_models_pytorch")


@pytest.mark.parametrize("arch", SMP_ARCHS)
def test_each_decoder_builds_on_a_timm_encoder(arch: str) -> None:
    net = smp_factory(arch, "resnet10t", in_channels=4, num_classes=3)()
    assert net(torch.zeros(2, 4, 64, 96)).shape == (2, 3, 64, 96)  # full frames are not square


def test_the_unet_decoder_normalises_per_sample_by_default() -> None:
    def norms(norm: str) -> set[str]:
        net = smp_factory("unet", "resnet10t", in_channels=3, num_classes=1, norm=norm)()
        return {type(m).__name__ for m in net.decoder.modules() if "Norm" in type(m).__name__}

    assert norms("instance") == {"InstanceNorm2d"} and norms("batch") == {"BatchNorm2d"}
    with pytest.raises(ValueError, match="norm=group for smp's unet decoder"):
        smp_factory("unet", "resnet10t", in_channels=3, num_classes=1, norm="group")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["arch=unet", "encoder=resnet10t", "widths=8,16"],
         "widths=8,16: the channels of MONAI's networks, and arch=unet encoder=resnet10t is "
         "segmentation_models_pytorch's decoder .*: drop widths"),
        (["arch=resnet10t", "widths=8,16"], "arch=resnet10t is segmentation_models_pytorch"),
        (["model=m:f", "arch=unet", "widths=8,16", "norm=batch"],
         "widths=8,16, norm=batch: for the networks bigbatch builds, and model=m:f builds your "
         "own: drop them"),
    ],
)  # fmt: skip
def test_network_keys_where_another_network_is_built_are_refused(
    overrides: list[str], match: str
) -> None:
    """widths= where smp's decoder on a timm encoder is built (its channels are the
    encoder's), the network keys where model= builds the network: refused, not ignored."""
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=["data=x", "task=segmentation", *overrides])


def test_a_meta_build_loads_nothing() -> None:
    with torch.device("meta"):  # the planner's shapes-only build
        net = smp_factory("unetplusplus", "resnet10t", in_channels=3, num_classes=2)()
    assert all(p.is_meta for p in net.parameters())


@pytest.mark.parametrize(
    ("overrides", "dims", "match"),
    [
        (["arch=segresnet", "encoder=resnet10t"], 2, "with encoder= is one of unet, unetplus"),
        (["arch=unet", "encoder=resnet1t"], 2, "unknown architecture 'resnet1t': did you mean"),
        (["arch=unet", "encoder=resnet10t"], 3, "timm encoders are 2D"),
        (["arch=resnet10t"], 3, "timm encoders are 2D"),
    ],
)
def test_bad_networks_are_refused_with_the_fix(
    overrides: list[str], dims: int, match: str, tmp_path: Path
) -> None:
    cfg = load_config(overrides=["data=x", "task=segmentation", *overrides])
    with pytest.raises(ConfigError, match=match):
        build_seg_model(cfg, 3, 2, dims)


@pytest.mark.slow
def test_bigbatch_plan_takes_an_smp_decoder_on_an_encoder(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bigbatch.cli.main import main

    args = ["plan", "--arch", "unet,fpn", "--encoder", "resnet10t", "--input-shape", "3,64,96",
            "--num-classes", "4", "--batch", "8", "--budget", "2GB", "--overhead", "0",
            "--no-calibrate"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "unet:resnet10t" in out and "fpn:resnet10t" in out and "8 x 1" in out
    assert main([*args[:6], "3,64,90", *args[7:]]) == 2  # not a multiple of 32
    assert "multiples of 32 (pad the image: 64x96)" in capsys.readouterr().err
    assert main([*args[:4], "resnet1t", *args[5:]]) == 2
    assert "unknown architecture 'resnet1t'" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["fpn", "deeplabv3plus"])
def test_a_norm_these_decoders_cannot_take_is_refused(arch: str) -> None:
    with pytest.raises(ValueError, match=f"norm=batch: smp's {arch} decoder normalises with"):
        smp_factory(arch, "resnet18", in_channels=3, num_classes=2, norm="batch")


@pytest.mark.slow
def test_grad_checkpointing_is_switched_by_the_library_or_refused(tmp_path: Path) -> None:
    """``grad_checkpointing=true``: the timm encoder under an smp decoder and SwinUNETR's Swin
    blocks are switched by their libraries' own flags, the decoders' blocks and MONAI's
    networks without a flag get torch's checkpoint_wrapper (SwinUNETR's convolutional blocks
    too), their weights' names unchanged, the gradients as without (float64); a network with
    neither is refused in one line when first built (the planner's build, before any
    training)."""
    from bigbatch.models import enable_grad_checkpointing
    from bigbatch.segmentation.networks import build_network
    from bigbatch.train.planning import model_factory_for

    def wrapped(net: torch.nn.Module) -> int:
        return sum(type(m).__name__ == "CheckpointWrapper" for m in net.modules())

    def grads(net: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        torch.manual_seed(1)  # FPN's dropout draws the same masks in both
        net.train()(x).square().mean().backward()
        return [p.grad for p in net.parameters() if p.grad is not None]

    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for arch in ("unet", "unetplusplus", "fpn"):
        torch.manual_seed(0)
        plain = smp_factory(arch, "resnet10t", in_channels=3, num_classes=2)().double()
        want = grads(plain, x)
        torch.manual_seed(0)
        decoded = smp_factory(arch, "resnet10t", in_channels=3, num_classes=2)().double()
        decoded = enable_grad_checkpointing(decoded)
        assert decoded.encoder.model.grad_checkpointing  # smp's tu- encoder: a timm model
        assert wrapped(decoded) > 0, arch  # its decoder's blocks, in torch's wrapper
        # The same gradients: the ResNet stem's in-place ReLU, which timm's feature extractor
        # checkpoints apart, no longer breaks the backward.
        assert all(torch.equal(g, w) for g, w in zip(grads(decoded, x), want, strict=True))
    swin = enable_grad_checkpointing(build_network("swinunetr", 1, 2, dims=2, size=32))
    flags = [m.use_checkpoint for m in swin.modules() if hasattr(m, "use_checkpoint")]
    assert flags and all(flags)
    assert wrapped(swin) > 0
    for arch in ("unet", "segresnet", "dynunet", "unetr"):
        plain = build_network(arch, 1, 2, dims=2, size=32, widths=(12, 24, 48))
        names = plain.state_dict().keys()
        net = enable_grad_checkpointing(plain)
        assert wrapped(net) > 0 and net.state_dict().keys() == names, arch
    unet = load_config(overrides=[f"data={tmp_path}", "task=segmentation", "arch=unet",
                                  "grad_checkpointing=true"])  # fmt: skip

    class Task:
        def model_factory(self):  # type: ignore[no-untyped-def]
            return lambda: torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3))

    with pytest.raises(ConfigError, match=r"^grad_checkpointing=true: Sequential has no activation "
                       r"checkpointing .*: train it without, or wrap its blocks"):  # fmt: skip
        model_factory_for(Task(), unet)()  # type: ignore[arg-type]
