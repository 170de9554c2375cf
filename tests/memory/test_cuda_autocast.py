"""CUDA autocast's rules in a CPU trace: the table matches what torch registers for CUDA, the
traced dtypes follow CUDA's lists, and the CPU's own rules (the negative control) do not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bigbatch.memory.cuda_autocast import CUDA_AUTOCAST_POLICY, cuda_autocast_rules


def test_the_table_is_every_op_torch_autocasts_on_cuda() -> None:
    registered = {  # torchvision's own ops (roi_align, nms) cast alike on both devices
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
        if name.startswith("aten::")
    }
    assert set(CUDA_AUTOCAST_POLICY) == registered


def _dtypes(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.dtype]:
    with torch.autocast("cpu", dtype=torch.float16):
        h = x @ w  # CUDA: float16
        conv = F.conv2d(x.view(2, 2, 2, 2), w[:2].reshape(2, 2, 2, 2))
        return {
            "matmul": h.dtype,
            "conv2d": conv.dtype,
            "layer_norm": F.layer_norm(h, (8,)).dtype,
            "group_norm": F.group_norm(conv, 1).dtype,
            "softmax": h.softmax(-1).dtype,
            "log_softmax": F.log_softmax(h, -1).dtype,
            "mse_loss": F.mse_loss(h, h).dtype,
            "cat (no autocast)": torch.cat([h, h]).dtype,
        }


CUDA_DTYPES = {
    "matmul": torch.float16,
    "conv2d": torch.float16,
    "layer_norm": torch.float32,
    "group_norm": torch.float32,
    "softmax": torch.float32,
    "log_softmax": torch.float32,
    "mse_loss": torch.float32,
    "cat (no autocast)": torch.float16,
}


def test_traced_dtypes_follow_cudas_lists_and_the_cpu_rules_do_not() -> None:
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    with cuda_autocast_rules():
        assert _dtypes(x, w) == CUDA_DTYPES
    cpu = _dtypes(x, w)  # the CPU's lists: what a CUDA trace used before
    assert cpu != CUDA_DTYPES
    assert cpu["layer_norm"] == cpu["softmax"] == torch.float16


def test_the_rules_are_gone_after_the_block_and_gradients_flow() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.layer_norm(x @ x.T, (4,))
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(x @ x.T, (4,)).dtype == torch.bfloat16


def test_an_explicit_dtype_wins_over_the_fp32_rule() -> None:
    h = torch.randn(2, 8, dtype=torch.float16)
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.softmax(h, -1, dtype=torch.float16).dtype == torch.float16
        assert h.sum().dtype == torch.float32


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_cuda_prediction_keeps_layer_norm_outputs_in_float32(precision: str) -> None:
    """A LayerNorm network's predicted activations under CUDA rules are larger than under the
    CPU's: its normalised outputs (saved for the next matmul's backward) are float32."""
    from bigbatch.memory.predict import predict_peak
    from bigbatch.memory.step import StepSpec

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256)) for _ in range(4)])  # fmt: skip

    spec = StepSpec(net, (256,), 512, precision=precision, device="cuda")  # type: ignore[arg-type]
    cuda = predict_peak(spec).activations
    cpu = predict_peak(StepSpec(net, (256,), 512, precision=precision)).activations  # type: ignore[arg-type]
    assert cuda > cpu


def test_an_op_this_torch_lacks_is_skipped_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table is the newest torch's: torch 2.11 has no ``linalg_matrix_sqrth``, and every
    CUDA prediction raised AttributeError there (seen on an H200 in make gpu-evidence)."""
    import bigbatch.memory.cuda_autocast as rules

    monkeypatch.setitem(rules.CUDA_AUTOCAST_POLICY, "an_op_no_torch_has", "fp32")
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.float16):
        assert (x @ w).dtype == torch.float16
        assert F.layer_norm(x @ w, (8,)).dtype == torch.float32
