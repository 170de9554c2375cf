"""bigbatch's CUDA memory model against real allocator traces of training steps recorded on an
NVIDIA H100 (torch 2.11, CUDA 13.0; ``data/gpu_truth/README.md`` says how), from a CPU.

The allocator model replays each trace's own events to its measured peaks; predictions from a
fake-tensor trace (CUDA autocast rules, cuBLAS and cuDNN workspaces, the context) are checked
against the measured allocated, reserved and process peaks, each row at the bound it meets
today, with the reason where that is looser than 5 %."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bigbatch.memory.cuda_allocator import CachingAllocatorModel
from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES, cudnn_workspaces

# The traces, their loading and the workloads as StepSpecs: benchmarks/gpu_truth.py's.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_matrix import ranks_of
from gpu_truth import MiB, load, names, spec_of

DEPTHWISE = (
    "cuDNN's depthwise-convolution backward workspaces (38-96 MiB; the sweep measures "
    "EfficientNet's depthwise convolutions, not ConvNeXt's 7x7s at these sizes)"
)
RECORDED_AGAIN = (
    "an earlier recording of a workload recorded again on the same stack: the later recordings "
    "(H100 and H200, make gpu-evidence) reserve %s MiB, which the model gives to the MiB"
)
DATA_GRAD_ALGORITHM = (
    "cuDNN chose another data-gradient algorithm in this recording: layer1's 3x3s take 11.1 MiB "
    "workspaces, where the H100's sweep and its recording of this row (above, within 1 %%) took "
    "8.1 MiB"
)


def benchmark_trials(events: list[list[Any]]) -> set[int]:
    """The alloc events that are cuDNN's benchmark trials: each freed just before PyTorch
    empties the cache (its segments released at once)."""
    made: dict[int, int] = {}  # address -> its last alloc event
    trials = set()
    for i, (action, address, _, _) in enumerate(events):
        if action == "alloc":
            made[address] = i
        elif action == "segment_free" and events[i - 1][0] == "free_completed":
            trials.add(made[events[i - 1][1]])
    return trials


def replay(
    events: list[list[Any]], addresses: str = "driver", skip: set[int] = frozenset()
) -> CachingAllocatorModel:
    """A trace's own allocations and frees through the allocator model (but the allocs in
    ``skip``), each on the stream it was recorded on (FSDP2's rows use three), its cache
    emptied where the trace's is (a run of segments released: cuDNN's benchmark mode empties it
    after each trial), its segments placed by ``addresses``: ``"driver"``, as a prediction
    places them (``DriverAddresses``); ``"card"``, where the card put each one the trace made
    too (its cudaMalloc recorded just before); or ``"age"``, in the order they were made (the
    model before it placed them as the driver does)."""
    made_for: dict[int, int] = {}  # alloc event -> the card's new segment's address
    for i in range(1, len(events)):
        if events[i][0] == "alloc" and events[i - 1][0] == "segment_alloc":
            made_for[i] = int(events[i - 1][1])
    current = [0]  # the event being replayed

    def card(index: int) -> int:
        return made_for.get(current[0], index << 48)

    placed = {"driver": None, "card": card, "age": lambda index: index << 48}[addresses]
    model = CachingAllocatorModel(segment_address=placed)
    for i, (action, address, size, stream) in enumerate(events):
        current[0] = i
        if action == "alloc" and i not in skip:
            model.malloc(address, size, stream=stream)
        elif action == "free_completed":
            model.free(address)
        elif action == "segment_free" and events[i - 1][0] != "segment_free":
            model.empty_cache()
    return model


ROWS = names()
H200 = "h200-torch2.11/"  # make gpu-evidence on an H200 (benchmarks/results/h200-cuda13.0-*)


@pytest.mark.parametrize("name", ROWS)
def test_the_allocator_model_replays_each_trace_to_its_measured_peaks(name: str) -> None:
    """To the byte, with the segments where the driver puts them: the allocator takes the
    smallest free block that holds a request and, among equal ones, the lowest address, so
    which of several equal blocks it splits depends on where the driver put their segments (in
    its first 512 MiB reservation in order, then each below the last: ``DriverAddresses``); the
    card's own addresses give the same peaks. In cuDNN's benchmark mode the cache is emptied
    after each convolution's trials, and the replay empties it there too."""
    truth = load(name)
    assert truth["cudnn_benchmark"] == (name in BENCHMARK_ROWS)
    for addresses in ("driver", "card"):
        model = replay(truth["events"], addresses)
        missed = DRIVER_PLACED_OTHERWISE.get(name, 0) * MiB if addresses == "driver" else 0
        assert model.peak_reserved == truth["max_reserved_bytes"] + missed, addresses
        if not (truth["cudnn_benchmark"] and addresses == "driver"):
            assert model.peak_allocated == truth["max_allocated_bytes"], addresses


# Reserved MiB the replay over DriverAddresses' stand-in addresses gives past the trace (the
# card's own addresses give it to the byte, as does the prediction): the one trace whose
# segments the card placed otherwise than the stand-in (among its first, the 151,936 x 896
# embedding's 260 MiB), so that among equal free blocks a request took another than the card's.
# Not yet a mechanism: one trace of the 59 recorded.
DRIVER_PLACED_OTHERWISE = {"h200-torch2.11/qwen2.5-0.5b-full-1024-b4-bf16-adamw": 2}

# The traces recorded in cuDNN's benchmark mode (the replay test checks the list).
BENCHMARK_ROWS = [
    "convnext_small-128-b16-fp16-adam",
    "convnext_small-128-b32-fp16-adam",
    "convnext_small-128-b64-fp16-adam",
    "h100-torch2.11/resnet50-224-b64-fp16-adamw-bench",
    "h200-torch2.11/resnet50-224-b64-fp16-adamw-bench",
]


@pytest.mark.parametrize("name", BENCHMARK_ROWS)
def test_benchmark_trials_take_free_memory_and_never_set_the_peak(name: str) -> None:
    """Each recorded step in benchmark mode reserves what it reserves without its trials (the
    same replay with them left out): the trials run where memory is free and the cache is
    emptied after each, so a plan that fits the step without them fits it with them. Without
    the emptied caches, the replay misses the measured peaks (by -138 to +12 MiB): the negative
    control."""
    truth = load(name)
    trials = benchmark_trials(truth["events"])
    assert trials, "a benchmark-mode trace with no trials"
    assert replay(truth["events"], "card", trials).peak_reserved == truth["max_reserved_bytes"]
    kept = CachingAllocatorModel()
    for action, address, size, _ in truth["events"]:
        if action == "alloc":
            kept.malloc(address, size)
        elif action == "free_completed":
            kept.free(address)
    assert kept.peak_reserved != truth["max_reserved_bytes"]


CAPPED = [n for n in ROWS if "-cap" in n]  # recorded under an allocator cap (cap_mib)


@pytest.mark.parametrize("name", CAPPED)
def test_under_a_cap_the_replay_and_the_prediction_meet_the_card(name: str) -> None:
    """A step recorded with its allocator capped (``set_per_process_memory_fraction``, as on a
    card of that size less its context): the benchmark trials halve to fit, and the cache is
    released before a request would pass the cap. The replay gives its peaks to the byte; the
    prediction under the same limit (``StepSpec.memory_limit``) within 3 %, with no request
    over it."""
    pytest.importorskip("timm")
    from bigbatch.memory.predict import predict_peak

    truth = load(name)
    assert truth["cap_bytes"] and truth["max_reserved_bytes"] <= truth["cap_bytes"]
    assert replay(truth["events"], "card").peak_reserved == truth["max_reserved_bytes"]
    with ranks_of(truth):
        p = predict_peak(spec_of(truth))
    assert not any("would run out" in n for n in p.notes), p.notes
    measured = truth["max_reserved_bytes"]
    assert abs(p.reserved_bytes - measured) <= 0.03 * measured, p.reserved_bytes / MiB


# The negative control: equal free blocks taken by the age of their segments (as if each new
# segment sat above the last) fragment otherwise, by these MiB against the card (every other
# recorded row within 4 MiB).
BY_AGE = {
    H200 + "resnet18-224-b256-fp32-sgd": -196,  # a 394 MiB block split
    H200 + "convnext_small-128-b64-fp16-adam": 228,  # freed 48-74 MiB workspace blocks
    H200 + "convnext_small-128-b32-fp16-adam": 38,
}


@pytest.mark.parametrize("name", sorted(BY_AGE))
def test_equal_blocks_taken_by_age_miss_where_the_driver_placed_segments_lower(name: str) -> None:
    """Past its first reservation the driver puts each new segment below the earlier ones, so
    the newest of several equal free blocks is the one the allocator splits."""
    truth = load(name)
    model = replay(truth["events"], "age")
    assert (model.peak_reserved - truth["max_reserved_bytes"]) // MiB == BY_AGE[name]


@dataclass(frozen=True)
class Row:
    name: str
    reserved_within: float = 0.03  # of the measured reserved peak
    process_within: float = 0.03  # of the measured process memory
    why: str = ""


PREDICTED = [
    Row("resnet18-128-b8-fp16-adamw", 0.04, 0.03, RECORDED_AGAIN % 328),
    Row("resnet18-128-b32-fp16-adamw"),
    Row("convnext_small-128-b32-fp16-adam-nobench", 0.08, 0.06, DEPTHWISE),
    # cuDNN's benchmark mode, as the H200's resnet50 row below.
    Row("convnext_small-128-b32-fp16-adam"),
    Row("convnext_small-128-b64-fp16-adam"),
    Row("unet3d-96-b2-fp16-adamw", 0.05, 0.03, RECORDED_AGAIN % 632),
    Row("llama8L-1024-2k-b1-bf16-adamw-ckpt-frozen"),
    # An H200 (make gpu-evidence); the same rows as the H100's above where they repeat. The
    # H100's make gpu-evidence recorded the same peaks (test_an_h100_and_an_h200_reserve_alike).
    *(
        Row(H200 + n)
        for n in (
            "convnext_small-128-b32-fp16-adam",
            "convnext_small-128-b64-fp16-adam",
            "efficientnet_b0-224-b64-fp16-adamw",
            "llama4L-512-1k-b4-bf16-adamw-full",
            "llama8L-1024-2k-b1-bf16-adamw-ckpt-frozen",
            "llama8L-1024-2k-b4-bf16-adamw-ckpt-frozen",
            # Language models from their configs (bigbatch plan --hf's), 2026-11-28.
            "llama3.2-1b-lora16-ckpt-2048-b4-bf16-adamw",
            "llama3.2-1b-lora16-packed-ckpt-512-b8-bf16-adamw",
            "qwen2.5-0.5b-full-1024-b4-bf16-adamw",
            "qwen2.5-0.5b-lora16-ckpt-4096-b2-bf16-adamw",
            "resnet18-128-b8-fp16-adamw",
            "resnet18-224-b256-fp32-sgd",
            "resnet50-224-b32-fp16-adamw",
            "resnet50-224-b64-fp16-adamw",
            "resnet50-224-b64-fp16-adamw-bench",
            "resnet50-224-b64-bf16-sgd",
            "resnet50-224-b128-fp16-adamw",
            "resnet50-224-b256-fp16-adamw",
            "resnet50-224-b32-fp32-adam",
            "smp_unet_resnet34-1024-b2-fp16-adamw",
            "smp_unet_resnet34-512-b8-bf16-adamw",
            "unet3d-96-b2-fp16-adamw",
            "unet3d-128-b1-bf16-adamw",
            "vit_base_patch16_224-224-b32-bf16-adamw",
            "vit_base_patch16_224-224-b64-bf16-adamw",
            "vit_base_patch16_224-224-b64-fp32-adamw",
            "vit_small_patch16_224-224-b128-fp16-adam",
        )
    ),
    Row(H200 + "resnet18-128-b32-fp16-adamw", 0.08, 0.03, DATA_GRAD_ALGORITHM),
    # The H100's rows whose peaks differ from the H200's (CARDS_DIFFER, below).
    Row("h100-torch2.11/smp_unet_resnet34-512-b8-bf16-adamw"),
    Row("h100-torch2.11/resnet50-224-b64-fp16-adamw-bench"),
    Row("h100-torch2.11/resnet18-128-b32-fp16-adamw"),  # the H200's miss, above, is its cuDNN's
]
# Not predicted here: convnext_small at b16, whose GradScaler skipped the first optimizer step
# (an inf at the initial scale), so its peaks are a step without the Adam state.


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
    with ranks_of(truth):
        p = predict_peak(spec_of(truth))
    allocated, reserved = truth["max_allocated_bytes"], truth["max_reserved_bytes"]
    process = truth["process_used_mib_by_stage"]["after_two_steps"] * MiB
    predicted_process = p.planning_bytes + CUDA_CONTEXT_BYTES
    figures = (p.allocated_bytes / MiB, p.reserved_bytes / MiB, predicted_process / MiB, row.why)
    assert abs(p.allocated_bytes - allocated) <= 0.02 * allocated, figures
    assert abs(p.reserved_bytes - reserved) <= row.reserved_within * reserved, figures
    assert abs(predicted_process - process) <= row.process_within * process, figures


H100 = "h100-torch2.11/"  # make gpu-evidence on an H100 (benchmarks/results/h100-*)


# Where the two cards' peaks differ: reserved MiB, the H100's less the H200's, and why.
CARDS_DIFFER = {
    "resnet50-224-b64-fp16-adamw-bench": (
        -16,
        "cuDNN's benchmark mode tries algorithms with the memory free, more on the H200",
    ),
    "resnet18-128-b32-fp16-adamw": (
        24,
        "on the H200 cuDNN took another data-gradient algorithm for layer1's 3x3s (workspaces "
        "of 11.1 and 6.9 MiB that the H100 does not take), and its blocks fell otherwise",
    ),
    "smp_unet_resnet34-512-b8-bf16-adamw": (
        -4,
        "cuDNN's heuristics give two bf16 convolutions 32.8 and 8.5 MiB workspaces on the H100 "
        "and 36.8 and 9.0 MiB on the H200 (twice and ten times in the step)",
    ),
}


@pytest.mark.parametrize("name", [n for n in ROWS if n.startswith(H100)])
def test_an_h100_and_an_h200_reserve_alike(name: str) -> None:
    """The same stack (torch 2.11, CUDA 13.0, cuDNN 9.19) on both Hopper cards: the same
    allocated and reserved peaks to the byte, some frees in another order, except where cuDNN
    chose otherwise (CARDS_DIFFER). So each H100 row is predicted as its H200 row above is,
    and those two on their own."""
    row = name.removeprefix(H100)
    h100, h200 = load(name), load(H200 + row)
    assert "H100" in h100["device"] and "H200" in h200["device"]
    if row in CARDS_DIFFER:
        difference = h100["max_reserved_bytes"] - h200["max_reserved_bytes"]
        assert difference == CARDS_DIFFER[row][0] * MiB, CARDS_DIFFER[row][1]
        return
    assert h100["max_allocated_bytes"] == h200["max_allocated_bytes"]
    assert h100["max_reserved_bytes"] == h200["max_reserved_bytes"]


@pytest.mark.slow
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


def test_float32_convolutions_take_workspaces_too() -> None:
    """The cause of the float32 row's miss, in its trace: with TF32 on (torch's default for
    cuDNN), the stem's forward workspace is its transposed operands + 16 bytes to the byte, as
    in 16-bit; backward workspaces exceed the forward's (the card profile's weight-gradient
    extras: 1.97 MiB at 64 channels, 6.75 at 256), so each needs a new segment. Without its
    transient workspaces the same trace reserves 23 % less, about what the model predicts."""
    truth = load(H200 + "resnet18-224-b256-fp32-sgd")
    events, start = truth["events"], truth["event_marks"]["steps_begin"]
    transient = {
        i
        for i in range(start, len(events) - 1)
        if events[i][0] == "alloc" and events[i + 1][:2] == ["free_requested", events[i][1]]
        and events[i][2] > MiB
    }  # fmt: skip
    x, out, w = 256 * 3 * 224 * 224 * 4, 256 * 64 * 112 * 112 * 4, 64 * 3 * 7 * 7 * 4
    assert events[min(transient)][2] == x + out + w + 16
    kept, skipping = [], set()
    for i, event in enumerate(events):
        if i in transient:
            skipping.add(event[1])
        elif event[0] == "free_completed" and event[1] in skipping:
            skipping.discard(event[1])
        else:
            kept.append(event)
    with_them = replay(events).peak_reserved
    without = replay(kept).peak_reserved
    assert 0.2 < 1 - without / with_them < 0.26, (with_them / MiB, without / MiB)


@pytest.mark.parametrize("batch", [32, 64])
def test_the_reduction_kernels_staging_is_the_traces_to_the_byte(batch: int) -> None:
    """A ViT-B's linear layers' bias gradients (sums over batch x 197 tokens rows) reduce
    across thread blocks through a staging buffer and semaphores (bigbatch.memory.cuda_reduce):
    the sizes the launch configuration gives for an H100 are in the H200's trace, each buffer
    followed by its semaphores."""
    from bigbatch.memory.cuda_reduce import reduction_staging

    truth = load(H200 + f"vit_base_patch16_224-224-b{batch}-bf16-adamw")
    allocs = [e[2] for e in truth["events"] if e[0] == "alloc"]
    pairs = set(itertools.pairwise(allocs))
    for outputs in (768, 2304, 3072):
        grad = torch.empty(batch * 197, outputs, dtype=torch.bfloat16, device="meta")
        staging, semaphores = reduction_staging(
            "aten.sum.dim_IntList",
            (grad, [0]),
            card=(132, 2048),  # an H100's and an H200's
        )
        assert semaphores == 4 * outputs // 128
        assert (staging, semaphores) in pairs, (outputs, staging)


@pytest.mark.parametrize(
    ("optimizer", "copies"), [("adamw", 2), ("adagrad", 1), ("rmsprop", 1), ("sgd_momentum", 1)]
)
def test_an_optimizers_step_counts_take_no_cuda_memory(optimizer: str, copies: int) -> None:
    """torch's optimizers (neither capturable nor fused) keep each weight's step count in host
    memory: a recorded resnet18 AdamW step makes fewer 4-byte CUDA blocks than the model has
    weights (each its own count), and a predicted step's optimizer state is its per-weight
    tensors alone (Adam's two moments, Adagrad's sums, RMSprop's square averages), not a
    512-byte block a weight beside them; on a CPU the counts are the CPU's memory."""
    from bigbatch.memory.predict import predict_peak
    from bigbatch.memory.step import StepSpec

    truth = load(H100 + "resnet18-128-b8-fp16-adamw")
    steps = truth["events"][truth["event_marks"]["steps_begin"] :]
    four_bytes = sum(1 for action, _, size, _ in steps if action == "alloc" and size == 4)
    assert four_bytes < 62  # resnet18's weights and biases, one step count each

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))

    spec = StepSpec(model, (64,), 4, device="cuda", optimizer=optimizer)
    p = predict_peak(spec)
    assert p.optimizer_state == copies * p.parameters, (p.optimizer_state, p.parameters)
    on_cpu = predict_peak(replace(spec, device="cpu"))
    counts = 0 if optimizer == "sgd_momentum" else 16 * 4  # a float32 count a weight
    assert on_cpu.optimizer_state == copies * on_cpu.parameters + counts


def test_a_fused_adamw_keeps_its_step_counts_on_the_card_and_makes_no_temporaries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's fused AdamW (Trainer's default from torch 2.8) keeps each weight's step count
    on the card (a 512-byte block each, not host memory) and updates the weights in one
    kernel, in place: where the optimizer step is the peak, the multi-tensor AdamW's
    temporaries (as large as the weights) are what the fused one spares. On a CPU its
    counts are float32, as the multi-tensor one's."""
    from bigbatch.memory.predict import predict_peak
    from bigbatch.memory.step import StepSpec

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))

    spec = StepSpec(model, (64,), 4, device="cuda", optimizer="adamw_fused")
    fused, foreach = predict_peak(spec), predict_peak(replace(spec, optimizer="adamw"))
    assert fused.optimizer_state == 2 * fused.parameters + 16 * 512
    assert foreach.temporaries > fused.parameters > 50 * fused.temporaries
    assert foreach.peak_bytes - fused.peak_bytes > 0.9 * fused.parameters
    on_cpu = predict_peak(replace(spec, device="cpu"))
    assert on_cpu.optimizer_state == 2 * on_cpu.parameters + 16 * 4
    # Where torch has no fused kernel for the weights' device (the CPU, before torch 2.4, whose
    # AdamW refuses them when built): one line naming the fix.
    from bigbatch.memory.step import make_optimizer

    def refuses(params: Any, **kwargs: Any) -> None:
        raise RuntimeError("`fused=True` requires all the params to be floating point Tensors")

    monkeypatch.setattr(torch.optim, "AdamW", refuses)
    with pytest.raises(ValueError, match=r"fused AdamW cannot step .*--optimizer adamw \("):
        make_optimizer("adamw_fused", [torch.nn.Parameter(torch.zeros(2))])
