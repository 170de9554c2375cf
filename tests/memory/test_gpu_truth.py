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
from gpu_truth import DATA, MiB, load, spec_of

CUDNN_WGRAD = "cuDNN's weight-gradient workspaces (another algorithm than the forward's copy)"
DEPTHWISE = "cuDNN's depthwise-convolution backward workspaces (38-96 MiB, not modelled)"


def replay(events: list[list[Any]]) -> CachingAllocatorModel:
    model = CachingAllocatorModel()
    for action, address, size, _ in events:
        if action == "alloc":
            model.malloc(address, size)
        elif action == "free_completed":
            model.free(address)
    return model


ROWS = [p.name.removesuffix(".json.gz") for p in sorted(DATA.glob("*.json.gz"))]


@pytest.mark.parametrize("name", ROWS)
def test_the_allocator_model_replays_each_trace_to_its_measured_peaks(name: str) -> None:
    """To the MiB where cuDNN's benchmark mode is off (the llama row 4 MiB over: one 20 MiB
    segment on the card where the model makes two 12 MiB ones, likely a tie between equal free
    blocks that the card breaks by address and the model by segment order). With it, the
    trials reserve more than their recorded events show (b32: 138 MiB), never less."""
    truth = load(name)
    model = replay(truth["events"])
    measured = truth["max_reserved_bytes"]
    if truth["cudnn_benchmark"]:
        assert abs(model.peak_allocated - truth["max_allocated_bytes"]) < 8 * MiB
        assert measured - 0.08 * measured <= model.peak_reserved <= measured + 16 * MiB
        return
    assert abs(model.peak_allocated - truth["max_allocated_bytes"]) < MiB
    assert abs(model.peak_reserved - measured) <= 4 * MiB


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
