"""Predict the peak memory of a training step without allocating it (and without a GPU).

The model is built on the ``meta`` device and materialised inside ``FakeTensorMode``, where a
dispatch mode tracks every live tensor storage. A training step (forward, loss, backward,
optimizer step, zero_grad) runs on fake tensors twice in effect: the first, which creates the
optimizer state, and a steady one with the state alive; the peak is the larger. Nothing is
allocated: a ViT-Large at micro-batch 256 is predicted on a laptop in seconds.

What fake tensors cannot see, CPU kernels' private workspaces (oneDNN convolution backward,
im2col), is added by :mod:`bigbatch.memory.calibrate` from small real steps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from bigbatch.device import device_kind
from bigbatch.memory.budget import format_bytes
from bigbatch.memory.cuda_allocator import simulate
from bigbatch.memory.cuda_autocast import cuda_autocast_rules
from bigbatch.memory.cuda_runtime import CudaLibraries
from bigbatch.memory.cuda_trl import trl_kernels_as_on_a_card
from bigbatch.memory.fake_branches import real_branches
from bigbatch.memory.fsdp import local_shard, storage_resizes
from bigbatch.memory.measure import measure_step_peak
from bigbatch.memory.meta import build_on_meta, to_empty_shared, unfakeable_op
from bigbatch.memory.stack import (
    SHALLOW,
    LayerStack,
    Recorded,
    StackJournal,
    extrapolate,
    same_events,
)
from bigbatch.memory.step import (
    PRECISIONS,
    StepSpec,
    batch_bytes,
    first_optimizer_step,
    make_inputs,
    make_optimizer,
    optimizer_state_tensors,
    run_step_loss,
)
from bigbatch.memory.tracker import _BoundReached, _StorageTracker

__all__ = ["MemoryPrediction", "predict_peak"]

log = logging.getLogger("bigbatch")


@dataclass
class MemoryPrediction:
    """Predicted peak of a training step, and what it is made of at that moment
    (:func:`predict_peak`).

    >>> p = predict_peak(StepSpec(lambda: nn.Linear(1024, 1024), (1024,), 32, optimizer="adam"))
    >>> p.parameters == 1024 * 1025 * 4, p.optimizer_state // p.parameters
    (True, 2)
    >>> p.peak_bytes == sum(p.parts().values())
    True
    """

    peak_bytes: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # saved by the forward pass for backward, alive at the peak
    temporaries: int  # everything else alive at the peak (backward buffers, workspaces)
    batch_size: int
    device: str
    precision: str
    optimizer: str
    workspace_bytes: int = 0  # added by CPU calibration (kernel workspaces fake tensors miss)
    # CUDA only (bigbatch.memory.cuda_allocator, .cuda_runtime): the caching allocator's peaks
    # for the traced allocations and the cuBLAS workspaces it holds (rounding, pools,
    # fragmentation), and the cuBLAS handle autograd's thread adds outside it.
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    # Of reserved_bytes, what cuDNN's benchmark trials add on the first step with the card's
    # memory free: they take only free memory (halving where it is short), so a plan need not
    # hold them.
    benchmark_trial_bytes: int = 0
    library_workspace_bytes: int = 0
    cuda_handle_bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # CUDA: how many convolution passes' workspaces came from a card's measured cuDNN profile
    # (bigbatch.memory.cuda_cudnn) and how many from the rule; empty without convolutions.
    cudnn_workspaces: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def planning_bytes(self) -> int:
        """What a plan must fit: the peak, or on CUDA what the allocator reserves (a CUDA OOM is
        a segment that cannot be reserved) and the handles the step adds outside it."""
        return max(self.peak_bytes, self.settled_reserved_bytes) + self.cuda_handle_bytes

    @property
    def settled_reserved_bytes(self) -> int:
        """What the allocator reserves outside cuDNN's benchmark trials (CUDA; 0 elsewhere)."""
        return self.reserved_bytes - self.benchmark_trial_bytes

    def parts(self) -> dict[str, int]:
        """Bytes at the peak, by kind (kernel workspaces count as temporaries); on CUDA also
        what the allocator holds beyond them and the BLAS workspaces."""
        parts = {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "activations": self.activations,
            "temporaries": self.temporaries + self.workspace_bytes,
        }
        if self.reserved_bytes:
            parts["blas_workspaces"] = self.library_workspace_bytes
            parts["allocator_cache"] = max(
                0, self.settled_reserved_bytes - self.peak_bytes - self.library_workspace_bytes
            )
            parts["cudnn_benchmark_trials"] = self.benchmark_trial_bytes
            parts["cuda_handles"] = self.cuda_handle_bytes
        return parts

    def breakdown(self) -> str:
        labels = {
            "parameters": "weights",
            "optimizer_state": f"{self.optimizer} state",
            "allocator_cache": "CUDA allocator rounding and cache",
            "blas_workspaces": "cuBLAS workspaces",
            "cuda_handles": "autograd thread's cuBLAS handle",
            "cudnn_benchmark_trials": "cuDNN benchmark trials (first step, only memory free)",
        }
        return ", ".join(
            f"{labels.get(kind, kind)} {format_bytes(b)}" for kind, b in self.parts().items() if b
        )


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(local_shard(v).untyped_storage().nbytes() for v in optimizer_state_tensors(opt))


@dataclass
class _FirstStep:
    """What the optimizer's first step (creating the state) did above what was live."""

    highest: int  # bytes above its start at its highest point
    state_at_highest: int  # of which optimizer state
    state: int  # the state it leaves


@dataclass
class _SteadyStep:
    """The steady optimizer step: its highest point above its start, and how many counted ops
    it dispatched. It runs past the calibration's ops (calibration measures no optimizer
    step), so no op of it has a workspace and it moves no alignment."""

    highest: int
    op_count: int


@dataclass
class OptimizerTrace:
    """The optimizer steps of one traced training step, kept to replay in the next prediction
    of the same model, optimizer and precision at another micro-batch: the steps touch only
    the weights, their gradients and the state, so what they allocate does not depend on the
    micro-batch, and replaying them skips most of a trace's fake ops (1,866 of 2,953 for
    resnet18 with AdamW). They are recorded once, on the model's meta weights, before its first
    fake trace (:func:`_optimizer_on_meta`). The planner makes one per plan; a prediction with
    it equals one without, to the byte (``tests/memory/test_predict.py``). CPU targets only."""

    key: tuple[Any, ...] | None = None
    first: _FirstStep | None = None
    steady: _SteadyStep | None = None
    # The steps were recorded on meta tensors (:func:`_optimizer_on_meta`) with a gradient for
    # every trainable weight; the first fake trace checks that its backward made them all.
    on_meta: bool = False
    unchecked: bool = False

    def fits(self, spec: StepSpec) -> bool:
        key = (spec.model, spec.optimizer, spec.precision, spec.device, spec.step)
        if self.key is None:
            self.key = key
        return self.key == key and torch.device(spec.device).type != "cuda"


def predict_peak(
    spec: StepSpec, *, calibration: Any = None, optimizer_trace: OptimizerTrace | None = None
) -> MemoryPrediction:
    """Predict the peak memory of training ``spec`` on fake tensors: the larger of the first
    step (which creates the optimizer state) and a steady step (with the state alive).

    A model with an op fake tensors cannot run (no meta kernel, or an output shape that depends
    on the data: ``torch.unique``, ``nonzero``) is measured instead: real CPU steps at two small
    micro-batch sizes, extrapolated linearly, with a note saying so (:func:`_measured_fallback`).

    >>> import torch
    >>> spec = StepSpec(lambda: torch.nn.Linear(1024, 1024), (1024,), batch_size=32, optimizer="adamw")
    >>> p = predict_peak(spec)
    >>> p.parameters, p.optimizer_state >= 2 * p.parameters
    (4198400, True)
    """
    if spec.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {spec.batch_size}")
    if spec.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {spec.precision!r}")
    return _fake_or_measured(spec, calibration, optimizer_trace, None)


def _fake_or_measured(
    spec: StepSpec,
    calibration: Any,
    optimizer_trace: OptimizerTrace | None,
    keep: list[StepLog] | None,
) -> MemoryPrediction:
    try:
        stacked = _stacked(spec) if calibration is None else None
        return stacked or _predict_on_fake(spec, calibration, optimizer_trace, keep)
    except Exception as exc:
        op = unfakeable_op(exc)
        if op is None:
            raise
    return _measured_fallback(spec, op)


def _stacked(
    spec: StepSpec, trace: Callable[[StepSpec, list[Recorded]], Any] | None = None
) -> MemoryPrediction | None:
    """A CUDA trace of a deep model's step made from its 5-layer model's trace
    (bigbatch.memory.stack), where that, extrapolated to 6 layers, made a 6-layer trace's
    events for steps of this kind (micro-batches of one sample or several; a lone step or a
    window's; ``trace``'s, evaluation's forward, or training's); None where it did not, where
    the layers differ, and where it does not apply (not CUDA, FSDP2's ranks, a shallow
    model)."""
    stack = spec.layers
    ranks = torch.distributed.is_available() and torch.distributed.is_initialized()
    # The autograd engine's running node tells the backward's layers apart (torch >= 2.1).
    followed = hasattr(torch._C, "_current_autograd_node")
    if stack is None or ranks or torch.device(spec.device).type != "cuda" or not followed:
        return None
    if not stack.worth_it() or not stack.alike(lambda: build_on_meta(spec.model)):
        return None
    t0 = time.perf_counter()
    kind = (trace is not None, spec.batch_size > 1, spec.held_gradients)
    if stack.checked.get(kind) is False:
        return None
    try:
        shallow = _recorded(spec, stack, SHALLOW, trace)
        if kind not in stack.checked:
            deeper = extrapolate(shallow, SHALLOW + 1)
            stack.checked[kind] = deeper is not None and same_events(
                deeper, _recorded(spec, stack, SHALLOW + 1, trace)
            )
    except Exception as exc:  # a shortcut only: the full trace is made, and says what fails
        why = f"{type(exc).__name__}: {exc}"
        log.info("%s traced at full depth: its shallow model's trace failed (%s)", spec.name, why)
        stack.checked[kind] = False
        return None
    deep = extrapolate(shallow, stack.count) if stack.checked[kind] else None
    return None if deep is None else _replayed(deep, spec, t0)


def _recorded(
    spec: StepSpec,
    stack: LayerStack,
    depth: int,
    trace: Callable[[StepSpec, list[Recorded]], Any] | None,
) -> Recorded:
    """The CUDA trace of ``spec``'s model built with ``depth`` layers (a training step's, or
    ``trace``'s), with each event's layer."""
    record: list[Recorded] = []
    shallow = replace(spec, model=stack.at_depth(depth))
    if trace is None:
        _predict_on_fake(shallow, None, record=record)
    else:
        trace(shallow, record)
    return record[0]


def _start_journal(tracker: _StorageTracker, record: list[Recorded] | None) -> None:
    """A CUDA trace whose events are to be ``record``-ed with their layers keeps a journal."""
    if record is not None and tracker.events is not None:
        journal = tracker.journal = StackJournal(lambda: tracker.phase)
        tracker.events = journal.events(tracker.events)


def _follow_layers(tracker: _StorageTracker, spec: StepSpec, model: nn.Module) -> None:
    """The journal's layers: the built model's (with their weights made), followed by hooks."""
    if tracker.journal is not None and spec.layers is not None:
        layers = spec.layers.modules(model)
        tracker.journal.label_layers(layers, tracker.uid_of)
        tracker.journal.hook(layers)


def _replayed(rec: Recorded, spec: StepSpec, t0: float) -> MemoryPrediction:
    """The prediction a trace that made ``rec``'s events makes: its live tensors' peak (the
    tensors that move it, at each allocation), and the allocator's."""
    tracker = _StorageTracker()
    tracker.events, tracker.cuda = rec.events, rec.libraries
    for op, key, _ in rec.events:
        if op == "malloc" and key in rec.made:
            tracker.replayed_malloc(key, *rec.made[key])
        elif op == "free" and key in tracker.live:
            tracker.replayed_free(key)
    return _assemble(tracker, rec.uids, spec, "cuda", t0)


def check_forward(spec: StepSpec) -> None:
    """Run one forward pass of ``spec`` on fake tensors: a model that cannot take the input
    (a wrong size, a bad factory) raises here in a fraction of a second, allocating nothing.
    Cheaper than :func:`predict_peak` when only that is wanted (a fixed micro-batch).

    >>> check_forward(StepSpec(lambda: torch.nn.Linear(4, 2), (4,), 2))
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_on_meta(spec.model)
    device = "cpu" if torch.device(spec.device).type == "cuda" else spec.device
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), real_branches():
            model = to_empty_shared(model, device).train()
            with torch.no_grad():
                run_step_loss(spec, model, make_inputs(spec, device), torch.device(device).type)
    except Exception as exc:
        if unfakeable_op(exc) is None:
            raise  # an op without a fake kernel is not the model's fault: training will tell


def _measured_fallback(spec: StepSpec, op: str) -> MemoryPrediction:
    """Real CPU steps at two small micro-batch sizes, extrapolated linearly in the micro-batch
    (peak memory is close to affine in it; see the planner). Measured once per model and input,
    so a plan's several predictions cost two real steps. CPU kernels' memory stands in for a
    CUDA target's, which is not the same: the note says so."""
    t0 = time.perf_counter()
    (a, peak_a), (b, peak_b) = _measured_line(replace(spec, batch_size=1, device="cpu"))
    slope = (peak_b - peak_a) / (b - a)
    peak = max(peak_a, round(peak_a + slope * (spec.batch_size - a)))
    params = sum(p.numel() * p.element_size() for p in build_on_meta(spec.model).parameters())
    where = "" if spec.device == "cpu" else f" on the CPU, standing in for {spec.device}"
    return MemoryPrediction(
        peak_bytes=peak,
        parameters=params,
        gradients=0,
        optimizer_state=0,
        activations=0,
        temporaries=max(0, peak - params),
        batch_size=spec.batch_size,
        device=torch.device(spec.device).type,
        precision=spec.precision,
        optimizer=spec.optimizer,
        seconds=time.perf_counter() - t0,
        notes=[
            f"measured, not predicted: fake tensors cannot run {op}, so real steps at "
            f"micro-batch {a} and {b}{where} were measured and extrapolated linearly"
        ],
    )


@functools.lru_cache(maxsize=32)
def _measured_line(spec: StepSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    points = []
    for b in (1, 2, 4):
        try:
            points.append((b, measure_step_peak(spec.with_batch(b))))
        except ValueError:  # BatchNorm cannot train on one sample: start at 2
            continue
        if len(points) == 2:
            return points[0], points[1]
    raise ValueError(f"{spec.name or 'the model'} cannot run a real step at micro-batch 1, 2 or 4")


def _peak_parts(
    tracker: _StorageTracker, param_uids: set[int], grads_uids: set[int], state_uids: set[int]
) -> dict[str, int]:
    """What was alive at the peak, by kind."""
    parts = dict.fromkeys(
        ("parameters", "gradients", "optimizer_state", "activations", "temporaries"), 0
    )
    for uid, (size, phase) in tracker.peak_snapshot.items():
        if uid in param_uids:
            parts["parameters"] += size
        elif uid in grads_uids:
            parts["gradients"] += size
        elif uid in state_uids:
            parts["optimizer_state"] += size
        elif phase == "forward":
            parts["activations"] += size
        else:
            parts["temporaries"] += size
    return parts


def _first_step(
    tracker: _StorageTracker, params: list[nn.Parameter], opt: torch.optim.Optimizer, record: bool
) -> tuple[int, _FirstStep | None]:
    """The optimizer's first step, traced: (the state bytes it made, what it did, recorded)."""
    built = _state_bytes(opt)  # Adagrad makes its state when it is built
    start_uid = tracker.new_uid()
    with tracker.optimizer_phase(record) as points:
        first_optimizer_step(params, opt)
    made = _state_bytes(opt) - built
    if not points:
        return made, None
    sizes = {}
    for v in optimizer_state_tensors(opt):
        uid = tracker.uid_of(v)
        if uid is not None and uid > start_uid:
            sizes[uid] = tracker.live[uid][0]
    if tracker.live_bytes - tracker.recording_base != sum(sizes.values()):
        return made, None  # it left something besides the state: not replayable
    highest, watermark = max(points, key=lambda p: p[0])  # the first highest point
    at_highest = sum(n for uid, n in sizes.items() if uid < watermark)
    return made, _FirstStep(highest, at_highest, sum(sizes.values()))


def _replay_first_step(tracker: _StorageTracker, first: _FirstStep, state_uids: set[int]) -> int:
    """The recorded first step's peak and the state it leaves, as live entries; returns the
    state's entry."""
    partial, rest = tracker.new_uid(), tracker.new_uid()
    state_uids.add(partial)
    alive = {
        partial: (first.state_at_highest, "optimizer"),
        rest: (first.highest - first.state_at_highest, "optimizer"),
    }
    tracker.replay_peak(first.highest, 0, alive)
    uid = tracker.add_synthetic(first.state, "optimizer")
    state_uids.add(uid)
    return uid


def _steady_step(
    tracker: _StorageTracker, opt: torch.optim.Optimizer, record: bool
) -> _SteadyStep | None:
    """The steady optimizer step, traced; what it did, when ``record``."""
    op_index = tracker.op_index
    with tracker.optimizer_phase(record) as points:
        opt.step()
    if points is None or tracker.live_bytes != tracker.recording_base:
        return None  # it left something behind: not replayable
    return _SteadyStep(max((above for above, _ in points), default=-1), tracker.op_index - op_index)


def _replay_steady_step(tracker: _StorageTracker, steady: _SteadyStep) -> None:
    if steady.highest >= 0:
        tracker.replay_peak(steady.highest, 0, {tracker.new_uid(): (steady.highest, "optimizer")})
    tracker.op_index += steady.op_count
    if tracker.log is not None:
        tracker.log.append(("ops", steady.op_count))


def _optimizer_on_meta(model: nn.Module, optimizer: str, trace: OptimizerTrace) -> None:
    """Record the optimizer's first and steady steps on ``model``'s meta weights (the model
    its first fake trace builds, before they are made fake). They touch only the weights,
    their gradients and the state, whose sizes meta tensors carry, and meta tensors skip fake
    tensors' dispatch: efficientnet_b0 with AdamW takes 0.6 s here against 1.3 s in a fake
    trace. The steady step is recorded with every trainable weight holding a gradient; where
    the backward leaves one without, the fake trace records the step instead
    (``unchecked``), as it records all of a fused optimizer's (torch's fused kernels take no
    meta tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        tracker = _StorageTracker()
        with tracker:
            for p in params:  # updated in place: the weights, not new tensors
                tracker.track(p)
            opt = make_optimizer(optimizer, params)  # Adagrad's state is made here
            first = _first_step(tracker, params, opt, record=True)[1]
            for p in params:
                p.grad = torch.zeros_like(p)
            tracker.counting = True
            steady = _steady_step(tracker, opt, record=True)
    except Exception:  # an optimizer meta tensors cannot step: the fake trace records it
        return
    finally:
        for p in params:  # the model goes on to be traced, with no gradient yet
            p.grad = None
    trace.first, trace.steady, trace.unchecked = first, steady, steady is not None


def _materialize_state(
    tracker: _StorageTracker,
    params: list[nn.Parameter],
    opt: torch.optim.Optimizer,
    replayed_state: int,
) -> None:
    """Make the real (fake) state that a replayed first step stands for, unseen: its entry
    goes, the step's own peak was replayed already, and the gradients stay."""
    tracker.remove_synthetic(replayed_state)  # its uid stays state, for a peak seen before
    grads = [p.grad for p in params]
    counting, tracker.counting, tracker.observing = tracker.counting, False, False
    try:
        with tracker.in_phase("optimizer"):
            first_optimizer_step(params, opt)
    finally:
        tracker.counting, tracker.observing = counting, True
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def tracing_for(
    target: torch.device,
    calibration: Any = None,
    batch_size: int = 1,
    cudnn_benchmark: bool = False,
) -> tuple[torch.device, _StorageTracker, contextlib.AbstractContextManager[Any]]:
    """Where a step for ``target`` is traced on fake tensors, the tracker of its storages, and
    the context of CUDA autocast's rules (nothing elsewhere). The autograd engine wants a real
    CUDA context for CUDA tensors, even fake ones, so a CUDA step is traced on CPU-placed fake
    tensors with what differs on CUDA: 512-byte allocator blocks, the multi-tensor (foreach)
    optimizers CUDA defaults to, CUDA autocast's op lists and cuBLAS's and cuDNN's allocations
    (bigbatch.memory.cuda_autocast, .cuda_runtime), in cuDNN's benchmark mode or not, and the
    path TRL's fused LM head takes on a card (bigbatch.memory.cuda_trl)."""
    tracker = _StorageTracker(
        round_to=device_kind(target).allocator_block, calibration=calibration, batch_size=batch_size
    )
    if target.type != "cuda":
        return target, tracker, contextlib.nullcontext()
    tracker.cuda = CudaLibraries(cudnn_benchmark)
    tracker.events = tracker.cuda.start()
    return torch.device("cpu"), tracker, _cuda_rules()


@contextlib.contextmanager
def _cuda_rules() -> Iterator[None]:
    """CUDA autocast's op lists, and the path TRL's fused LM head takes on a card."""
    with cuda_autocast_rules(), trl_kernels_as_on_a_card():
        yield


# One function on purpose (over 80 lines): the traced step's tensors are locals whose lifetimes
# are the prediction (``del x`` where a loop frees its batch, ``waiting`` for the next batch);
# split across helpers, a frame or a return value would keep them alive longer than the real
# step does and move the peak.
def _predict_on_fake(
    spec: StepSpec,
    calibration: Any,
    optimizer_trace: OptimizerTrace | None = None,
    keep: list[StepLog] | None = None,
    live_only: bool = False,
    stop_above: int | None = None,
    record: list[Recorded] | None = None,
) -> MemoryPrediction:
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    target = torch.device(spec.device)
    model = build_on_meta(spec.model)
    device, tracker, rules = tracing_for(target, calibration, spec.batch_size, spec.cudnn_benchmark)
    tracker.stop_above = stop_above
    if target.type != "cuda" and keep is not None and calibration is None:
        tracker.log = []
    _start_journal(tracker, record)
    grads_uids: set[int] = set()
    state_uids: set[int] = set()
    # CPU: the optimizer's first step (which creates its state) runs on zero gradients, then one
    # steady step is traced; a GRU step is ~6k fake ops, so this halves the time. CUDA
    # traces both real steps: the allocator model needs the first step's segments
    # (``live_only``: it does not, see live_peak).
    steady = target.type != "cuda" or live_only
    trace = optimizer_trace if steady and optimizer_trace and optimizer_trace.fits(spec) else None
    replayed_state: int | None = None  # the live entry standing for the replayed state
    if trace is not None and not trace.on_meta:
        trace.on_meta = True
        _optimizer_on_meta(model, spec.optimizer, trace)
    resizes = storage_resizes(tracker.resized)
    with rules, FakeTensorMode(allow_non_fake_inputs=True), tracker, real_branches(), resizes:
        model = to_empty_shared(model, device)
        model.train()
        param_uids = set()
        for t in [*model.parameters(), *model.buffers()]:
            tracker.track(t)
            uid = tracker.uid_of(t)
            if uid is not None:
                param_uids.add(uid)
        _follow_layers(tracker, spec, model)
        params = [p for p in model.parameters() if p.requires_grad]
        with tracker.in_phase("optimizer"):  # Adagrad makes its state, step counts too, here
            opt = make_optimizer(
                spec.optimizer, params, foreach=True if target.type == "cuda" else None
            )
        tracker.host_step_counts = not opt.defaults.get("fused")
        # Inputs exist before the step, as a DataLoader's batch would (and as measured).
        inputs = [make_inputs(spec, device) for _ in range(1 if steady else 2)]
        waiting, in_batch = None, 0
        if steady:
            # The real first step has the next batch waiting beside its own: ``waiting`` stands
            # for it, while the state is created and then, in the forward and backward, for
            # whatever of it the state does not already outweigh.
            in_batch = batch_bytes(inputs[0])
            waiting = torch.empty(in_batch, dtype=torch.uint8, device=device)
            if trace is not None and trace.first is not None:
                replayed_state = _replay_first_step(tracker, trace.first, state_uids)
                made = trace.first.state
            else:
                made, first = _first_step(tracker, params, opt, record=trace is not None)
                if trace is not None:
                    trace.first = first
            del waiting
            ahead = 0 if live_only else max(0, in_batch - made)
            waiting = torch.empty(ahead, dtype=torch.uint8, device=device)
        tracker.counting = True
        try:
            while inputs:
                x = inputs.pop(0)
                if spec.held_gradients and steady:
                    _hold_gradients(tracker, params)
                # CUDA: the steady step is a window's first micro-batch and its second (``x``
                # again), which holds the first's gradients in the segments the card gave them.
                for _ in range(2 if spec.held_gradients and not steady and not inputs else 1):
                    with tracker.in_phase("forward"):
                        loss = run_step_loss(spec, model, x, device.type)
                    with tracker.in_phase("backward"):
                        loss.backward()
                        del loss
                waiting = None  # the real first step's optimizer peak is the one traced above
                grads_uids |= tracker.uids_of(p.grad for p in params)
                if trace is not None and trace.unchecked:
                    trace.unchecked = False
                    if any(p.grad is None for p in params):  # a weight the loss does not reach
                        trace.steady = None
                # Calibration measures no optimizer step: past its ops, the step matches none, so
                # one recording serves every prediction, calibrated or not.
                tracker.skip_calibrated_ops()
                if trace is not None and trace.steady is not None:
                    _replay_steady_step(tracker, trace.steady)
                else:
                    if replayed_state is not None:  # the state must exist for a real step
                        _materialize_state(tracker, params, opt, replayed_state)
                    steady_step = _steady_step(tracker, opt, record=trace is not None)
                    if trace is not None:
                        trace.steady = steady_step
                state_uids |= tracker.uids_of(optimizer_state_tensors(opt))
                opt.zero_grad(set_to_none=True)
                del x  # a training loop's batch lives until its optimizer step is done
        except _BoundReached:  # live_peak's bound has passed what it is compared with
            grads_uids |= tracker.uids_of(p.grad for p in params)
    if record is not None and tracker.journal is not None and tracker.events is not None:
        kinds = (param_uids, grads_uids, state_uids)
        record.append(tracker.journal.recorded(tracker.events, kinds, tracker.cuda))
    del model, opt
    # FSDP2's unsharded weights (storages it resizes) count as weights, as its shards do.
    uids = (param_uids | tracker.resized_uids, grads_uids, state_uids)
    prediction = _assemble(tracker, uids, spec, target.type, t0)
    if tracker.log is not None and keep is not None:
        keep.append(StepLog(spec, tracker.log, uids, in_batch))
    return prediction


def _hold_gradients(tracker: _StorageTracker, params: list[nn.Parameter]) -> None:
    """The gradients a later micro-batch of a window starts with, summed from the earlier
    ones; made outside the counted ops, which a calibration matches (a real step makes them in
    the earlier micro-batches' backward)."""
    counting, tracker.counting = tracker.counting, False
    try:
        with tracker.in_phase("backward"):
            for p in params:
                p.grad = torch.zeros_like(p)
    finally:
        tracker.counting = counting


def _assemble(
    tracker: _StorageTracker,
    uids: tuple[set[int], set[int], set[int]],
    spec: StepSpec,
    device_type: str,
    t0: float,
) -> MemoryPrediction:
    """The prediction a finished trace (or replay) makes: its peak, by kind."""
    parts = _peak_parts(tracker, *uids)
    notes = []
    if tracker.calibration is not None and not tracker.aligned:
        notes.append(
            f"op sequence left the calibration at op {tracker.left_at}: workspaces after it are not counted"
        )
    reserved = allocated = library = handles = trials = 0
    cudnn = ""
    if tracker.events is not None and tracker.cuda is not None:
        allocator = simulate(tracker.events, spec.memory_limit)
        reserved, allocated = allocator.reserved_bytes, allocator.allocated_bytes
        trials = allocator.reserved_bytes - allocator.settled_bytes
        if trials_note := tracker.cuda.trials_note():
            notes.append(trials_note)
        if allocator.over_limit:
            notes.append(
                f"{allocator.over_limit} allocation(s) would run out of memory under the "
                f"allocator's limit of {format_bytes(spec.memory_limit or 0)}"
            )
        library, handles = tracker.cuda.workspace_bytes, tracker.cuda.handle_bytes
        cudnn = tracker.cuda.cudnn_note()
    return MemoryPrediction(
        peak_bytes=tracker.peak_bytes,
        workspace_bytes=tracker.peak_workspace,
        reserved_bytes=reserved,
        allocated_bytes=allocated,
        benchmark_trial_bytes=trials,
        library_workspace_bytes=library,
        cuda_handle_bytes=handles,
        notes=notes,
        cudnn_workspaces=cudnn,
        batch_size=spec.batch_size,
        device=device_type,
        precision=spec.precision,
        optimizer=spec.optimizer,
        seconds=time.perf_counter() - t0,
        **parts,
    )


@dataclass
class StepLog:
    """An uncalibrated CPU trace of one step, kept as what moved its peak: tensors made and
    freed, counted ops (with the sizes their new outputs had), replayed optimizer peaks. A
    calibration changes none of that, only what is added at each op (a workspace), so
    :func:`replay_with_calibration` makes the calibrated prediction without tracing again."""

    spec: StepSpec
    events: list[tuple[Any, ...]]
    uids: tuple[set[int], set[int], set[int]]  # parameters, gradients, optimizer state
    batch_bytes: int  # one micro-batch of inputs


def peak_bound(log: StepLog, batch_size: int) -> tuple[int, int]:
    """Upper bounds, at ``batch_size`` (not below the log's), on the uncalibrated peak and on
    the working set (all but the weights, their gradients and the optimizer state) at any
    point, from the log alone: those three do not grow with the micro-batch, and every other
    tensor is taken to grow in proportion to it (one per sample does; one that does not
    grow is overcounted), with a waiting batch of inputs besides. Only a tensor that grows
    faster than the micro-batch (a batch x batch similarity) escapes it.

    >>> import torch
    >>> _, log = trace_step(StepSpec(lambda: torch.nn.Linear(64, 8), (64,), 1))
    >>> peak_bound(log, 4)[0] >= predict_peak(StepSpec(lambda: torch.nn.Linear(64, 8), (64,), 4)).peak_bytes
    True
    """
    if batch_size < log.spec.batch_size:
        raise ValueError(f"the bound is for micro-batches from {log.spec.batch_size} up")
    scale = batch_size / log.spec.batch_size
    fixed = set().union(*log.uids)
    waiting = math.ceil(scale * log.batch_bytes)
    live: dict[int, tuple[int, bool]] = {}
    total = working = peak = most_working = 0
    for event in log.events:
        kind = event[0]
        if kind == "add":
            _, uid, size, _, observed = event
            grows = uid not in fixed
            size = math.ceil(size * scale) if grows else size
            live[uid] = (size, grows)
            total += size
            working += size if grows else 0
            if observed:
                peak = max(peak, total)
                most_working = max(most_working, working)
        elif kind == "free":
            size, grows = live.pop(event[1])
            total -= size
            working -= size if grows else 0
        elif kind == "replay_peak":  # an optimizer step's highest point: it does not grow
            above, workspace = event[1], event[2]
            peak = max(peak, total + above + workspace)
            most_working = max(most_working, working + above + workspace)
    return peak + waiting, most_working + waiting


def live_peak(spec: StepSpec, *, stop_above: int | None = None) -> MemoryPrediction | None:
    """A lower bound on a CUDA step's :attr:`~MemoryPrediction.planning_bytes` at a third of
    its trace's cost: the tensors alive at the peak of a window's later micro-batch, traced
    alone (the optimizer's first step on zero gradients, then one forward and backward with
    the gradients held), where the full trace runs the first step's micro-batch and the
    window's two. It has every tensor those have at each moment of that micro-batch, and the
    allocator reserves at least what is alive; the cache beyond it is not modelled
    (``reserved_bytes`` 0). A planner rules a size out with it (a 7-8B model's second
    micro-batch on a 24 GB card) without the full trace. None on other devices, whose trace
    is that one step already (:func:`predict_peak`), for a rank on a process group (an
    FSDP2 rank's gradients are its reduce-scatter's shards, which held copies made here are
    not: 1 KiB over the trace for a small model), and for a model fake tensors cannot run.

    With ``stop_above``, the trace stops at the first op whose peak passes it: the bound is
    then just over ``stop_above`` (the peak so far; the rest of the step could only raise it),
    and that is all a planner comparing it with the memory it has needs to know (the 8B
    model's micro-batch 2 passes its card's memory by the end of its forward, a third of the
    ops).

    >>> spec = StepSpec(lambda: torch.nn.Linear(64, 8), (64,), 4, device="cuda")
    >>> live_peak(spec).planning_bytes <= predict_peak(spec).planning_bytes
    True
    >>> live_peak(spec, stop_above=1).peak_bytes <= live_peak(spec).peak_bytes
    True
    >>> live_peak(StepSpec(lambda: torch.nn.Linear(64, 8), (64,), 4)) is None
    True
    """
    ranks = torch.distributed.is_available() and torch.distributed.is_initialized()
    if torch.device(spec.device).type != "cuda" or ranks:
        return None
    if spec.batch_size < 1 or spec.precision not in PRECISIONS:
        return predict_peak(spec)  # its error
    try:
        p = _predict_on_fake(spec, None, live_only=True, stop_above=stop_above)
    except Exception as exc:
        if unfakeable_op(exc) is None:
            raise
        return None  # measured instead (predict_peak): no trace to bound
    return replace(
        p, reserved_bytes=0, allocated_bytes=0, benchmark_trial_bytes=0, library_workspace_bytes=0
    )


def trace_step(
    spec: StepSpec, *, optimizer_trace: OptimizerTrace | None = None
) -> tuple[MemoryPrediction, StepLog | None]:
    """:func:`predict_peak` without a calibration, and the trace's :class:`StepLog` (None
    where the step was measured instead, or is for a GPU): the planner traces its floor once
    and replays it calibrated (:func:`replay_with_calibration`), and bounds a calibration
    step's need from it (:func:`peak_bound`).

    >>> p, log = trace_step(StepSpec(lambda: torch.nn.Linear(8, 2), (8,), 4))
    >>> replay_with_calibration(log, None).peak_bytes == p.peak_bytes
    True
    """
    if spec.batch_size < 1 or spec.precision not in PRECISIONS:
        return predict_peak(spec), None  # its error
    keep: list[StepLog] = []  # stays empty where the step is measured or for a GPU
    prediction = _fake_or_measured(spec, None, optimizer_trace, keep)
    return prediction, (keep[0] if keep else None)


def replay_with_calibration(log: StepLog, calibration: Any) -> MemoryPrediction:
    """The prediction a trace of ``log.spec`` with ``calibration`` would make, to the byte,
    from the log: each counted op is matched to the calibration as a trace matches it, its
    outputs take the real sizes where the calibration measured them larger (oneDNN's LSTM
    workspace, BatchNorm's float32 statistics under bf16), and its workspace is added there."""
    t0 = time.perf_counter()
    b = log.spec.batch_size
    tracker = _StorageTracker(calibration=calibration, batch_size=b)
    tracker.counting = True
    for event in log.events:
        kind = event[0]
        if kind == "add":
            tracker.replayed_malloc(*event[1:])
        elif kind == "free":
            tracker.replayed_free(event[1])
        elif kind == "op":
            _, name, made = event
            matched = tracker._match(name) if tracker.aligned else None
            if matched is not None:
                _grow_to_real(tracker, made, calibration.output_sizes(matched, b))
                tracker._observe(calibration.workspace(matched, b))
            tracker.op_index += 1
        elif kind == "replay_peak":
            tracker.replay_peak(*event[1:])
        elif kind == "skip":
            tracker.skip_calibrated_ops()
        else:  # "ops": a replayed steady optimizer step's op count
            tracker.op_index += event[1]
    return _assemble(tracker, log.uids, log.spec, "cpu", t0)


def interpolate_log(low: StepLog, high: StepLog, spec: StepSpec) -> StepLog | None:
    """The log a trace of ``spec`` would make, from logs at a smaller and a larger micro-batch
    with the same events (the same ops, tensors, frees, in the same order): each tensor's size
    on the line through its two sizes. None where the events differ, or a size falls between
    whole bytes (not on such a line). Exact where every size is affine in the micro-batch, as
    a model's tensors are (per sample, or fixed); the planner confirms the size it chooses
    with a trace.

    >>> lin = lambda b: StepSpec(lambda: torch.nn.Linear(8, 2), (8,), b)
    >>> low, high = trace_step(lin(2))[1], trace_step(lin(6))[1]
    >>> mid = interpolate_log(low, high, lin(4))
    >>> replay_with_calibration(mid, None).peak_bytes == predict_peak(lin(4)).peak_bytes
    True
    """
    a, c, b = low.spec.batch_size, high.spec.batch_size, spec.batch_size
    if not a < b < c or len(low.events) != len(high.events) or low.uids != high.uids:
        return None

    def size(x: int, y: int) -> int | None:
        num = x * (c - b) + y * (b - a)
        return num // (c - a) if num % (c - a) == 0 and num >= 0 else None

    events: list[tuple[Any, ...]] = []
    for e, f in zip(low.events, high.events, strict=True):
        if e == f:
            events.append(e)
            continue
        if e[0] != f[0] or e[0] not in ("add", "op"):
            return None
        if e[0] == "add":
            n = size(e[2], f[2])
            if n is None or (e[1], e[3], e[4]) != (f[1], f[3], f[4]):
                return None
            events.append((e[0], e[1], n, e[3], e[4]))
            continue
        if e[1] != f[1] or len(e[2]) != len(f[2]):
            return None
        made = []
        for (uid, x), (other, y) in zip(e[2], f[2], strict=True):
            n = size(x, y)
            if n is None or uid != other:
                return None
            made.append((uid, n))
        events.append((e[0], e[1], tuple(made)))
    return StepLog(spec, events, low.uids, size(low.batch_bytes, high.batch_bytes) or 0)


def _grow_to_real(
    tracker: _StorageTracker, made: tuple[tuple[int, int], ...], real: tuple[int, ...]
) -> None:
    """An op's new outputs at the real sizes the calibration measured where those are larger:
    a trace tracks them so as they are made; their op's last point (seen again here) is the
    highest of its points, and the one a peak would be."""
    if len(real) != len(made):
        return
    grown = False
    for (uid, fake), n in zip(made, real, strict=True):
        if uid >= 0 and n > fake and uid in tracker.live:
            size, phase = tracker.live[uid]
            tracker.live[uid] = (n, phase)
            tracker.live_bytes += n - size
            grown = True
    if grown:
        tracker._observe(0)
