"""The real peak memory of training steps on the actual device.

CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``). CPU: the profiler's
allocation events (``profile_memory=True``), summed in order, plus what was alive at the start:
deterministic to the byte, unlike peak RSS, which heap fragmentation inflates.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from bigbatch.device import cudnn_benchmark_mode, synchronize
from bigbatch.memory.fsdp import local_shard
from bigbatch.memory.step import (
    make_inputs,
    make_optimizer,
    optimizer_state_tensors,
    run_training_step,
)

__all__ = [
    "allocation_events",
    "measure_peak",
    "measure_step_peak",
    "measure_step_reserved",
    "profiled_peak",
    "samples_per_second",
]


def _tensor_bytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and (t := local_shard(t)).device.type == "cpu":
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def allocation_events(nodes: Any) -> list[tuple[int, int]]:
    """(time in ns, bytes) of every CPU allocation (positive) and free (negative) recorded in
    these profiler event-tree nodes and their descendants, in time order."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    return sorted(events)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null while the block runs: the profiler's C++ logger
    prints 'USDT: ... profiler_start' and, without a GPU, 'ERROR: ... gpuGetDeviceCount failed'
    there at every start and stop, alarming and meaningless to a user."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def cpu_memory_profile() -> Iterator[Any]:
    """torch's profiler with allocation events, quiet when it starts and stops (only then:
    warnings from the profiled code still reach stderr)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)


def profiled_peak(fn: Callable[[], Any], alive_at_start: int = 0) -> int:
    """Peak CPU tensor memory while ``fn()`` runs: ``alive_at_start`` plus the largest running
    sum of the allocations and frees the profiler records.
    """
    gc.collect()
    with cpu_memory_profile() as prof:
        fn()
    live = peak = 0
    for _, size in allocation_events(prof.profiler.kineto_results.experimental_event_tree()):
        live += size
        peak = max(peak, live)
    return alive_at_start + peak


def measure_peak(
    step: Callable[[], Any],
    *,
    device: torch.device | str = "cpu",
    alive: Any = (),
) -> int:
    """Peak bytes of tensor memory on ``device`` while ``step()`` runs.

    ``alive`` lists the tensors already allocated that count (the model's parameters, say):
    on CPU they are added to what the profiler sees; on CUDA the allocator counts them itself.

    >>> import torch
    >>> m = torch.nn.Linear(256, 256)
    >>> peak = measure_peak(lambda: m(torch.ones(64, 256)).sum().backward(), alive=m.parameters())
    >>> peak > 2 * 256 * 256 * 4
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    if device.type != "cpu":
        raise ValueError(f"measuring peak memory is supported on cpu and cuda, not {device.type}")
    return profiled_peak(step, _tensor_bytes(alive))


def measure_step_peak(spec: Any, *, steps: int = 2, seed: int = 0) -> int:
    """Really run ``steps`` training steps of a :class:`~bigbatch.memory.step.StepSpec` on its
    device and return the peak (the number :func:`predict_peak` predicts).
    """

    device = torch.device(spec.device)
    model, opt, _ = real_step_setup(spec, 0, seed=seed)

    def run() -> None:
        # The batches are made inside the measured window, so that freeing each after its step
        # is seen (the profiler ignores frees of what existed before it started); the second
        # batch waits during the first step, as a loader's next batch does.
        inputs = [make_inputs(spec, device) for _ in range(steps)]
        while inputs:
            run_training_step(model, opt, inputs.pop(0), spec, device.type)

    # Some optimizers make their state when they are built (Adagrad's sums): it is alive too.
    alive = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(opt)]
    return measure_peak(run, device=device, alive=alive)


def measure_step_reserved(spec: Any, *, seed: int = 0) -> int:
    """What the CUDA allocator reserves for a :class:`~bigbatch.memory.step.StepSpec`'s
    training step, measured on the GPU: a first step (the optimizer's state made, cuDNN's
    benchmark trials where the spec has them on), then the reserved peak of a second from there,
    the first's cached segments included, as training holds them. The figure a CUDA
    prediction's planning bytes stand for. The model, its state and the batches are freed and
    the cache emptied after, so that the training that follows starts as it would have.

    On a GPU (``tests/gpu``): ``measure_step_reserved(StepSpec(..., device="cuda"))``.
    """
    device = torch.device(spec.device)
    if device.type != "cuda":
        raise ValueError(f"the CUDA allocator's reserved peak is measured on cuda, not {device}")
    # Segments cached free by earlier work (a plan's own steps, another run in this process)
    # count in the reserved peak from the reset on, though the step needs none of them.
    gc.collect()
    torch.cuda.empty_cache()
    model, opt, inputs = real_step_setup(spec, 2, seed=seed)
    try:
        with cudnn_benchmark_mode(spec.cudnn_benchmark):
            run_training_step(model, opt, inputs.pop(0), spec, device.type)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            run_training_step(model, opt, inputs.pop(0), spec, device.type)
            torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_reserved(device))
    finally:
        del model, opt, inputs
        gc.collect()
        torch.cuda.empty_cache()


def real_step_setup(
    spec: Any, steps: int, *, seed: int = 0
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """The real model (in train mode), its optimizer and ``steps`` input batches of a
    :class:`~bigbatch.memory.step.StepSpec`, on its device, from a fixed seed."""

    device = torch.device(spec.device)
    torch.manual_seed(seed)
    model = spec.model().to(device).train()
    opt = make_optimizer(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    return model, opt, [make_inputs(spec, device) for _ in range(steps)]


def samples_per_second(spec: Any, *, steps: int = 3, warmup: int = 1, seed: int = 0) -> float:
    """Training throughput of a :class:`~bigbatch.memory.step.StepSpec`: ``warmup`` real steps
    (kernel selection, allocator growth), then the samples of ``steps`` timed steps per second.

    >>> from bigbatch.memory.step import StepSpec
    >>> samples_per_second(StepSpec(lambda: torch.nn.Linear(8, 2), (8,), 4), steps=1) > 0
    True
    """
    device = torch.device(spec.device)
    spec = replace(spec, held_gradients=False)  # a window's samples take as long as a step's
    model, opt, inputs = real_step_setup(spec, warmup + steps, seed=seed)
    for x in inputs[:warmup]:
        run_training_step(model, opt, x, spec, device.type)
    synchronize(device)
    t0 = time.perf_counter()
    for x in inputs[warmup:]:
        run_training_step(model, opt, x, spec, device.type)
    synchronize(device)
    return steps * spec.batch_size / (time.perf_counter() - t0)
