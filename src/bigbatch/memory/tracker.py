"""The dispatch mode under a predicted step: every live tensor storage by the phase that made it
(forward, backward, optimizer), the peak and who was alive at it, and the replay of a calibrated
step's workspaces. :mod:`bigbatch.memory.predict` runs the step under it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import weakref
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bigbatch.memory.cuda_runtime import CudaLibraries
from bigbatch.memory.fsdp import StreamNumbers, local_shard
from bigbatch.memory.stack import StackJournal

__all__: list[str] = []


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
