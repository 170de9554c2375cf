"""On a real NVIDIA GPU (`pytest -m cuda tests/gpu`): a checkpoint's host copy of weights and
optimizer state that live on the GPU, taken before the next steps change them, as `bigbatch
train` writes them off the training thread. Skipped without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bigbatch.io import BackgroundWriter
from bigbatch.train.checkpoint import (
    host_copy,
    load_state,
    load_weights_file,
    save_state,
    write_weights,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def test_the_host_copy_holds_the_gpu_state_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).cuda()
    model = model.to(memory_format=torch.channels_last)  # non-contiguous weights, as trained
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(torch.randn(4, 3, 16, 16, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    state = host_copy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    with BackgroundWriter() as files:
        files.submit(write_weights, state["model"], tmp_path / "last.safetensors")
        files.submit(save_state, state, tmp_path / "last.pt")
        for _ in range(3):  # the live tensors change while the files are written
            step()
    assert all(v.device.type == "cpu" for v in state["model"].values())
    loaded = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    load_weights_file(loaded, tmp_path / "last.safetensors")
    assert all(torch.equal(loaded.state_dict()[k], before[k]) for k in before)
    saved = load_state(tmp_path / "last.pt")
    assert all(torch.equal(saved["model"][k], before[k]) for k in before)
    assert not torch.equal(model.state_dict()["0.weight"].cpu(), before["0.weight"])
