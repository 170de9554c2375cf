"""bigbatch's CUDA memory model against real allocator traces of training steps recorded on an
NVIDIA H100 (torch 2.11, CUDA 13.0; ``data/gpu_truth/README.md`` says how), from a CPU.

The allocator model replays each trace's own events to its measured peaks; predictions from a
fake-tensor trace (CUDA autocast rules, cuBLAS and cuDNN workspaces, the context) are checked
against the measured allocated, reserved and process peaks, each row at the bound it meets
today, with the reason where that is looser than 5 %."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from bigbatch.memory.cuda_allocator import CachingAllocatorModel
from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES, cudnn_workspaces

# The traces, their loading and the workloads as StepSpecs: benchmarks/gpu_truth.py's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_truth import MiB, load, names, spec_of

CUDNN_WGRAD = "cuDNN's weight-gradient workspaces (another algorithm than the forward's copy)"
DEPTHWISE = "cuDNN's depthwise-convolution backward workspaces (38-96 MiB, not modelled)"
CUDNN_SIZES = (
    "cuDNN's workspaces at large batches are other sizes than the transposed-copy rule's (resnet50 "
    "b128: 244 transients of 12.8 GiB on the card, 312 of 30.6 GiB predicted): the card's "
    "profile (benchmarks/results/h200-*/cudnn-profile.json) is not read yet"
)
CUDNN_3D = "3D convolutions' workspaces (no rule for them)"
FP32_FRAGMENTS = (
    "the card reserves 1.84x the allocated peak (fp32 activations of 392-986 MiB); the replay of "
    "its own events misses by 196 MiB too (REPLAY_OFF)"
)


def replay(events: list[list[Any]]) -> CachingAllocatorModel:
    model = CachingAllocatorModel()
    for action, address, size, _ in events:
        if action == "alloc":
            model.malloc(address, size)
        elif action == "free_completed":
            model.free(address)
    return model


ROWS = names()
H200 = "h200-torch2.11/"  # make gpu-evidence on an H200 (benchmarks/results/h200-cuda13.0-*)

# Where the replay of a trace's own events is not the card's peak, by how much, and what is
# known of why. Everything else replays to the MiB.
REPLAY_OFF = {
    # The model reserves 228 MiB more than the card: it reuses none of the freed 48-74 MiB
    # blocks for the depthwise backward's workspaces where the card does (cause not found).
    H200 + "convnext_small-128-b64-fp16-adam": (-240 * MiB, 8 * MiB),
    H200 + "convnext_small-128-b32-fp16-adam": (-40 * MiB, 8 * MiB),
    # The card reserves 196 MiB more than the model for fp32 activations of 392-986 MiB
    # (cause not found: the same rules replay every smaller row to the MiB).
    H200 + "resnet18-224-b256-fp32-sgd": (200 * MiB, MiB),
    # The allocated peak 1.4-5.6 MiB over the card's (cause not found; reserved to the MiB).
    H200 + "smp_unet_resnet34-1024-b2-fp16-adamw": (4 * MiB, 8 * MiB),
    H200 + "smp_unet_resnet34-512-b8-bf16-adamw": (4 * MiB, 8 * MiB),
    H200 + "vit_base_patch16_224-224-b32-bf16-adamw": (4 * MiB, 4 * MiB),
    H200 + "vit_base_patch16_224-224-b64-bf16-adamw": (4 * MiB, 4 * MiB),
}


@pytest.mark.parametrize("name", ROWS)
def test_the_allocator_model_replays_each_trace_to_its_measured_peaks(name: str) -> None:
    """To the MiB where cuDNN's benchmark mode is off (the llama row 4 MiB over: one 20 MiB
    segment on the card where the model makes two 12 MiB ones, likely a tie between equal free
    blocks that the card breaks by address and the model by segment order), except the rows
    in REPLAY_OFF. With benchmark mode, the trials reserve more than their recorded events
    show (b32: 138 MiB), never less."""
    truth = load(name)
    model = replay(truth["events"])
    measured = truth["max_reserved_bytes"]
    if truth["cudnn_benchmark"]:
        assert abs(model.peak_allocated - truth["max_allocated_bytes"]) < 8 * MiB
        assert measured - 0.08 * measured <= model.peak_reserved <= measured + 16 * MiB
        return
    reserved_off, allocated_off = REPLAY_OFF.get(name, (4 * MiB, MiB))
    assert abs(model.peak_allocated - truth["max_allocated_bytes"]) < allocated_off
    if reserved_off > 4 * MiB:  # the card above the model by up to this
        assert measured - reserved_off <= model.peak_reserved <= measured
    elif reserved_off < 0:  # the model above the card by up to this
        assert measured <= model.peak_reserved <= measured - reserved_off
    else:
        assert abs(model.peak_reserved - measured) <= reserved_off


@dataclass(frozen=True)
class Row:
    name: str
    reserved_within: float = 0.05  # of the measured reserved peak
    process_within: float = 0.05  # of the measured process memory
    why: str = ""


PREDICTED = [
    Row("resnet18-128-b8-fp16-adamw"),
    Row("resnet18-128-b32-fp16-adamw", reserved_within=0.08, why=CUDNN_WGRAD),
    Row("convnext_small-128-b32-fp16-adam-nobench", 0.08, 0.06, DEPTHWISE),
    Row("convnext_small-128-b64-fp16-adam", 0.10, 0.08, DEPTHWISE + ", and benchmark trials"),
    Row("unet3d-96-b2-fp16-adamw"),
    Row("llama8L-1024-2k-b1-bf16-adamw-ckpt-frozen"),
    # An H200 (make gpu-evidence); the same rows as the H100's above where they repeat.
    *(
        Row(H200 + n)
        for n in (
            "convnext_small-128-b32-fp16-adam",
            "convnext_small-128-b64-fp16-adam",
            "efficientnet_b0-224-b64-fp16-adamw",
            "llama4L-512-1k-b4-bf16-adamw-full",
            "llama8L-1024-2k-b1-bf16-adamw-ckpt-frozen",
            "llama8L-1024-2k-b4-bf16-adamw-ckpt-frozen",
            "resnet18-128-b32-fp16-adamw",
            "resnet18-128-b8-fp16-adamw",
            "resnet50-224-b32-fp16-adamw",
            "resnet50-224-b64-fp16-adamw",
            "resnet50-224-b32-fp32-adam",
            "smp_unet_resnet34-1024-b2-fp16-adamw",
            "smp_unet_resnet34-512-b8-bf16-adamw",
            "vit_base_patch16_224-224-b32-bf16-adamw",
            "vit_base_patch16_224-224-b64-fp32-adamw",
            "vit_small_patch16_224-224-b128-fp16-adam",
        )
    ),
    Row(H200 + "resnet50-224-b128-fp16-adamw", 0.09, 0.08, CUDNN_SIZES),
    Row(H200 + "resnet50-224-b256-fp16-adamw", 0.08, 0.08, CUDNN_SIZES),
    Row(H200 + "resnet50-224-b64-bf16-sgd", 0.09, 0.07, CUDNN_SIZES),
    Row(H200 + "unet3d-96-b2-fp16-adamw", 0.07, 0.05, CUDNN_3D),
    Row(H200 + "unet3d-128-b1-bf16-adamw", 0.06, 0.05, CUDNN_3D),
    Row(H200 + "vit_base_patch16_224-224-b64-bf16-adamw", 0.06, 0.06, "not found yet"),
    Row(H200 + "resnet18-224-b256-fp32-sgd", 0.22, 0.20, FP32_FRAGMENTS),
]
# Not predicted here: convnext_small at b16, whose GradScaler skipped the first optimizer step
# (an inf at the initial scale), so its peaks are a step without the Adam state; and b32 with
# cuDNN's benchmark mode (its trials' workspaces depend on the free memory).


@pytest.mark.slow
@pytest.mark.parametrize("row", PREDICTED, ids=[r.name for r in PREDICTED])
def test_each_workload_is_predicted_from_a_cpu(row: Row) -> None:
    pytest.importorskip("timm")
    if "unet3d" in row.name:
        pytest.importorskip("monai")
    if "llama" in row.name:
        pytest.importorskip("transformers")
    from bigbatch.memory.predict import predict_peak

    truth = load(row.name)
    p = predict_peak(spec_of(truth))
    allocated, reserved = truth["max_allocated_bytes"], truth["max_reserved_bytes"]
    process = truth["process_used_mib_by_stage"]["after_two_steps"] * MiB
    predicted_process = p.planning_bytes + CUDA_CONTEXT_BYTES
    figures = (p.allocated_bytes / MiB, p.reserved_bytes / MiB, predicted_process / MiB, row.why)
    assert abs(p.allocated_bytes - allocated) <= 0.02 * allocated, figures
    assert abs(p.reserved_bytes - reserved) <= row.reserved_within * reserved, figures
    assert abs(predicted_process - process) <= row.process_within * process, figures


def test_cudnn_forward_workspaces_are_the_transposed_operands() -> None:
    """resnet18 at b8 in float16: every forward convolution's workspace in the trace (an alloc
    freed right away) is the rule's size, to the byte, in order; the RGB stem has none."""
    pytest.importorskip("timm")
    import timm
    from torch.utils._python_dispatch import TorchDispatchMode

    from bigbatch.memory.cuda_autocast import cuda_autocast_rules

    truth = load("resnet18-128-b8-fp16-adamw")
    events, start = truth["events"], truth["event_marks"]["steps_begin"]
    first_matmul = next(i for i in range(start, len(events)) if events[i][2] == 33554432)
    recorded = [
        events[i][2]
        for i in range(start, first_matmul)
        if events[i][0] == "alloc" and events[i + 1][:2] == ["free_requested", events[i][1]]
    ]

    sizes: list[int] = []

    class Rule(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # fmt: skip
            out = func(*args, **(kwargs or {}))
            sizes.extend(cudnn_workspaces(str(func), args, out))
            return out

    model = timm.create_model("resnet18", num_classes=10)
    fp16 = torch.autocast("cpu", dtype=torch.float16)
    with torch.no_grad(), cuda_autocast_rules(), Rule(), fp16:
        model(torch.randn(8, 3, 128, 128))
    assert sizes == recorded and len(recorded) == 19
