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
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bigbatch.device import device_kind
from bigbatch.memory.budget import format_bytes
from bigbatch.memory.cuda_allocator import simulate
from bigbatch.memory.cuda_autocast import cuda_autocast_rules
from bigbatch.memory.cuda_runtime import CudaLibraries
from bigbatch.memory.cuda_trl import trl_kernels_as_on_a_card
from bigbatch.memory.fake_branches import real_branches
from bigbatch.memory.fsdp import StreamNumbers, local_shard, storage_resizes
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


# Ops that return a view of their input (no new storage, no workspace).
_VIEW_OPS = frozenset(
    f"aten.{op}"
    for op in (
        "view.default",
        "_unsafe_view.default",
        "detach.default",
        "alias.default",
        "as_strided.default",
        "expand.default",
        "t.default",
        "transpose.int",
        "permute.default",
        "slice.Tensor",
        "select.int",
        "unsqueeze.default",
        "squeeze.dim",
    )
)
_LOOKAHEAD = 8  # calibration ops a fake op may skip when aligning
# Fake-only ops in a row before the sequences count as parted (convnext's LayerNorm dispatches
# 5 in fake mode: squeeze twice, new_zeros, as_strided, copy_).
_MAX_MISSES = 16


_TORCH_DIR = os.path.dirname(torch.__file__)


def _issued_by_autograd_engine() -> bool:
    """Whether the op being dispatched comes from autograd's engine itself (a gradient sum),
    not from Python code a backward runs (a checkpointed block's recomputed forward, a custom
    Function's backward): every frame down to autograd's ``_engine_run_backward`` is torch's or
    this module's."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and not path.startswith(_TORCH_DIR):
            return False
        if frame.f_code.co_name == "_engine_run_backward":
            return True
        frame = frame.f_back
    return False


class _BoundReached(Exception):
    """A tracker's peak passed its ``stop_above``: the lower bound being traced is settled."""


class _StorageTracker(TorchDispatchMode):
    """Live tensor storages by creation phase, with the peak and who was alive at it."""

    def __init__(self, round_to: int = 1, calibration: Any = None, batch_size: int = 1) -> None:
        super().__init__()
        self.round_to = round_to
        self.calibration = calibration
        self.batch_size = batch_size
        self.op_index = 0  # fake ops dispatched in the counted steps
        self.cal_index = 0  # the next calibration op to match
        self.misses = 0  # fake ops in a row that matched none
        self.left_at = 0  # the fake op where the sequences parted
        self.counting = False  # ops are numbered from the first training step on
        self.aligned = calibration is not None
        self.peak_workspace = 0
        self.phase = "setup"
        # torch's optimizers keep their step counts in host memory, but for the fused ones.
        self.host_step_counts = True
        self.live: dict[int, tuple[int, str]] = {}  # uid -> (bytes, phase)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_snapshot: dict[int, tuple[int, str]] = {}
        self._refs: dict[int, list[tuple[weakref.ref[Any], int]]] = {}
        self._holders: dict[int, int] = {}  # uid -> storages beyond its first that hold it
        self._next_uid = 0
        # ("malloc", uid, bytes) / ("free", uid, 0) in order, for the CUDA allocator model,
        # with ("stream", number, 0) where the current stream changes (FSDP2's).
        self.events: list[tuple[str, Any, int]] | None = None
        self.streams = StreamNumbers()
        self.stream = 0  # the stream the events are on
        self.cuda: CudaLibraries | None = None  # with events: cuBLAS's and cuDNN's memory
        self.observing = True  # False: tensors are tracked, the peak is not moved
        self.resized_uids: set[int] = set()  # storages resized in place (FSDP2's unsharded)
        # While an optimizer phase is recorded (:meth:`optimizer_phase`), its points.
        self.recording: list[tuple[int, int]] | None = None
        self.recording_base = 0
        # What moved the peak, in order, for :func:`replay_with_calibration` (CPU, uncalibrated).
        self.log: list[tuple[Any, ...]] | None = None
        # A lower bound's trace (live_peak) past this peak stops: the rest cannot lower it.
        self.stop_above: int | None = None
        # A shallow model's trace to extrapolate (bigbatch.memory.stack): each event's layer.
        self.journal: StackJournal | None = None

    def uid_of(self, t: torch.Tensor) -> int | None:
        st = local_shard(t).untyped_storage()
        for ref, uid in self._refs.get(id(st), []):
            if ref() is st:
                return uid
        return None

    def uids_of(self, tensors: Iterable[torch.Tensor | None]) -> set[int]:
        """The uids of those of ``tensors`` that are tracked (None for a missing gradient)."""
        found = (self.uid_of(t) for t in tensors if t is not None)
        return {uid for uid in found if uid is not None}

    def track(self, t: torch.Tensor, real_bytes: int = 0) -> None:
        if self.uid_of(t) is not None:
            return
        st = local_shard(t).untyped_storage()
        n = self._rounded(max(st.nbytes(), real_bytes))
        uid = self._next_uid
        self._next_uid += 1
        self._hold(st, uid)
        self._add_live(uid, n)

    def _add_live(self, uid: int, n: int) -> None:
        if self.journal is not None:
            self.journal.made(uid, n, self.phase, self.observing)
        self.live[uid] = (n, self.phase)
        self.live_bytes += n
        if self.events is not None:
            self._follow_stream()
            self.events.append(("malloc", uid, n))
        if self.log is not None:
            self.log.append(("add", uid, n, self.phase, self.observing))
        self._observe(0)

    def _follow_stream(self) -> None:
        """Put the allocations that follow on the stream that is current now."""
        stream = self.streams.current()
        if stream != self.stream and self.events is not None:
            self.events.append(("stream", stream, 0))
            self.stream = stream

    def _rounded(self, n: int) -> int:
        if self.round_to > 1:
            return max(self.round_to, math.ceil(n / self.round_to) * self.round_to) if n else 0
        return n

    def resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (FSDP2 frees an unsharded parameter's memory
        with ``resize_(0)`` and takes it again before the next all-gather): its bytes follow,
        as the allocator's free and malloc."""
        uid = self.uid_of(t)
        n = self._rounded(local_shard(t).untyped_storage().nbytes())
        if uid is None or n == self.live.get(uid, (0, ""))[0]:
            return  # untracked, or already that size (alloc_storage on a live buffer)
        self.resized_uids.add(uid)
        old, _ = self.live.pop(uid, (0, ""))
        self.live_bytes -= old
        if old:
            if self.events is not None:
                self.events.append(("free", uid, 0))
            if self.log is not None:
                self.log.append(("free", uid))
        if n:
            self._add_live(uid, n)

    def _hold(self, st: Any, uid: int) -> None:
        """``uid``'s bytes stay live while storage ``st`` does (and any other holding it)."""
        key = id(st)

        def release(ref: weakref.ref[Any], uid: int = uid, key: int = key) -> None:
            refs = self._refs.get(key, [])
            refs[:] = [(r, u) for r, u in refs if u != uid]
            if not refs:
                self._refs.pop(key, None)
            if self._holders.get(uid):
                self._holders[uid] -= 1
                return
            was_live = uid in self.live
            size, _ = self.live.pop(uid, (0, ""))
            self.live_bytes -= size
            if self.events is not None:
                self.events.append(("free", uid, 0))
            if self.log is not None and was_live:
                self.log.append(("free", uid))

        if uid in self.live:
            self._holders[uid] = self._holders.get(uid, 0) + 1
        self._refs.setdefault(key, []).append((weakref.ref(st, release), uid))

    def _accumulated_in_place(self, func: Any, args: Any, out: Any) -> int | None:
        """The uid of the gradient buffer a backward ``add`` stands for adding to in place.

        Where a tensor takes gradients from two uses, autograd's engine sums them in its input
        buffer with ``old.add_(new)`` when it holds the last reference to a dense ``old``
        (torch/csrc/autograd/input_buffer.cpp), and with ``old + new`` only for tensor
        subclasses and under a dispatch mode, as in this trace: traced as is, every residual
        connection would allocate a gradient a real backward never does (ResNet-50: one per
        block). A small checkpointed Llama's backward, in a real CPU step's profile and in this
        trace alike: 19 sums in place, 10 adds that allocate (4 sums of a gradient held
        elsewhere too, 6 of its recomputed forward)."""
        if self.phase != "backward" or func is not torch.ops.aten.add.Tensor or len(args) != 2:
            return None
        old, new = args
        if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
            return None
        if not isinstance(out, torch.Tensor) or (old.shape, old.dtype) != (out.shape, out.dtype):
            return None
        # The last reference to the whole storage: not a view, no other tensor on it, and no
        # holder beyond the engine's. A fake tensor's use count is not autograd's, but its
        # Python references show other holders: ``old`` is held as a gradient just made is
        # (``new``) only where nothing else holds it.
        whole = old.untyped_storage().nbytes() == old.numel() * old.element_size()
        if old._is_view() or not whole or not is_non_overlapping_and_dense_or_false(old):
            return None
        if sys.getrefcount(old) != sys.getrefcount(new) or not _issued_by_autograd_engine():
            return None
        return self.uid_of(old)

    def _observe(self, workspace: int) -> None:
        if self.recording is not None:  # an optimizer phase: no calibration op, no workspace
            self.recording.append((self.live_bytes - self.recording_base, self._next_uid))
        if self.observing and self.live_bytes + workspace > self.peak_bytes:
            self.peak_bytes = self.live_bytes + workspace
            self.peak_workspace = workspace
            self.peak_snapshot = dict(self.live)

    def new_uid(self) -> int:
        self._next_uid += 1
        return self._next_uid - 1

    def replay_peak(self, above: int, workspace: int, alive: dict[int, tuple[int, str]]) -> None:
        """A recorded phase's highest point: ``above`` bytes over what is live now, made of
        ``alive`` (synthetic entries), with ``workspace`` besides."""
        if self.log is not None:
            self.log.append(("replay_peak", above, workspace, alive))
        if self.live_bytes + above + workspace > self.peak_bytes:
            self.peak_bytes = self.live_bytes + above + workspace
            self.peak_workspace = workspace
            self.peak_snapshot = {**self.live, **alive}

    def add_synthetic(self, size: int, phase: str) -> int:
        """A live entry that stands for tensors a replayed phase would have left (the state)."""
        uid = self.new_uid()
        self.live[uid] = (size, phase)
        self.live_bytes += size
        if self.log is not None:
            self.log.append(("add", uid, size, phase, False))
        return uid

    def replayed_malloc(self, uid: int, size: int, phase: str, observed: bool) -> None:
        """A tensor a trace made, made again as that trace made it (for a replay of its log
        or its events): live, and seen at the peak where the trace saw it."""
        self.live[uid] = (size, phase)
        self.live_bytes += size
        if observed:
            self._observe(0)

    def replayed_free(self, uid: int) -> None:
        self.live_bytes -= self.live.pop(uid)[0]

    def remove_synthetic(self, uid: int) -> None:
        size, _ = self.live.pop(uid)
        self.live_bytes -= size
        if self.log is not None:
            self.log.append(("free", uid))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "prim":
            # Fake mode's own metadata queries (prim.device, two per aten op): a real run has
            # none and they allocate nothing.
            return func(*args, **(kwargs or {}))
        if self.cuda is not None and self.events is not None:
            self._follow_stream()
            self.events += self.cuda.before(str(func), self.phase)
        first_new = self._next_uid
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        counted = self.counting
        real: tuple[int, ...] = ()
        matched = self._match(str(func)) if counted and self.aligned else None
        if matched is not None:
            real = self.calibration.output_sizes(matched, self.batch_size)
        if len(real) != len(tensors):
            real = (0,) * len(tensors)
        made = []  # for the log: each output's (uid, bytes), uid -1 where tracked already
        steal = self._accumulated_in_place(func, args, out)
        if steal is not None:  # the sum is the old buffer's storage
            self._hold(out.untyped_storage(), steal)
            tensors, real = [], ()
        elif self._on_host(func, args):
            tensors, real = [], ()
        for t, n in zip(tensors, real, strict=True):
            # Where a fake kernel under-reports an output (an empty workspace), the real size.
            before = self._next_uid
            self.track(t, n)
            if self.log is not None:
                uid = before if self._next_uid != before else -1
                made.append((uid, local_shard(t).untyped_storage().nbytes()))
        if counted and self.log is not None:
            self.log.append(("op", str(func), tuple(made)))
        if self.journal is not None:
            self.journal.after_op(func, args, kwargs, out, self._uid_from(first_new), self.uid_of)
        if matched is not None:
            # The kernel's scratch memory was alive together with its outputs.
            self._observe(self.calibration.workspace(matched, self.batch_size))
        if self.cuda is not None and self.events is not None:
            # On the stream followed before the op: no op changes the current stream.
            self.events += self.cuda.after(str(func), args, out)
        if counted:
            self.op_index += 1
            if self.stop_above is not None and self.peak_bytes > self.stop_above:
                raise _BoundReached
        return out

    def _on_host(self, func: Any, args: Any) -> bool:
        """Whether an op's output lives in host memory on a card though this trace's do not.

        torch's optimizers (neither capturable nor fused) make their step counts, and the
        constants that step them, without a device: from Python numbers (``torch.tensor(0.0)``:
        Adam, AdamW, Adagrad) or as 0-dim zeros (RMSprop), which are the only 0-dim tensors
        they make. On a card these stay in host memory and take no CUDA block (an 8B model's
        LoRA adapters would take 448 of them). A fused optimizer's are on the card."""
        if self.cuda is None or self.phase != "optimizer" or not self.host_step_counts:
            return False
        lifted = func is torch.ops.aten.lift_fresh.default
        return lifted or (func is torch.ops.aten.zeros.default and list(args[0]) == [])

    def _uid_from(self, first: int) -> Any:
        """The uid of a tensor tracked since uid ``first`` was next, else None."""

        def new(t: torch.Tensor) -> int | None:
            uid = self.uid_of(t)
            return uid if uid is not None and uid >= first else None

        return new

    def skip_calibrated_ops(self) -> None:
        """The calibrated ops are used up (where the backward's last ones went unmatched, the
        optimizer's would otherwise count as misses and part the sequences)."""
        if self.log is not None:
            self.log.append(("skip",))
        if self.calibration is not None:
            self.cal_index = len(self.calibration.ops_for(self.batch_size))

    def _match(self, name: str) -> int | None:
        """The calibration op this fake op is, or None. Fake mode dispatches a few ops the real
        run does not (a real ``detach`` may become ``new_empty_strided`` + ``copy_``), and the
        reverse: look a few ops ahead, count unmatched fake ops as extra, and stop adding only
        after a run of misses, when the sequences have really parted."""
        ops = self.calibration.ops_for(self.batch_size)
        if name in _VIEW_OPS and (self.cal_index >= len(ops) or ops[self.cal_index] != name):
            # A view allocates nothing: matched only in place, never by looking ahead, where
            # it would find the next layer's view and skip this layer's ops (MONAI's DynUNet
            # views after every activation; the real run does not).
            return None
        for j in range(self.cal_index, min(len(ops), self.cal_index + _LOOKAHEAD)):
            if ops[j] == name:
                self.cal_index, self.misses = j + 1, 0
                return j
        if self.cal_index >= len(ops):
            return None  # past the calibrated steps: nothing left to add, nothing to warn about
        self.misses += 1
        if self.misses > _MAX_MISSES:
            self.aligned = False
            self.left_at = self.op_index
        return None

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        if self.journal is not None:
            self.journal.layer = None  # a phase starts outside the layers
        try:
            yield
        finally:
            self.phase = previous
            if self.journal is not None:
                self.journal.layer = None

    @contextlib.contextmanager
    def optimizer_phase(self, record: bool) -> Iterator[list[tuple[int, int]] | None]:
        """An optimizer step; with ``record``, yields the list that fills with its points:
        (live bytes above its start, the next uid then)."""
        points: list[tuple[int, int]] | None = [] if record else None
        self.recording, self.recording_base = points, self.live_bytes
        try:
            with self.in_phase("optimizer"):
                yield points
        finally:
            self.recording = None


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
