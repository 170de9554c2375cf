"""On a real NVIDIA GPU (`pytest -m cuda tests/gpu`): bigbatch train's AdamW is torch's fused
one on a card, and steps through fp16's GradScaler as the multi-tensor one does: a window with
an overflow is skipped whole, a finite one updates alike to float32's round-off. Skipped where
there is no GPU (CI), which simulates the choice (tests/test_device.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from bigbatch import Accumulator, device
from bigbatch.train.config import TrainConfig
from bigbatch.train.optim import make_optimizer, plan_optimizer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def _windows() -> tuple[torch.optim.Optimizer, list[list[torch.Tensor]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    opt, _ = make_optimizer(TrainConfig(data="x"), model.cuda(), "all", 10)
    acc = Accumulator(opt, micro_batches=2, scaler=torch.amp.GradScaler("cuda"))
    after: list[list[torch.Tensor]] = []
    for overflow in (False, True, False):
        for n in (5, 3):
            x = torch.randn(n, 8, device="cuda")
            if overflow:
                x[0, 0] = float("inf")
            y = torch.randint(0, 3, (n,), device="cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            acc.backward(loss, count=n)
        result = acc.step()
        assert result.skipped == overflow
        after.append([p.detach().clone() for p in model.parameters()])
    return opt, after


def test_fused_adamw_steps_through_the_scaler_as_the_multi_tensor_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert plan_optimizer("adamw", "cuda") == "adamw_fused"
    fused, steps = _windows()
    assert fused.defaults["fused"]
    kinds = dict(device.DEVICE_KINDS)
    kinds["cuda"] = replace(kinds["cuda"], fused_adamw=False)
    monkeypatch.setattr(device, "DEVICE_KINDS", kinds)
    foreach, reference = _windows()
    assert not foreach.defaults["fused"]
    for got, want in zip(steps[1], steps[0], strict=True):
        assert torch.equal(got, want)  # the overflowing window left the weights alone
    eps = torch.finfo(torch.float32).eps
    for window, ref in zip(steps, reference, strict=True):
        for w, r in zip(window, ref, strict=True):
            torch.testing.assert_close(w, r, rtol=0, atol=16 * eps * float(r.abs().max()))
