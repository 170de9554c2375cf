"""A deep model's CUDA trace made from a 5-layer model's (bigbatch.memory.stack): the same
prediction, to the byte, as the full trace, and never made where it would not be."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")
import transformers

from bigbatch.memory.evaluate import predict_evaluation_peak
from bigbatch.memory.lm import LMSetup, lm_spec_at
from bigbatch.memory.predict import MemoryPrediction, predict_peak
from bigbatch.memory.stack import LayerStack
from bigbatch.memory.step import StepSpec


def same(a: MemoryPrediction, b: MemoryPrediction) -> bool:
    return replace(a, seconds=0.0) == replace(b, seconds=0.0)


def full_trace(spec: StepSpec) -> MemoryPrediction:
    return predict_peak(replace(spec, layers=None))


def decoder(layers: int = 10) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        dtype="bfloat16",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "steps", "optimizer"),
    [
        (LMSetup(seq_len=32, lora_r=4, gradient_checkpointing=True), ((1, 8), (3, 8)), "adamw"),
        (LMSetup(seq_len=32), ((2, 2),), "adamw"),
        (LMSetup(seq_len=32), ((2, 2),), "adamw_fused"),
        (LMSetup(seq_len=32, lora_r=4, quant=4, gradient_checkpointing=True, packing=True),
         ((2, 8),), "adamw"),
    ],
    ids=["lora-checkpointed", "full", "full-fused", "qlora-packed"],
)  # fmt: skip
def test_a_deep_decoder_is_traced_from_a_shallow_one_to_the_byte(
    setup: LMSetup, steps: tuple[tuple[int, int], ...], optimizer: str
) -> None:
    """Its 10 layers from 5: LoRA with activation checkpointing (a micro-batch of one sequence,
    and of several, with an attention mask), a full fine-tune's lone step (every layer's weights
    in the optimizer's multi-tensor ops, or in the fused AdamW's one kernel, whose step counts
    are on the card), QLoRA's 4-bit base on packed sequences: each the full trace's
    prediction, every field."""
    spec_at = lm_spec_at(decoder(), setup, optimizer=optimizer)
    for b, window in steps:
        spec = spec_at(b).in_window(window)
        assert same(predict_peak(spec), full_trace(spec))
        kind = (False, b > 1, b < window)
        assert spec.layers is not None and spec.layers.checked[kind]  # extrapolated


@pytest.mark.slow
def test_evaluations_forward_is_extrapolated_too() -> None:
    """Evaluation's forward pass (no gradients, the optimizer's state alive) at 3 sequences."""
    spec = lm_spec_at(decoder(), LMSetup(seq_len=32, lora_r=4))(3)
    full = predict_evaluation_peak(replace(spec, layers=None))
    assert same(predict_evaluation_peak(spec), full)
    assert spec.layers is not None and spec.layers.checked == {(True, True, False): True}


class Block(nn.Module):
    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        inner = 512 if wide else 128
        self.up, self.down = nn.Linear(128, inner), nn.Linear(inner, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def blocks(n: int, wide_at: int | None = None) -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 128), *[Block(i == wide_at) for i in range(n)], nn.Linear(128, 10)
    )


def of_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model if isinstance(m, Block)]


def spec_of(stack: LayerStack, wide_at: int | None = None) -> StepSpec:
    return StepSpec(lambda: blocks(12, wide_at), (32,), 16, precision="bf16", device="cuda",
                    layers=stack)  # fmt: skip


@pytest.mark.slow
def test_any_stack_of_blocks_and_only_one_whose_blocks_are_alike() -> None:
    """A model of one's own: twelve residual blocks, extrapolated from five, are the full trace.
    One block four times as wide (the ninth) is not alike: traced in full, where extrapolated
    from five alike blocks anyway (told they are alike) its peak would be missed."""
    stack = LayerStack(12, lambda n: lambda: blocks(n), of_blocks)
    spec = spec_of(stack)
    assert same(predict_peak(spec), full_trace(spec)) and stack.checked == {
        (False, True, False): True
    }

    odd = LayerStack(12, lambda n: lambda: blocks(n, 8 if n > 8 else None), of_blocks)
    spec = spec_of(odd, wide_at=8)
    whole = full_trace(spec)
    assert same(predict_peak(spec), whole) and odd.uniform is False and odd.checked == {}
    told = LayerStack(12, lambda n: lambda: blocks(n), of_blocks, uniform=True)
    assert predict_peak(replace(spec, layers=told)).peak_bytes < whole.peak_bytes


@pytest.mark.slow
def test_a_shallow_trace_that_does_not_make_the_deeper_ones_events_is_not_used() -> None:
    """The 6-layer model's trace is the check: where the 5-layer one, extrapolated, does not
    make its events (here its fourth block is wider), every size of that kind is traced in full;
    so too where the shallow model cannot be built."""
    stack = LayerStack(12, lambda n: lambda: blocks(n, 3 if n == 6 else None), of_blocks)
    spec = spec_of(stack)
    assert same(predict_peak(spec), full_trace(spec)) and stack.checked == {
        (False, True, False): False
    }

    def unbuildable(n: int) -> Callable[[], nn.Module]:  # a config that cannot be cut down
        raise ValueError(f"no model of {n} layers")

    broken = LayerStack(12, unbuildable, of_blocks)
    spec = spec_of(broken)
    assert same(predict_peak(spec), full_trace(spec)) and broken.checked == {
        (False, True, False): False
    }


def test_a_shallow_model_or_another_device_is_traced_as_it_is() -> None:
    shallow = LayerStack(6, lambda n: lambda: blocks(n), of_blocks)
    cpu = LayerStack(12, lambda n: lambda: blocks(n), of_blocks)
    for stack, device in ((shallow, "cuda"), (cpu, "cpu")):
        spec = replace(spec_of(stack), device=device)
        predict_peak(spec)
        assert stack.checked == {} and stack.uniform is None
