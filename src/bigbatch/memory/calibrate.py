"""Per-op workspace calibration for CPU predictions.

Fake tensors see every tensor an op returns, but not the scratch memory a CPU kernel allocates
and frees inside itself (oneDNN convolution backward, im2col). The forward and backward of a
small real training step at micro-batch 2 and 4 (and 1), on one model after a first step that
creates the optimizer state, run with every dispatched op wrapped in a profiler range; each op's
workspace is the highest point its allocations reach above what it leaves behind. The fake run
then adds op i's workspace, interpolated linearly in the micro-batch, at op i, as long as its op
sequence matches the calibration's.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bigbatch.memory.measure import allocation_events, cpu_memory_profile, real_step_setup
from bigbatch.memory.predict import (
    MemoryPrediction,
    StepLog,
    peak_bound,
    predict_peak,
    replay_with_calibration,
)
from bigbatch.memory.step import StepSpec, make_inputs, run_step_loss, run_training_step

__all__ = ["Calibration", "calibrate", "calibrate_within", "calibration_need"]

# Fake tensors miss CPU kernel workspaces. They belong to the step's kernels, so they are bounded
# by the step's working set (activations and temporaries), not by the weights, gradients and
# optimizer state, which the prediction counts exactly. A calibration step runs only where the
# uncalibrated prediction, with that working set times this, fits the budget: half as much
# again, the most seen here at micro-batch 1 to 4 beyond a fixed per-thread reduction buffer
# (resnet10t at 1024 px under 1GB, 496 MiB uncalibrated at micro-batch 1, is refused).
WORKSPACE_HEADROOM = 1.5

_MARK = "bigbatch_op_"


Sizes = tuple[int, ...]  # the storage bytes of each tensor an op returns


@dataclass(frozen=True)
class _Run:
    """One calibration run at one micro-batch size: per dispatched op, its name, its workspace
    and the sizes of what it returns."""

    ops: tuple[str, ...]
    workspaces: tuple[int, ...]
    outputs: tuple[Sizes, ...]


@dataclass(frozen=True)
class Calibration:
    """Per dispatched op, the workspace bytes and the real sizes of its outputs, measured at two
    micro-batch sizes (interpolated between and beyond them), and as measured at a few more
    sizes (used exactly there).

    Real output sizes matter where an op's fake (meta) kernel under-reports them: oneDNN's LSTM
    (``aten.mkldnn_rnn_layer``) returns its workspace, saved for backward, as an empty tensor on
    fake tensors, 8 MB at micro-batch 4 for real."""

    small: _Run
    large: _Run
    batch_small: int
    batch_large: int
    # Kernels may choose differently at a size (micro-batch 1 often does), so a measured size
    # needs no interpolation.
    exact: dict[int, _Run] = field(default_factory=dict)

    @property
    def ops(self) -> tuple[str, ...]:
        return self.small.ops

    def ops_for(self, batch_size: int) -> tuple[str, ...]:
        return self.exact[batch_size].ops if batch_size in self.exact else self.ops

    def _at(self, a: int, b: int, batch_size: int) -> int:
        if self.batch_large == self.batch_small:
            return a
        slope = (b - a) / (self.batch_large - self.batch_small)
        return max(0, round(a + slope * (batch_size - self.batch_small)))

    def workspace(self, index: int, batch_size: int) -> int:
        if batch_size in self.exact:
            return self.exact[batch_size].workspaces[index]
        return self._at(self.small.workspaces[index], self.large.workspaces[index], batch_size)

    def output_sizes(self, index: int, batch_size: int) -> Sizes:
        """The real storage bytes of op ``index``'s outputs at ``batch_size``."""
        if batch_size in self.exact:
            return self.exact[batch_size].outputs[index]
        a, b = self.small.outputs[index], self.large.outputs[index]
        if len(a) != len(b):
            return ()
        return tuple(self._at(x, y, batch_size) for x, y in zip(a, b, strict=True))


# A profiler range per op: torch's C++ context manager (what compiled code uses) costs a tenth of
# the Python ``record_function``: 0.3 s of a GRU's 1.8 s calibration.
_record_function = getattr(torch._C._profiler, "_RecordFunctionFast", None) or (
    torch.profiler.record_function
)


class _OpMarker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.outputs: list[Sizes] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "prim":
            return func(*args, **(kwargs or {}))
        i = len(self.names)
        self.names.append(str(func))
        if func.is_view:  # a view allocates nothing: no workspace to attribute, no range
            out = func(*args, **(kwargs or {}))
        else:
            with _record_function(f"{_MARK}{i}"):
                out = func(*args, **(kwargs or {}))
        self.outputs.append(output_sizes(out))
        return out


def output_sizes(out: Any) -> Sizes:
    """The storage bytes of each tensor in an op's output (the fake run computes the same)."""
    return tuple(
        t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
    )


def _measure(spec: StepSpec, stepped: tuple[Any, Any] | None = None) -> tuple[_Run, Any, Any]:
    """Profile one steady training step (the one the prediction traces), after a first step
    that creates the optimizer state; ``stepped``: a (model, optimizer) that has taken it, at
    another micro-batch (a workspace is what an op allocates above what it leaves, whatever
    else is alive, so one model serves every size). Returns the run, the model and optimizer."""
    # A lone step's ops: a held step's trace matches them, its adds into the held gradients
    # aside (allocating nothing).
    spec = replace(spec, held_gradients=False)
    device_type = torch.device(spec.device).type
    if stepped is None:
        model, opt, inputs = real_step_setup(spec, 2)
        run_training_step(model, opt, inputs.pop(0), spec, device_type)
    else:
        (model, opt), inputs = stepped, [make_inputs(spec, spec.device)]
    x = inputs.pop(0)  # freed after the profiler stops: it existed before it started
    marker = _OpMarker()
    # A garbage collection inside the profiled step would free another run's tensors in the
    # middle of some op's range; :func:`calibrate` collects once, before its runs.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with cpu_memory_profile() as prof, marker:
            # The forward and backward only: the optimizer step's elementwise ops on the weights
            # allocate no scratch of their own and do not change with the micro-batch, and a
            # prediction runs past the calibrated ops there. Measuring it took most of a
            # calibration step (Adam's per-weight ops, profiled).
            loss = run_step_loss(spec, model, x, device_type)
            loss.backward()
            del loss
            opt.zero_grad(set_to_none=True)
    finally:
        if collecting:
            gc.enable()
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
    return _Run(tuple(marker.names), tuple(workspace), tuple(marker.outputs)), model, opt


def calibrate(
    spec: StepSpec,
    *,
    batch_sizes: tuple[int, int] = (2, 4),
    also: tuple[int, ...] = (1,),
) -> Calibration:
    """Measure per-op CPU workspaces at two small micro-batch sizes, plus ``also`` (micro-batch
    1, the planner's floor, by default), with real runs on the CPU."""
    if torch.device(spec.device).type != "cpu":
        raise ValueError("workspace calibration runs real steps on the CPU; it is for device='cpu'")
    small, large = batch_sizes
    gc.collect()
    runs: dict[int, _Run] = {}
    stepped = None  # one model and optimizer for every size: building them took a fifth
    for size in sorted({small, large}):
        runs[size], model, opt = _measure(spec.with_batch(size), stepped)
        stepped = (model, opt)
    for size in also:
        if size not in runs:
            try:
                runs[size], *_ = _measure(spec.with_batch(size), stepped)
            except ValueError:
                continue  # e.g. BatchNorm cannot train on one sample: the planner starts at 2
    a, b = runs[small], runs[large]
    if a.ops != b.ops:
        # The op sequence depends on the batch size (a kernel choice): keep the common prefix.
        n = next((i for i, (x, y) in enumerate(zip(a.ops, b.ops, strict=False)) if x != y), 0)
        a = _Run(a.ops[:n], a.workspaces[:n], a.outputs[:n])
        b = _Run(b.ops[:n], b.workspaces[:n], b.outputs[:n])
    return Calibration(a, b, small, large, runs)


def calibration_need(spec: StepSpec, *, optimizer_trace: Any = None) -> int:
    """The usable bytes a calibration step at ``spec``'s micro-batch may need: its uncalibrated
    peak, with the working set (activations, temporaries) times ``WORKSPACE_HEADROOM``.

    >>> import torch
    >>> spec = StepSpec(lambda: torch.nn.Linear(64, 8), (64,), 4)
    >>> calibration_need(spec) >= predict_peak(spec).peak_bytes
    True
    """
    return _need(predict_peak(spec, optimizer_trace=optimizer_trace))


def _need(p: MemoryPrediction) -> int:
    return int(p.peak_bytes + (WORKSPACE_HEADROOM - 1) * (p.activations + p.temporaries))


def calibrate_within(
    spec: StepSpec,
    usable_bytes: int,
    *,
    optimizer_trace: Any = None,
    floor: StepLog | None = None,
) -> tuple[Calibration | None, str]:
    """:func:`calibrate` at the sizes (of 1, 2, 4) whose real step stays inside the budget.

    Calibration runs real steps; at a large input even micro-batch 4 can take several times the
    budget it is meant to plan for. Each size's :func:`calibration_need` must fit
    ``usable_bytes`` before it is run. Returns the calibration
    (None when not even micro-batch 1 may run) and a note for the plan ('' when all three ran).
    ``optimizer_trace``: the plan's :class:`~bigbatch.memory.predict.OptimizerTrace`;
    ``floor``: the plan's uncalibrated trace of its smallest micro-batch, whose need is known
    and whose :func:`~bigbatch.memory.predict.peak_bound` clears a larger size without
    tracing it (the size is traced where the bound does not fit).
    """

    def fits(b: int) -> bool:
        if floor is not None and b == floor.spec.batch_size:
            return _need(replay_with_calibration(floor, None)) <= usable_bytes
        if floor is not None and b > floor.spec.batch_size:
            peak, working = peak_bound(floor, b)
            if peak + (WORKSPACE_HEADROOM - 1) * working <= usable_bytes:
                return True
        try:
            need = calibration_need(spec.with_batch(b), optimizer_trace=optimizer_trace)
            return need <= usable_bytes
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
