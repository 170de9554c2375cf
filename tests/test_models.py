"""timm's pretrained weights through the Hugging Face hub cache, offline (issue 9).

The test builds the cache itself, in the hub's layout, with weights it makes: nothing is
downloaded. Runs in a subprocess, since huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE
when it is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from bigbatch.models import timm_factory
    from bigbatch.train.config import ConfigError, load_config
    from bigbatch.train.tasks.classification.task import build_model
    try:
        factory = timm_factory("resnet10t", num_classes=3, pretrained=True)
    except ValueError as exc:
        print("ERROR", exc)
        sys.exit(0)
    model = factory()
    saved = torch.load(sys.argv[1], weights_only=True)
    same = all(torch.equal(model.state_dict()[k], v) for k, v in saved.items() if "fc." not in k)
    print("LOADED", same, model.fc.out_features)
    with torch.device("meta"):  # a plan's shapes-only build loads nothing
        print("META", all(p.is_meta for p in factory().parameters()))
    """
)


def _run(tmp_path: Path, cache: Path, script: str = SCRIPT) -> str:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    env.pop("HF_HOME", None)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "saved.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_pretrained_weights_load_offline_from_a_hub_cache(tmp_path: Path) -> None:
    import timm

    from helpers import write_hub_cache

    torch.manual_seed(1)
    weights = timm.create_model("resnet10t", num_classes=1000).state_dict()
    torch.save(weights, tmp_path / "saved.pt")
    write_hub_cache(tmp_path / "hub", "timm/resnet10t.c3_in1k", weights)
    out = _run(tmp_path, tmp_path / "hub")
    # The backbone is the cached one; the 1000-class head became a new 3-class head.
    assert "LOADED True 3" in out and "META True" in out, out


@pytest.mark.slow
def test_no_cache_and_no_network_is_one_clear_line(tmp_path: Path) -> None:
    out = _run(tmp_path, tmp_path / "empty-hub")
    assert out.startswith("ERROR pretrained weights for resnet10t (timm/resnet10t.c3_in1k)")
    assert str(tmp_path / "empty-hub") in out and "weights=FILE" in out


def test_pretrained_config_checks() -> None:
    from bigbatch.train.config import ConfigError, load_config

    cfg = load_config(overrides=["data=x", "pretrained=true"])
    assert cfg.fine_tunes  # mode=auto fine-tunes pretrained weights
    with pytest.raises(ConfigError, match="choose one"):
        load_config(overrides=["data=x", "pretrained=true", "weights=w.pt"])
    with pytest.raises(ConfigError, match="model= factory"):
        load_config(overrides=["data=x", "pretrained=true", "model=m:f"])


SMP_SCRIPT = """
import sys, torch
from bigbatch.segmentation.decoders import smp_factory
try:
    factory = smp_factory("unet", "resnet10t", in_channels=3, num_classes=4, pretrained=True)
except ValueError as exc:
    print("ERROR", exc)
    sys.exit(0)
saved = torch.load(sys.argv[1], weights_only=True)
encoder = factory().encoder.state_dict()
same = [torch.equal(v, saved[k.removeprefix("model.")]) for k, v in encoder.items()
        if k.removeprefix("model.") in saved]
print("LOADED", len(same) > 10 and all(same))
"""


@pytest.mark.slow
def test_a_pretrained_smp_encoder_loads_offline_from_the_hub_cache(tmp_path: Path) -> None:
    import timm

    pytest.importorskip("segmentation_models_pytorch")
    from helpers import write_hub_cache

    torch.manual_seed(1)
    weights = timm.create_model("resnet10t", num_classes=1000).state_dict()
    torch.save(weights, tmp_path / "saved.pt")
    write_hub_cache(tmp_path / "hub", "timm/resnet10t.c3_in1k", weights)
    assert "LOADED True" in _run(tmp_path, tmp_path / "hub", SMP_SCRIPT)
    out = _run(tmp_path, tmp_path / "empty-hub", SMP_SCRIPT)  # neither a network nor a cache
    assert out.startswith("ERROR pretrained weights for the encoder resnet10t")
    assert str(tmp_path / "empty-hub") in out and "weights=FILE" in out


@pytest.mark.slow
def test_checkpointed_accumulation_equals_the_big_batch() -> None:
    """Activation checkpointing recomputes, and changes no update: three SGD steps (momentum,
    weight decay) over windows of uneven micro-batches (3, 3, 1) through the checkpointed model equal
    three big-batch steps without it in float64, every tensor, a frozen weight left without a
    gradient in both; loss / N does not."""
    import timm

    from bigbatch.models import enable_grad_checkpointing
    from helpers import big_batch_run, bigbatch_run, max_rel_diff, naive_run

    def vit(checkpointed: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = timm.create_model("test_vit", num_classes=5).double()
        model.pos_embed.requires_grad_(False)  # frozen: no gradient, in every run
        return enable_grad_checkpointing(model) if checkpointed else model

    def sgd(params: Any) -> torch.optim.Optimizer:
        trained = [p for p in params if p.requires_grad]
        return torch.optim.SGD(trained, lr=0.1, momentum=0.9, weight_decay=0.05)

    g = torch.Generator().manual_seed(1)
    windows = [
        [(torch.randn(n, 3, 160, 160, generator=g).double(), torch.randint(0, 5, (n,), generator=g))
         for n in (3, 3, 1)]
        for _ in range(3)
    ]  # fmt: skip
    want = big_batch_run(vit(False), windows, sgd)
    ours, _ = bigbatch_run(vit(True), [[b for w in windows for b in w]], sgd, micro_batches=3)
    naive = naive_run(vit(True), windows, 3, sgd)
    assert max_rel_diff(ours, want) < 1e-12
    assert max_rel_diff(naive, want) > 1e-6
    assert all(m.pos_embed.grad is None for m in (want, ours, naive))
    assert not torch.equal(ours.head.weight, vit(False).head.weight)  # it stepped


def test_wrapped_blocks_accumulate_as_the_big_batch_and_keep_the_weights_names(
    tmp_path: Path,
) -> None:
    """A network without a library switch (bigbatch's U-Net, GroupNorm) gets torch's
    checkpoint_wrapper around its blocks: two SGD steps (momentum, weight decay) over uneven
    micro-batches (3, 1, 2) equal the big batch without checkpointing in float64, every
    tensor, a frozen weight inside a wrapped block left without a gradient in each; loss / N
    does not; its weights file loads into the plain network and the plain one's into it."""
    from bigbatch.models import enable_grad_checkpointing
    from bigbatch.segmentation.models import unet2d
    from bigbatch.train.checkpoint import host_copy, load_weights_file, write_weights
    from helpers import big_batch_run, bigbatch_run, max_rel_diff, naive_run

    def net(checkpointed: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = unet2d(in_channels=2, num_classes=3, width=4, depth=2).double()
        model.down[0][0].bias.requires_grad_(False)  # frozen: no gradient, in every run
        return enable_grad_checkpointing(model) if checkpointed else model

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, y)

    def sgd(params: Any) -> torch.optim.Optimizer:
        trained = [p for p in params if p.requires_grad]
        return torch.optim.SGD(trained, lr=0.5, momentum=0.9, weight_decay=0.05)

    g = torch.Generator().manual_seed(3)
    windows = [
        [(torch.randn(n, 2, 16, 16, generator=g).double(),
          torch.randint(0, 3, (n, 16, 16), generator=g))
         for n in (3, 1, 2)]
        for _ in range(2)
    ]  # fmt: skip
    want = big_batch_run(net(False), windows, sgd, loss_fn=loss)
    flat = [[b for w in windows for b in w]]
    ours, _ = bigbatch_run(net(True), flat, sgd, loss_fn=loss, micro_batches=3)
    naive = naive_run(net(True), windows, 3, sgd, loss_fn=loss)
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in ours.modules()) == 5
    assert max_rel_diff(ours, want) < 1e-12
    assert max_rel_diff(naive, want) > 1e-6
    assert all(m.down[0][0].bias.grad is None for m in (want, ours, naive))
    assert not torch.equal(ours.head.weight, net(False).head.weight)  # it stepped
    write_weights(host_copy(ours.state_dict()), tmp_path / "ours.safetensors")
    plain = net(False)
    load_weights_file(plain, tmp_path / "ours.safetensors")
    x = windows[0][0][0]
    assert torch.equal(plain(x), ours(x))
    write_weights(host_copy(want.state_dict()), tmp_path / "want.safetensors")
    load_weights_file(ours, tmp_path / "want.safetensors")
    assert torch.equal(ours(x), want(x))


def test_a_torch_without_the_wrapper_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch was built without torch.distributed (so without checkpoint_wrapper), a
    network that needs the wrapper is refused with the fix, not an ImportError's traceback."""
    from bigbatch.models import enable_grad_checkpointing
    from bigbatch.segmentation.models import unet2d

    monkeypatch.setitem(
        sys.modules, "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", None
    )
    with pytest.raises(ValueError, match=r"^UNet's blocks .* train without checkpointing, or"):
        enable_grad_checkpointing(unet2d(width=4, depth=2))


def test_every_recomputed_block_names_a_class_its_library_has() -> None:
    """The blocks torch's checkpoint_wrapper recomputes are named by class path: a library
    that moved one would leave its networks with fewer blocks checkpointed than planned."""
    import importlib

    from bigbatch.models import _RECOMPUTED_BLOCKS

    for path in sorted(_RECOMPUTED_BLOCKS):
        module, name = path.rsplit(".", 1)
        assert isinstance(getattr(importlib.import_module(module), name), type), path
