"""Per-op workspace calibration for CPU predictions.

Fake tensors see every tensor an op returns, but not the scratch memory a CPU kernel allocates
and frees inside itself (oneDNN convolution backward, im2col). Two small real steps (micro-batch
2 and 4, a few seconds) run with every dispatched op wrapped in a profiler range; each op's
workspace is the highest point its allocations reach above what it leaves behind. The fake run
then adds op i's workspace, interpolated linearly in the micro-batch, at op i, as long as its op
sequence matches the calibration's.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bigbatch.memory.measure import allocation_events, real_step_setup
from bigbatch.memory.predict import StepSpec, run_training_step

__all__ = ["Calibration", "calibrate", "calibrate_within"]

# Fake tensors miss CPU kernel workspaces: up to half of a step's real peak on some CPUs (72 of
# 139 MiB for resnet10t at 32 px, oneDNN on an AMD EPYC). A calibration step runs only where
# the uncalibrated prediction times this still fits the budget.
WORKSPACE_HEADROOM = 2.0

_MARK = "bigbatch_op_"


@dataclass(frozen=True)
class Calibration:
    """Workspace bytes per dispatched op, measured at two micro-batch sizes (interpolated
    between and beyond them), and as measured at a few more sizes (used exactly there)."""

    ops: tuple[str, ...]  # op names in dispatch order (two steps)
    small: tuple[int, ...]  # workspace per op at batch_small
    large: tuple[int, ...]  # workspace per op at batch_large
    batch_small: int
    batch_large: int
    # batch size -> (op names, workspaces) as measured: kernels may choose differently at a
    # size (micro-batch 1 often does), so a measured size needs no interpolation.
    exact: dict[int, tuple[tuple[str, ...], tuple[int, ...]]] = field(default_factory=dict)

    def ops_for(self, batch_size: int) -> tuple[str, ...]:
        return self.exact[batch_size][0] if batch_size in self.exact else self.ops

    def workspace(self, index: int, batch_size: int) -> int:
        if batch_size in self.exact:
            return self.exact[batch_size][1][index]
        a, b = self.small[index], self.large[index]
        slope = (b - a) / (self.batch_large - self.batch_small)
        return max(0, round(a + slope * (batch_size - self.batch_small)))


class _OpMarker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "prim":
            return func(*args, **(kwargs or {}))
        i = len(self.names)
        self.names.append(str(func))
        with torch.profiler.record_function(f"{_MARK}{i}"):
            return func(*args, **(kwargs or {}))


def _workspaces(spec: StepSpec, steps: int) -> tuple[list[str], list[int]]:
    from torch.profiler import ProfilerActivity, profile

    model, opt, inputs = real_step_setup(spec, steps)
    marker = _OpMarker()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, marker:
        for x in inputs:
            run_training_step(model, opt, x, spec.precision, torch.device(spec.device).type)
    workspace = [0] * len(marker.names)

    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        name = node.name
        if name.startswith(_MARK):
            running = high = 0
            for _, size in allocation_events([node]):
                running += size
                high = max(high, running)
            # What the op leaves behind (its outputs) the fake run already counts.
            workspace[int(name[len(_MARK) :])] = max(0, high - max(running, 0))
            continue  # nested ops belong to this one
        stack.extend(node.children)
    return marker.names, workspace


def calibrate(
    spec: StepSpec,
    *,
    batch_sizes: tuple[int, int] = (2, 4),
    also: tuple[int, ...] = (1,),
    steps: int = 2,
) -> Calibration:
    """Measure per-op CPU workspaces at two small micro-batch sizes, plus ``also`` (micro-batch
    1, the planner's floor, by default), with real runs on the CPU."""
    if torch.device(spec.device).type != "cpu":
        raise ValueError("workspace calibration runs real steps on the CPU; it is for device='cpu'")
    small, large = batch_sizes
    if small >= large:  # one size: its workspaces hold everywhere (no slope to interpolate)
        names, ws = _workspaces(spec.with_batch(small), steps)
        return Calibration(
            tuple(names), tuple(ws), tuple(ws), small, small + 1, {small: (tuple(names), tuple(ws))}
        )
    names_s, ws_s = _workspaces(spec.with_batch(small), steps)
    names_l, ws_l = _workspaces(spec.with_batch(large), steps)
    exact = {small: (tuple(names_s), tuple(ws_s)), large: (tuple(names_l), tuple(ws_l))}
    for b in also:
        if b not in exact:
            try:
                names_b, ws_b = _workspaces(spec.with_batch(b), steps)
            except ValueError:
                continue  # e.g. BatchNorm cannot train on one sample: the planner starts at 2
            exact[b] = (tuple(names_b), tuple(ws_b))
    if names_s != names_l:
        # The op sequence depends on the batch size (a kernel choice): keep the common prefix.
        n = next((i for i, (a, b) in enumerate(zip(names_s, names_l, strict=False)) if a != b), 0)
        names_s, ws_s, ws_l = names_s[:n], ws_s[:n], ws_l[:n]
    return Calibration(tuple(names_s), tuple(ws_s), tuple(ws_l), small, large, exact)


def calibrate_within(spec: StepSpec, usable_bytes: int) -> tuple[Calibration | None, str]:
    """:func:`calibrate` at the sizes (of 1, 2, 4) whose real step stays inside the budget.

    Calibration runs real steps; at a large input even micro-batch 4 can take several times the
    budget it is meant to plan for. Each size's uncalibrated prediction, times
    ``WORKSPACE_HEADROOM``, must fit ``usable_bytes`` before it is run. Returns the calibration
    (None when not even micro-batch 1 may run) and a note for the plan ('' when all three ran).
    """
    from bigbatch.memory.predict import predict_peak

    def fits(b: int) -> bool:
        try:
            return predict_peak(spec.with_batch(b)).peak_bytes * WORKSPACE_HEADROOM <= usable_bytes
        except ValueError:  # BatchNorm on one sample: not a size to measure
            return False

    if fits(4):
        return calibrate(spec), ""
    sizes = [b for b in (1, 2) if fits(b)]
    note = (
        "calibrated at micro-batch "
        + " and ".join(map(str, sizes))
        + " only (a real step at 4 could exceed the budget)"
        if sizes
        else "not calibrated: a real step even at micro-batch 1 could exceed the budget, so CPU "
        "kernel workspaces are not counted (the prediction may be up to ~30% low)"
    )
    if not sizes:
        return None, note
    return calibrate(spec, batch_sizes=(sizes[0], sizes[-1]), also=()), note
