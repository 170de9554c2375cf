"""A deep model's CUDA trace from a shallow one: the events of a stack of identical layers.

A decoder's step does the same thing in each of its layers, in its forward, its backward and its
optimizer step: a 70B Llama's 80 layers make a trace 80 times what one layer makes (36 s of a
CUDA trace on 2 cores, where the rest of the step takes 3). The allocator is not linear in the
layers (a segment cached in one layer serves the next), so the peak is not extrapolated: the
*events* are. A trace of the model built with 5 layers records, for every allocation and free,
the layer it belongs to (the layer running, from hooks on the layers: forward hooks, and in the
backward a hook on each layer's output node, which the engine runs when it reaches that
layer; in the optimizer step, the layer of the tensors an op reads). The events of its middle
layer are then repeated for each layer the deep model has beyond 5, each copy's tensors its
own, and references to a neighbour's tensors (the gradient one layer hands the next) follow
the copy; the allocator model replays the result as it would a full trace.

Nothing here is taken on trust: a planner extrapolates only after the 5-layer trace,
extrapolated to 6 layers, reproduced a real 6-layer trace event for event
(:func:`same_events`); else it traces in full.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["LayerStack"]

SHALLOW = 5  # layers traced: a first, a last, and a middle one whose neighbours are middle too
_TEMPLATE = 2  # the middle layer repeated
_UID_OPS = ("malloc", "free")
_KEYED_OPS = ("malloc", "free", "trial")  # cuDNN's benchmark trials have keys too


@dataclass(eq=False)
class LayerStack:
    """A model whose layers repeat (a decoder's): how many it has, the model built with another
    number, and which of a built model's modules the layers are. A CUDA trace of a
    :class:`~bigbatch.memory.step.StepSpec` that has one is made from a 5-layer model's trace
    where that was checked against a 6-layer one (``checked``, per kind of step: evaluation's
    forward or training's; a micro-batch of one sample or several, as a batch of several
    sequences has an attention mask; a lone step or a window's later micro-batch).

    >>> make = lambda n: (lambda: nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)]))
    >>> stack = LayerStack(12, make, lambda model: list(model))
    >>> len(stack.modules(stack.at_depth(5)()))
    5
    """

    count: int
    at_depth: Callable[[int], Callable[[], nn.Module]]
    modules: Callable[[nn.Module], list[nn.Module]]
    checked: dict[tuple[bool, ...], bool] = field(default_factory=dict)
    uniform: bool | None = None  # whether the layers are alike (:meth:`alike`), once asked

    def worth_it(self) -> bool:
        """Deep enough that a 5-layer trace is at most half a full one: the check's 5- and
        6-layer traces, once a plan, cost about a full trace, and the sizes after repay it."""
        return self.count >= 2 * SHALLOW

    def alike(self, build: Callable[[], nn.Module]) -> bool:
        """Whether the deep model's layers (``build()``'s, asked once) are copies of one another:
        the same modules, weights and attention windows. A layer unlike its neighbours past the
        sixth (a sliding-window pattern, dense layers before experts) would escape the 6-layer
        check."""
        if self.uniform is None:
            layers = self.modules(build())
            self.uniform = len(layers) == self.count and len({_signature(m) for m in layers}) == 1
        return self.uniform


def _signature(layer: nn.Module) -> tuple[Any, ...]:
    """What makes a layer's step what it is: its modules, their weights and attention
    settings (the layer's own index aside)."""
    shapes = tuple(
        (name, tuple(t.shape), t.dtype, t.requires_grad)
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]
    )
    kinds = []
    for name, module in layer.named_modules():
        settings = {k: v for k, v in vars(module).items() if k in _PER_LAYER_SETTINGS}
        kinds.append((name, type(module).__name__, tuple(sorted(settings.items(), key=str))))
    return shapes, tuple(kinds)


# Attributes transformers' attention and MLP modules vary by layer where a model's layers differ.
_PER_LAYER_SETTINGS = {"sliding_window", "is_sliding", "attention_type", "use_rope", "is_causal"}


class _ContextList(list[tuple[str, Any, int]]):
    """The tracker's allocator events, each with the layer running when it was added."""

    def __init__(self, events: Iterable[Any], context: Callable[[], int | None]) -> None:
        super().__init__(events)
        self.context = context
        self.layers: list[int | None] = [None] * len(self)

    def append(self, event: Any) -> None:
        super().append(event)
        self.layers.append(self.context())

    def extend(self, events: Iterable[Any]) -> None:
        events = list(events)
        super().extend(events)
        self.layers.extend([self.context()] * len(events))

    def __iadd__(self, events: Iterable[Any]) -> _ContextList:  # type: ignore[override,misc]
        self.extend(events)
        return self


@dataclass
class Recorded:
    """A finished trace's events with their layers, for :func:`extrapolate`."""

    events: list[tuple[str, Any, int]]
    layers: list[int | None]  # the layer each event belongs to (None: the rest of the step)
    label: dict[int, int | None]  # each tensor's layer
    made: dict[Any, tuple[int, str, bool]]  # tensor -> (bytes, phase, moves the peak)
    uids: tuple[set[Any], set[Any], set[Any]]  # parameters, gradients, optimizer state
    libraries: Any  # the trace's CudaLibraries: cuBLAS's workspaces and handles


class StackJournal:
    """What a trace records to be extrapolated: which layer runs (from hooks on the layers),
    and each tensor's layer. A tracker with one calls :meth:`made` for each tensor it tracks
    and :meth:`after_op` after each op, sets ``layer`` to None where a phase starts, and keeps
    its events in :meth:`events`'s list; ``phase`` is the tracker's.

    >>> journal = StackJournal(lambda: "forward")
    >>> journal.layer = 3
    >>> journal.made(0, 512, "forward", True)
    >>> journal.label
    {0: 3}
    """

    def __init__(self, phase: Callable[[], str]) -> None:
        self.phase = phase
        self.layer: int | None = None
        self.label: dict[int, int | None] = {}
        self.made_as: dict[int, tuple[int, str, bool]] = {}
        self._optimizer_layer: int | None = None

    def running(self) -> int | None:
        """The layer the step is in (None outside the layers, and in the optimizer step)."""
        return self.layer if self.phase() in ("forward", "backward") else None

    def events(self, events: list[tuple[str, Any, int]]) -> list[tuple[str, Any, int]]:
        return _ContextList(events, self.running)

    def made(self, uid: int, nbytes: int, phase: str, observing: bool) -> None:
        self.made_as[uid] = (nbytes, phase, observing)
        self.label[uid] = self.running()

    def label_layers(self, layers: list[nn.Module], uid_of: Callable[[Any], int | None]) -> None:
        """Each layer's weights and buffers belong to it (they are made before any layer runs)."""
        for i, layer in enumerate(layers):
            for t in [*layer.parameters(), *layer.buffers()]:
                uid = uid_of(t)
                if uid is not None:
                    self.label[uid] = i

    def hook(self, layers: list[nn.Module]) -> None:
        """Follow the layers: a layer's forward runs in it, and what follows until the next
        layer's (the previous layer's output freed as the loop moves on); its backward starts
        when the engine reaches its output's node and lasts until the next layer's starts (the
        engine runs a layer's nodes together: a node runs once all its inputs' nodes have). A
        recomputed forward (activation checkpointing) runs inside its own layer's backward."""
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._enter(i))
            layer.register_forward_hook(self._leave(i))

    def _enter(self, i: int) -> Callable[..., None]:
        def enter(module: nn.Module, args: Any) -> None:
            if torch._C._current_autograd_node() is None:
                self.layer = i

        return enter

    def _leave(self, i: int) -> Callable[..., None]:
        def start_backward(grads: Any) -> None:
            self.layer = i

        def leave(module: nn.Module, args: Any, out: Any) -> None:
            if torch._C._current_autograd_node() is not None:
                return  # a recomputed forward: its nodes never run
            hidden = out[0] if isinstance(out, tuple | list) else out
            if isinstance(hidden, torch.Tensor) and hidden.grad_fn is not None:
                hidden.grad_fn.register_prehook(start_backward)

        return leave

    def after_op(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        out: Any,
        new: Callable[[Any], int | None],
        uid_of: Callable[[Any], int | None],
    ) -> None:
        """Label what an op made outside the layers by what it read: a multi-tensor (foreach)
        op's i-th output by its i-th input, another op's by its inputs where they are all of one
        layer; in the optimizer step, one reading none by the last op that did, so each weight's
        state stays with its layer."""
        if self.running() is not None:
            return

        def layer_of(t: Any) -> int | None:
            uid = uid_of(t) if isinstance(t, torch.Tensor) else None
            return None if uid is None else self.label.get(uid)

        lists = isinstance(out, list | tuple) and args and isinstance(args[0], list | tuple)
        if str(func).startswith("aten._foreach_") and lists:
            for t, source in zip(out, args[0], strict=False):
                uid = new(t) if isinstance(t, torch.Tensor) else None
                if uid is not None:
                    self.label[uid] = self._optimizer_layer = layer_of(source)
            return
        read = {layer_of(t) for t in _tensors((args, kwargs))}
        layer = next(iter(read)) if len(read) == 1 else None
        if self.phase() == "optimizer":
            layer = self._optimizer_layer if layer is None else layer
            self._optimizer_layer = layer
        if layer is not None:
            for t in _tensors(out):
                uid = new(t)
                if uid is not None:
                    self.label[uid] = layer

    def recorded(
        self,
        events: list[tuple[str, Any, int]],
        uids: tuple[set[int], set[int], set[int]],
        libraries: Any,
    ) -> Recorded:
        """The trace so far, its tensors' kinds, and its CUDA libraries' memory."""
        layers = getattr(events, "layers", [None] * len(events))
        return Recorded(
            list(events), list(layers), dict(self.label), dict(self.made_as), uids, libraries
        )


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _event_layers(rec: Recorded) -> list[int | None]:
    """The layer each event belongs to: an allocation its tensor's, a free the running layer's
    (outside the layers, its tensor's: the optimizer frees each weight's temporaries), other
    events the running layer's."""
    out = []
    for (op, key, _), running in zip(rec.events, rec.layers, strict=True):
        tracked = op in _UID_OPS and isinstance(key, int) and key in rec.made
        if tracked and (op == "malloc" or running is None):
            out.append(rec.label.get(key))
        else:
            out.append(running)
    return out


def extrapolate(rec: Recorded, depth: int) -> Recorded | None:
    """``rec``'s events (a trace of the model with :data:`SHALLOW` layers) as a trace of the
    model with ``depth`` layers would make them: the middle layer's runs of events repeated
    for each layer added, in the order the layers run there (up in a forward, down in a
    backward), each copy's tensors its own.

    A tensor a copy refers to in a neighbour (the gradient of a layer's output, made in the
    next layer's backward) is that neighbour's: the same layer offset, in the deep model; one of
    the first or the last layer (whose runs hold what comes before and after the layers: the
    logits) is that layer's. None where a layer refers to another's tensors otherwise (not a
    stack of copies)."""
    k, t = SHALLOW, _TEMPLATE
    added = depth - k
    if added < 0:
        raise ValueError(f"a trace of {k} layers extrapolates to {k} or more, not {depth}")
    ordinal: dict[int, tuple[int | None, int]] = {}
    counts: dict[int | None, int] = defaultdict(int)
    for op, key, _ in rec.events:
        if op == "malloc" and isinstance(key, int) and key in rec.made and key not in ordinal:
            layer = rec.label.get(key)
            ordinal[key] = (layer, counts[layer])
            counts[layer] += 1

    def traced_layer(s: int) -> int | None:  # the deep model's layer s in the trace, or a copy
        return s if s < t else (None if s <= t + added else s - added)

    def key_in(op: str, key: Any, at: int | None, run: int | None) -> Any:
        """``key``, referred to by an event of traced layer ``run`` emitted as layer ``at``."""
        if op not in _UID_OPS or not (isinstance(key, int) and key in ordinal):
            return ("copy", at, key) if run == t and op in _KEYED_OPS else key
        layer, n = ordinal[key]
        if layer in (None, 0, k - 1) or at is None or run is None:
            return key  # the rest of the step's, or the first or last layer's: one of each
        s = at + (layer - run)
        same = traced_layer(s)
        if same is None:
            return ("layer", s, n)
        if same != layer:
            raise _NotAStack
        return key

    runs: list[tuple[int | None, list[tuple[str, Any, int]]]] = []
    for event, layer in zip(rec.events, _event_layers(rec), strict=True):
        if runs and runs[-1][0] == layer:
            runs[-1][1].append(event)
        else:
            runs.append((layer, [event]))
    events: list[tuple[str, Any, int]] = []
    made: dict[Any, tuple[int, str, bool]] = {}
    copies: dict[int, list[Any]] = defaultdict(list)  # traced key -> its keys in the deep model

    def emit(run_events: list[tuple[str, Any, int]], at: int | None, run: int | None) -> None:
        for op, key, nbytes in run_events:
            new = key_in(op, key, at, run)
            if op == "malloc" and isinstance(key, int) and key in rec.made:
                made[new] = rec.made[key]
                if new != key:
                    copies[key].append(new)
            events.append((op, new, nbytes))

    try:
        _emit_runs(runs, emit, t, added)
    except _NotAStack:
        return None

    def grown(uids: set[Any]) -> set[Any]:
        return {c for uid in uids for c in copies.get(uid, [uid])}

    grown_uids = (grown(rec.uids[0]), grown(rec.uids[1]), grown(rec.uids[2]))
    return Recorded(events, [None] * len(events), {}, made, grown_uids, rec.libraries)


def _emit_runs(runs: list[Any], emit: Callable[..., None], t: int, added: int) -> None:
    """Each run of events as its layer's in the deep model; the template's once per copy."""
    layers = [layer for layer, _ in runs]
    before, after = _nearest(layers), _nearest(layers[::-1])[::-1]
    for i, (layer, run_events) in enumerate(runs):
        if layer != t:
            at = None if layer is None else (layer if layer < t else layer + added)
            emit(run_events, at, layer)
            continue
        prior, later = before[i], after[i]
        up = prior < t if prior is not None else (later is not None and later > t)
        for at in range(t, t + added + 1) if up else range(t + added, t - 1, -1):
            emit(run_events, at, layer)


def _nearest(layers: list[int | None]) -> list[int | None]:
    """For each run, the layer of the nearest run before it that is in one."""
    out: list[int | None] = []
    last = None
    for layer in layers:
        out.append(last)
        last = layer if layer is not None else last
    return out


class _NotAStack(Exception):
    """The trace's layers are not copies of one another: it is not extrapolated."""


def same_events(a: Recorded, b: Recorded) -> bool:
    """Whether two traces made the same events with their keys renamed (in order of
    allocation): the same sizes, phases, and weights, gradients and state."""

    def canonical(rec: Recorded) -> tuple[list[Any], list[Any], list[set[int]]]:
        names: dict[Any, int] = {}
        out: list[tuple[str, Any, int]] = []
        for op, key, nbytes in rec.events:
            if op in _KEYED_OPS and (op != "free" or key in names):
                names.setdefault(key, len(names))
                out.append((op, names[key], nbytes))
            else:
                out.append((op, key if op not in _KEYED_OPS else "?", nbytes))
        made = [(names[k], v) for k, v in rec.made.items() if k in names]
        kinds = [{names[k] for k in uids if k in names} for uids in rec.uids]
        return out, sorted(made), kinds

    return canonical(a) == canonical(b)
