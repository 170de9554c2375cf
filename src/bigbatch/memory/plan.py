"""Choose micro-batch x accumulation for a target batch under a memory budget, by prediction.

The largest micro-batch whose predicted peak stays under the usable budget (the budget less a
safety margin and the process/device overhead) is found with a few predictions, no OOM. The
target need not divide evenly: exact normalisation makes an uneven last micro-batch harmless, so
the plan balances the micro-batches (256 with at most 100 fitting -> 3 x 86, not 100+100+56).
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from bigbatch.device import device_kind, free_bytes, process_rss, trim_cpu_heap
from bigbatch.memory.budget import format_bytes, parse_bytes
from bigbatch.memory.calibrate import calibrate_within
from bigbatch.memory.cards import card_hint, find_card
from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES, measured_context_bytes
from bigbatch.memory.predict import (
    MemoryPrediction,
    OptimizerTrace,
    StepLog,
    interpolate_log,
    live_peak,
    predict_peak,
    replay_with_calibration,
    trace_step,
)
from bigbatch.memory.step import StepSpec

__all__ = [
    "DoesNotFitError",
    "Plan",
    "largest_fitting",
    "limit_on_card",
    "overhead_bytes",
    "plan_micro_batch",
    "plan_under_budget",
    "refit_micro_batch",
    "refit_to_measured",
    "resolve_budget",
    "usable_bytes",
]

DEFAULT_MARGIN = 0.10
# The prediction counts tensors; glibc's default heap keeps freed blocks that small objects then
# fragment, so over a run the process grows past the tensors alive by 0.3-1.5x the step's working
# set (activations, temporaries): measured over 40 steps at 1 and 2 threads on a small GPT and
# resnet10t (benchmarks/cpu_heap.py). A plan without that room has training return freed memory.
CPU_HEAP_GROWTH = 1.5


class DoesNotFitError(ValueError):
    """Even micro-batch 1 does not fit the budget; the message has the floor's breakdown."""

    def __init__(self, message: str, floor: MemoryPrediction) -> None:
        super().__init__(message)
        self.floor = floor


@dataclass
class Plan:
    """The chosen micro-batch and accumulation, with the prediction behind them
    (:func:`plan_micro_batch`, :func:`plan_under_budget`).

    >>> import torch
    >>> spec = lambda b: StepSpec(lambda: torch.nn.Linear(256, 10), (256,), b)
    >>> plan = plan_micro_batch(spec, 256, "1GB", overhead=0)
    >>> plan.micro_batch * plan.micro_batches, plan.predicted_peak_bytes <= plan.usable_bytes
    (256, True)
    """

    micro_batch: int  # samples in one micro-batch (its size)
    micro_batches: int  # micro-batches per optimizer step (Accumulator(micro_batches=...))
    target_batch: int
    predicted_peak_bytes: int
    budget_bytes: int
    usable_bytes: int  # budget less margin and overhead: what the step's tensors may use
    overhead_bytes: int
    floor_bytes: int  # predicted peak at micro-batch 1
    max_micro_batch: int  # the largest micro-batch that fits (before balancing)
    prediction: MemoryPrediction
    arch: str = ""
    size: int | None = None
    confirmed_peak_bytes: int | None = None
    curve: list[tuple[int, int]] = field(default_factory=list)  # (micro-batch, predicted peak)
    predictions: int = 0  # predictions the search made (the floor's included)
    # CPU workspace calibration behind the predictions (plan_under_budget), for predicting
    # other micro-batches the same way, and what it could not measure.
    calibration: Any = field(default=None, repr=False)
    calibration_note: str = ""
    # With --fastest: measured training samples/s of each fitting candidate micro-batch.
    samples_per_s: dict[int, float] = field(default_factory=dict)

    @property
    def last_micro_batch(self) -> int:
        """The size of an optimizer step's last micro-batch: smaller than :attr:`micro_batch`
        where that does not divide the target (20 at micro-batch 7: 7, 7 and 6).

        >>> import torch
        >>> spec = lambda b: StepSpec(lambda: torch.nn.Linear(4, 2), (4,), b)
        >>> plan = plan_micro_batch(spec, 20, "1GB", overhead=0)
        >>> replace(plan, micro_batch=7, micro_batches=3).last_micro_batch
        6
        """
        return self.target_batch - self.micro_batch * (self.micro_batches - 1)

    @property
    def heap_growth_bytes(self) -> int:
        """CPU: how far glibc's default heap may take the process past the predicted peak
        (:data:`CPU_HEAP_GROWTH` x the step's working set); 0 on a GPU."""
        p = self.prediction
        if p.device != "cpu":
            return 0
        return int(CPU_HEAP_GROWTH * (p.activations + p.temporaries + p.workspace_bytes))

    @property
    def return_freed_memory(self) -> bool:
        """CPU: the plan holds only if training gives freed memory back to the system
        (:func:`bigbatch.device.return_freed_cpu_memory`, which ``bigbatch train`` calls then):
        the budget has no room for glibc's heap to grow by :attr:`heap_growth_bytes`. Never
        with an overhead of 0: that budget is for the step's tensors alone, not a process."""
        growth = self.heap_growth_bytes
        if growth == 0 or self.overhead_bytes == 0:
            return False
        return self.predicted_peak_bytes + growth > self.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "size": self.size,
            "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches,
            "target_batch": self.target_batch,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "overhead_bytes": self.overhead_bytes,
            # What the plan keeps free for the prediction's own error (the allocator's rounding
            # and fragmentation are in the prediction: breakdown's allocator_cache on CUDA).
            "margin_bytes": self.budget_bytes - self.usable_bytes - self.overhead_bytes,
            "floor_bytes": self.floor_bytes,
            "max_micro_batch": self.max_micro_batch,
            "confirmed_peak_bytes": self.confirmed_peak_bytes,
            # On CUDA the plan fits this: the allocator's reserved peak and the BLAS workspaces.
            "predicted_allocated_peak_bytes": self.prediction.peak_bytes,
            "predicted_reserved_bytes": self.prediction.reserved_bytes or None,
            "breakdown": {
                **self.prediction.parts(),
                **({"cuda_context": self.overhead_bytes} if self.prediction.reserved_bytes else {}),
            },
            "curve": self.curve,
            "predictions": self.predictions,
            "notes": self.prediction.notes,
            "cudnn_workspaces": self.prediction.cudnn_workspaces or None,
            "samples_per_s": {str(b): v for b, v in self.samples_per_s.items()} or None,
            "heap_growth_bytes": self.heap_growth_bytes,
            "return_freed_memory": self.return_freed_memory,
        }

    def summary(self) -> str:
        last = self.last_micro_batch
        # Said in words: "2 x 64" read as micro-batch x accumulation by some, the other way
        # by others.
        split = f"{self.micro_batches} micro-batch(es) of {self.micro_batch}" + (
            f" (the last {last})" if last != self.micro_batch else ""
        )
        return (
            f"target batch {self.target_batch} = {split}; predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.usable_bytes)} usable "
            f"(budget {format_bytes(self.budget_bytes)}); {self.prediction.breakdown()}"
            + "".join(f"; note: {n}" for n in self.prediction.notes)
            + (f"; {RETURN_FREED_NOTE}" if self.return_freed_memory else "")
        )


RETURN_FREED_NOTE = (
    "train with freed memory given back to the system (bigbatch.device.return_freed_cpu_memory(), "
    "as bigbatch train does; about a third slower a CPU step): the budget leaves no room for "
    "glibc's heap to grow past the prediction"
)


def overhead_bytes(device: str | torch.device) -> int:
    """Memory a training process needs besides the step's tensors: on a GPU the CUDA context
    with the cuBLAS and cuDNN handles, measured where the GPU is here, else the documented
    H100 / CUDA 13 figure (:mod:`bigbatch.memory.cuda_runtime`); on CPU the process itself
    (interpreter, torch and its libraries, ~300-800 MiB), read after what training loads
    anyway has been loaded (:func:`_load_training_libraries`) and with the free memory glibc's
    heap holds given back (training would reuse it, not add to it)."""
    if device_kind(device).dedicated_memory:
        if torch.cuda.is_available():
            return measured_context_bytes(device)
        return CUDA_CONTEXT_BYTES
    _load_training_libraries()
    gc.collect()
    trim_cpu_heap()
    return process_rss()


@functools.cache
def _load_training_libraries() -> None:
    """The first optimizer step imports torch._dynamo and sympy (about 150 MiB here): a
    training process holds them, so the overhead read before them was too small by that much."""
    param = torch.zeros(1, requires_grad=True)
    param.grad = torch.zeros(1)
    torch.optim.AdamW([param]).step()


def resolve_budget(budget: str | int, device: str | torch.device) -> int:
    """``"8GB"``, ``"16GiB"``, bytes, ``"auto"`` (the device's free memory now), or a card's
    name (``"t4"``: what its driver reports; :mod:`bigbatch.memory.cards`)."""
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        # The free memory already excludes what this process holds.
        shared = not device_kind(device).dedicated_memory
        return free_bytes(device) + (process_rss() if shared else 0)
    card = find_card(budget) if isinstance(budget, str) else None
    if card is not None:
        if not device_kind(device).dedicated_memory:
            raise ValueError(
                f"budget {budget!r} is a GPU ({card.name}): plan for it with --device cuda "
                "(device=cuda), from any machine"
            )
        return card.total_bytes
    if isinstance(budget, str) and (unknown := card_hint(budget)):
        raise ValueError(unknown)
    return parse_bytes(budget)


def default_overhead(budget: str | int, device: str | torch.device) -> int:
    """The overhead a plan keeps out of ``budget`` when none is given: the card's CUDA context
    where ``budget`` names a card, else :func:`overhead_bytes` of ``device``."""
    card = find_card(budget) if isinstance(budget, str) else None
    if card is not None and device_kind(device).dedicated_memory:
        return card.context_bytes
    return overhead_bytes(device)


def limit_on_card(usable: int, budget: int, overhead: int, card: tuple[int, int] | None) -> int:
    """What a step may take, measured: a plan's ``usable`` (its ``budget`` less the margin and
    the ``overhead`` it kept out), or less where the card has less left, which is its total less
    the same margin and everything outside this process's allocator now (``card``: ``(total,
    outside)``, :func:`bigbatch.device.card_memory`). NCCL's communicators are the usual
    difference: they take device memory beside PyTorch's allocator, which no plan sees.

    >>> GiB = 2**30  # a 24 GiB card, a plan keeping 10 % and 0.5 GiB of context out
    >>> usable = int(24 * GiB * 0.9) - GiB // 2
    >>> [round(limit_on_card(usable, 24 * GiB, GiB // 2, card) / GiB, 2)
    ...  for card in (None, (24 * GiB, GiB // 2), (24 * GiB, 2 * GiB))]  # the last: NCCL's
    [21.1, 21.1, 19.6]
    """
    if card is None or budget <= 0:
        return usable
    total, outside = card
    margin = max(0, budget - usable - overhead) / budget
    return min(usable, int(total * (1 - margin)) - outside)


def usable_bytes(
    budget_bytes: int, overhead: int, device: str | torch.device, margin: float = DEFAULT_MARGIN
) -> int:
    """What a step's tensors may use: the budget less the margin and the overhead."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    usable = int(budget_bytes * (1 - margin)) - overhead
    if usable <= 0:
        raise ValueError(
            f"the budget {format_bytes(budget_bytes)} leaves nothing for training after the "
            f"{margin:.0%} margin and {format_bytes(overhead)} of overhead "
            f"({'CUDA context' if torch.device(device).type == 'cuda' else 'this process: Python, torch, libraries'}); "
            "raise the budget, or set the overhead you expect (--overhead / overhead=)"
        )
    return usable


def _suggestions(spec: StepSpec) -> str:
    tips = []
    if spec.precision == "fp32":
        tips.append("precision bf16 (halves activations)")
    if spec.optimizer.lower() in ("adamw", "adamw_fused", "adam"):
        # bigbatch train and bigbatch plan both take it (train's sgd has momentum: one copy).
        tips.append(
            "SGD (optimizer=sgd in bigbatch train, --optimizer sgd in bigbatch plan: one state "
            "copy of the weights or none, instead of Adam's two)"
        )
    if len(spec.input_shape) >= 4:  # channels + 3 spatial dims: a volume
        tips.append(
            "activation checkpointing (bigbatch train: grad_checkpointing=true), or smaller "
            "patches (train on crops of the volume, e.g. "
            "--input-shape with half the side: an eighth of the activations)"
        )
    else:
        tips.append(
            "activation checkpointing (bigbatch train: grad_checkpointing=true), or a smaller "
            "input size"
        )
    return "try " + ", ".join(tips)


def plan_micro_batch(
    spec_at: Callable[[int], StepSpec],
    target_batch: int,
    budget: str | int,
    *,
    device: str = "cpu",
    margin: float = DEFAULT_MARGIN,
    overhead: int | None = None,
    calibration: Any = None,
    max_micro_batch: int | None = None,
    extra_bytes: int = 0,
    optimizer_trace: OptimizerTrace | None = None,
    known: dict[int, MemoryPrediction] | None = None,
) -> Plan:
    """Choose the largest micro-batch that fits ``budget`` and the accumulation for ``target_batch``.

    ``spec_at(b)`` returns the :class:`StepSpec` at micro-batch ``b``; ``extra_bytes`` is memory
    held besides each step for the whole window (a gradient cache for a loss that couples the
    samples, :func:`bigbatch.coupled.cache_bytes`; DDP's gradient buckets,
    :func:`bigbatch.distributed.ddp_bucket_bytes`); ``optimizer_trace``, this model's traced
    optimizer steps (:class:`~bigbatch.memory.predict.OptimizerTrace`); ``known``, predictions
    already made with ``calibration``, by micro-batch (:func:`plan_under_budget`'s floor). Raises
    :class:`DoesNotFitError` (the floor's breakdown, what to try) if micro-batch 1 does not fit.

    >>> import torch
    >>> spec = lambda b: StepSpec(lambda: torch.nn.Linear(256, 10), (256,), b)
    >>> p = plan_micro_batch(spec, 64, "1GB", overhead=0)
    >>> (p.micro_batch, p.micro_batches)
    (64, 1)
    """
    if isinstance(target_batch, bool) or not isinstance(target_batch, int) or target_batch < 1:
        raise ValueError(
            f"the target batch must be a positive number of samples, got {target_batch!r}"
        )
    spec_at = _held_line(spec_at, target_batch)
    budget_bytes = resolve_budget(budget, device)
    overhead = default_overhead(budget, device) if overhead is None else overhead
    usable = usable_bytes(budget_bytes, overhead, device, margin) - extra_bytes
    if usable <= 0:
        raise DoesNotFitError(
            f"the {format_bytes(extra_bytes)} held across the window (extra_bytes: a coupled "
            f"loss's gradient cache, DDP's gradient buckets) leave nothing of budget "
            f"{format_bytes(budget_bytes)} for the step; raise the budget, or shrink what is "
            "held (a smaller target batch or representation, fewer trainable weights)",
            predict_peak(spec_at(1), calibration=calibration),
        )
    predictions = _Predictions(spec_at, calibration, optimizer_trace or OptimizerTrace(), known)
    cache, peak = predictions.cache, predictions.peak
    smallest, floor = _floor(peak)
    if floor > usable:
        where = (
            f"budget {format_bytes(budget_bytes)} less {margin:.0%} margin and "
            f"{format_bytes(overhead)} overhead"
            + (f" and {format_bytes(extra_bytes)} held across the window" if extra_bytes else "")
        )
        raise _does_not_fit(smallest, cache[smallest], usable, where, spec_at(1))
    cap = min(target_batch, max_micro_batch or target_batch)
    if cap < smallest:
        raise ValueError(
            f"the target batch {target_batch} is below the smallest micro-batch {smallest}"
        )
    micro, chosen, curve = _chosen(predictions, smallest, floor, cap, target_batch, usable)
    return Plan(
        micro_batch=micro,
        micro_batches=math.ceil(target_batch / micro),
        target_batch=target_batch,
        predicted_peak_bytes=chosen.planning_bytes,
        budget_bytes=budget_bytes,
        usable_bytes=usable,
        overhead_bytes=overhead,
        floor_bytes=floor,
        max_micro_batch=max([b for b, n in curve.items() if n <= usable] or [smallest]),
        prediction=chosen,
        curve=sorted(curve.items()),
        predictions=len(cache)
        + len(predictions.alone_cache)
        + len(predictions.over)
        + len(predictions.whole_over),
    )


def _chosen(
    predictions: _Predictions, smallest: int, floor: int, cap: int, target: int, usable: int
) -> tuple[int, MemoryPrediction, dict[int, int]]:
    """The micro-batch, its prediction, and the planning bytes by micro-batch (the curve)."""
    peak = predictions.peak
    # The whole target in one micro-batch holds no gradients from earlier ones: tried first.
    whole = None
    if cap == target and not _whole_ruled_out(predictions, smallest, floor, target, usable):
        whole = predictions.whole(target, smallest, usable)
    if whole is not None and whole.planning_bytes <= usable:
        micro = target
    else:
        micro = _choose(predictions, smallest, floor, cap, target, usable)
        if not predictions.confirm(micro):  # a size between traces was not on their line
            micro = _choose(predictions, smallest, floor, cap, target, usable)
    if micro == target:
        chosen = predictions.alone(target)
    else:
        peak(micro)  # predicted already, unless balanced past the search's sizes
        chosen = predictions.cache[micro]
    curve = {b: p.planning_bytes for b, p in predictions.cache.items() if b < target}
    if whole is not None:
        curve[target] = whole.planning_bytes
    return micro, chosen, curve


def _whole_ruled_out(
    predictions: _Predictions, smallest: int, floor: int, target: int, usable: int
) -> bool:
    """Where the weights take most of the budget (the floor above half of it: a 7-8B language
    model on a 24 GB card), the held line's next size is predicted first, as the affine plan
    needs it then anyway: bounded from below where that rules it out (:meth:`_Predictions.beyond`),
    else traced. The target alone holds no gradients from earlier micro-batches but
    every other tensor of that smaller step: where that step, less the gradients at its peak
    twice over (the held copy and their accumulation's; none where a CUDA window's peak is in
    its first micro-batch, a lone step itself), does not fit, neither does the target alone,
    and its trace is not made (the largest step's: 25 s for an 8B model on 2 cores)."""
    after = smallest + 1
    if floor <= usable / 2 or target <= after:
        return False
    held = predictions.beyond(after, usable)
    if held is None:
        predictions.peak(after)
        held = predictions.cache[after]
    return held.planning_bytes - 2 * held.gradients > usable


def stop_tracing_above(usable: int, floor: MemoryPrediction) -> int:
    """Where :meth:`_Predictions.beyond` stops tracing a bound: once past what
    :func:`_whole_ruled_out` compares it with, the usable memory and the held gradients twice
    over (those of ``floor``, the size below: they do not grow with the micro-batch)."""
    return usable + 2 * floor.gradients


def _held_line(spec_at: Callable[[int], StepSpec], target_batch: int) -> Callable[[int], StepSpec]:
    """``spec_at`` as the later micro-batches of a window of ``target_batch`` run it: each
    holds the gradients summed from the earlier ones (``held_gradients``), one more copy of
    the trainable weights than a lone step (resnet10t at 64 px, micro-batch 16: 104 MiB
    measured for one, 122 MiB from the second on). Every size on the line is such a step, the
    target's too (where it does not fit alone, its held step ends the line the search
    interpolates on); the target alone is :meth:`_Predictions.alone`."""
    return lambda b: replace(spec_at(b), held_gradients=target_batch > 1)


class _Predictions:
    """A plan's predictions by micro-batch, each made once: traced (and the trace's log kept,
    replayed with the calibration), or, between two logged traces whose events are the same,
    replayed from the log on their line (:func:`~bigbatch.memory.predict.interpolate_log`):
    milliseconds where a trace takes seconds. The size the plan chooses is confirmed with a
    trace (:meth:`confirm`)."""

    def __init__(
        self,
        spec_at: Callable[[int], StepSpec],
        calibration: Any,
        trace: OptimizerTrace,
        known: dict[int, MemoryPrediction] | None,
    ) -> None:
        self.spec_at, self.calibration, self.trace = spec_at, calibration, trace
        self.cache: dict[int, MemoryPrediction] = dict(known or {})
        self.alone_cache: dict[int, MemoryPrediction] = {}  # one micro-batch a window
        self.logs: dict[int, StepLog] = {}
        self.interpolated: set[int] | None = set()  # None: not any more (a confirmation failed)
        self.over: dict[int, MemoryPrediction] = {}  # sizes a lower bound ruled out
        self.whole_over: dict[int, MemoryPrediction] = {}  # the same, of a window's only step

    def peak(self, b: int) -> int:
        """``b``'s planning bytes; where a lower bound ruled ``b`` out (:meth:`beyond`), that
        bound, which is only ever compared with the usable memory."""
        if b in self.over:
            return self.over[b].planning_bytes
        if b not in self.cache:
            self.cache[b] = self._on_the_line(b) or self._traced(b)
        return self.cache[b].planning_bytes

    def alone(self, b: int) -> MemoryPrediction:
        """The step at ``b`` as a window's only micro-batch: no gradients held before it."""
        spec = self.spec_at(b)
        if not spec.held_gradients:  # a target of one sample: the line's own step
            self.peak(b)
            return self.cache[b]
        if b not in self.alone_cache:
            self.alone_cache[b] = self._predicted(replace(spec, held_gradients=False))[0]
        return self.alone_cache[b]

    def whole(self, b: int, smallest: int, usable: int) -> MemoryPrediction | None:
        """``b`` as a window's only micro-batch (:meth:`alone`), or None where a lower bound
        shows it does not fit: on CUDA, where the line through two sizes already traced says
        its live tensors would not fit (:func:`_likely_live`, less the gradients they hold),
        they are traced first, until they pass ``usable``
        (:func:`~bigbatch.memory.predict.live_peak`, stopped: 16 sequences of a 70B model's
        QLoRA on an 80 GB card pass it in their forward, where the whole step's trace runs
        two forwards and backwards); traced whole otherwise, and where no line is traced yet
        (the floor alone: one size's growth is a guess, :func:`_likely_live`)."""
        if b in self.alone_cache:
            return self.alone_cache[b]
        likely = _likely_live(self.cache, b, line_only=True)
        if likely is None or likely - 2 * self.cache[smallest].gradients <= usable:
            return self.alone(b)  # likely to fit, or no line to say: traced
        bound = live_peak(replace(self.spec_at(b), held_gradients=False), stop_above=usable)
        if bound is None or bound.planning_bytes <= usable:
            return self.alone(b)
        self.whole_over[b] = bound
        return None

    def bounded(self, b: int, usable: int) -> int:
        """:meth:`peak`, where ``b`` is bounded from below first (:meth:`beyond`): a size
        only compared with ``usable`` (one step fewer than the plan's: micro-batch 3 of a 70B
        model's QLoRA on an 80 GB card, where 2 fits)."""
        self.beyond(b, usable)
        return self.peak(b)

    def beyond(self, b: int, usable: int) -> MemoryPrediction | None:
        """CUDA: ``b``'s :func:`~bigbatch.memory.predict.live_peak` (a third of a trace), where
        it is above ``usable``: the size does not fit and its trace is not made. Tried where
        the sizes predicted below ``b`` say its live tensors would not fit (:func:`_likely_live`:
        micro-batch 2 of a 7-8B model on a 24 GB card); None otherwise (trace it)."""
        if b in self.over:
            return self.over[b]
        if b in self.cache:
            return None
        likely = _likely_live(self.cache, b)
        if likely is None or likely <= usable:
            return None  # likely to fit: the bound would be a third of a trace more
        floor = self.cache[max(k for k in self.cache if k < b)]
        bound = live_peak(self.spec_at(b), stop_above=stop_tracing_above(usable, floor))
        if bound is None or bound.planning_bytes <= usable:
            return None
        self.over[b] = bound
        return bound

    def _traced(self, b: int) -> MemoryPrediction:
        prediction, log = self._predicted(self.spec_at(b))
        if log is not None:
            self.logs[b] = log
        return prediction

    def _predicted(self, spec: StepSpec) -> tuple[MemoryPrediction, StepLog | None]:
        """``spec`` traced, and calibrated from the trace's log where it has one (measured,
        or for a GPU: never calibrated)."""
        prediction, log = trace_step(spec, optimizer_trace=self.trace)
        if log is None:
            return prediction, None
        return replay_with_calibration(log, self.calibration), log

    def _on_the_line(self, b: int) -> MemoryPrediction | None:
        below = [k for k in self.logs if k < b]
        above = [k for k in self.logs if k > b]
        if self.interpolated is None or not below or not above:
            return None
        log = interpolate_log(self.logs[max(below)], self.logs[min(above)], self.spec_at(b))
        if log is None:
            return None
        self.interpolated.add(b)
        return replay_with_calibration(log, self.calibration)

    def confirm(self, b: int) -> bool:
        """Trace ``b`` where its prediction came from the line; False (and every prediction
        from the line dropped, none made again) where the trace differs."""
        if not self.interpolated or b not in self.interpolated:
            return True
        on_line = self.cache[b]
        self.cache[b] = self._traced(b)
        if _same(self.cache[b], on_line):
            self.interpolated.discard(b)
            return True
        for k in self.interpolated - {b}:
            del self.cache[k]
        self.interpolated = None
        return False


def _likely_live(
    cache: dict[int, MemoryPrediction], b: int, *, line_only: bool = False
) -> int | None:
    """What ``b``'s lower bound (:func:`~bigbatch.memory.predict.live_peak`: the live tensors,
    and the handles outside the allocator) is likely to be, from the sizes predicted below it:
    on the line through the live tensors of the two largest. Not their reserved memory: a 70B
    model's QLoRA at micro-batch 3 on an 80 GB card reserves 76.6 GiB of 71.3 usable, and its
    live tensors take 69.8, which rule nothing out. With one size, whose slope is unknown, its
    step with its activations once more per micro-batch: the 8B model's second on a 24 GB
    card (its live tensors alone with their activations grown miss the logits, which grow too;
    with the temporaries grown, a CNN's kernel workspaces, which do not). None below the
    first (below the second with ``line_only``). A bound is worth tracing only where this
    does not fit."""
    below = sorted(k for k in cache if k < b)
    if len(below) < (2 if line_only else 1):
        return None
    k, p = below[-1], cache[below[-1]]
    if len(below) == 1:
        return p.planning_bytes + p.activations * (b - k) // k
    j, q = below[-2], cache[below[-2]]
    live, before = p.peak_bytes + p.cuda_handle_bytes, q.peak_bytes + q.cuda_handle_bytes
    return live + (live - before) * (b - k) // (k - j)


def _same(a: MemoryPrediction, b: MemoryPrediction) -> bool:
    return replace(a, seconds=0.0) == replace(b, seconds=0.0)


def _choose(
    predictions: _Predictions, smallest: int, floor: int, cap: int, target: int, usable: int
) -> int:
    """The largest balanced micro-batch the predictions accept (the line, a search where the
    line is off, then fewer steps where they fit). Only the last compares sizes with the
    budget alone, so only there may a size be a lower bound (:meth:`_Predictions.beyond`):
    the line and the search interpolate between the peaks they are given."""
    peak = predictions.peak
    micro = _affine_plan(peak, smallest, floor, cap, target, usable)
    if micro is None:  # not affine enough: search below the size that did not fit
        micro = _search(peak, smallest, cap, target, usable)
    return _fewer_steps(lambda b: predictions.bounded(b, usable), micro, cap, target, usable)


def _does_not_fit(
    smallest: int, floor: MemoryPrediction, usable: int, where: str, spec: StepSpec
) -> DoesNotFitError:
    return DoesNotFitError(
        f"even micro-batch {smallest} does not fit: it needs "
        f"{format_bytes(floor.planning_bytes)} ({floor.breakdown()}) but {format_bytes(usable)} "
        f"is usable ({where}); {_suggestions(spec)}",
        floor,
    )


def _floor(peak: Callable[[int], int]) -> tuple[int, int]:
    """(the smallest micro-batch, its peak): 1, or 2 where BatchNorm cannot train on one sample
    (it normalises a 1x1 feature map)."""
    try:
        return 1, peak(1)
    except ValueError as exc:
        if not batchnorm_on_one_sample(exc):
            raise
        return 2, peak(2)


def batchnorm_on_one_sample(exc: BaseException) -> bool:
    """Whether ``exc`` is BatchNorm refusing a micro-batch of one (a 1x1 feature map)."""
    return "more than 1 value per channel" in str(exc)


def _balanced(target: int, largest: int) -> int:
    """The micro-batch of the fewest steps of at most ``largest``, split evenly (256 with at
    most 100 fitting: 3 x 86): the same number of steps, a lower peak."""
    return math.ceil(target / math.ceil(target / largest))


def _affine_plan(
    peak: Callable[[int], int], smallest: int, floor: int, cap: int, target: int, usable: int
) -> int | None:
    """Peak memory is close to affine in the micro-batch: the whole target at once if it fits
    (the second prediction), else where the line through the floor and the target meets the
    budget, balanced and confirmed (the third); where the floor takes more than half of the
    budget, the line through the floor and the next size. None when the confirmation does not
    fit."""
    if cap > smallest and floor > usable / 2:
        # A large model's weights take most of the memory (a 7-8B language model on a 24 GB
        # card): micro-batches are small, and the line through the floor and the next size says
        # where the budget is reached without tracing the whole target, the largest step.
        after = smallest + 1
        if peak(after) > usable:
            return smallest
        if _line_at(smallest, floor, after, peak(after), cap) > usable:
            guess = min(
                max(_interpolate(smallest, floor, after, peak(after), usable), after), cap - 1
            )
            micro = max(_balanced(target, guess), smallest)
            return micro if peak(micro) <= usable else None
    if cap == smallest or peak(cap) <= usable:
        return cap if cap in (target, smallest) else _balanced(target, cap)
    guess = min(max(_interpolate(smallest, floor, cap, peak(cap), usable), smallest), cap - 1)
    micro = max(_balanced(target, guess), smallest)
    return micro if peak(micro) <= usable else None


def _fewer_steps(peak: Callable[[int], int], micro: int, cap: int, target: int, usable: int) -> int:
    """The largest balanced micro-batch the predictions accept: from ``micro``, one step fewer
    while the balanced size of that many steps fits (the line through the floor and the cap
    can stop short where the peak grows slower than affine: resnet18 at 64 px, 26 where 32
    fits).

    >>> _fewer_steps(lambda b: 100 + b * b // 10, 26, 128, 128, 210)  # 32 -> 202 fits
    32
    """
    steps = math.ceil(target / micro)
    while steps > 1:
        bigger = math.ceil(target / (steps - 1))
        if bigger > cap or peak(bigger) > usable:
            break
        micro, steps = bigger, steps - 1
    return micro


def _search(peak: Callable[[int], int], smallest: int, cap: int, target: int, usable: int) -> int:
    """The largest micro-batch that fits (:func:`largest_fitting`, past the cap unknown),
    balanced."""
    return _balanced(target, largest_fitting(peak, smallest, cap + 1, usable, cap=cap))


def largest_fitting(
    peak: Callable[[int], int], lo: int, hi: int, usable: int, *, cap: int | None = None
) -> int:
    """The largest size in ``[lo, hi)`` whose ``peak`` fits ``usable``, given that ``lo`` fits
    and ``hi`` does not (or, past ``cap``, is not known): by interpolation guarded by bisection,
    where the peak is not affine (allocator segments, kernel choices). ``peak`` is called
    repeatedly at the same sizes: cache it.

    >>> largest_fitting(lambda b: 100 + 10 * b, 1, 64, 500)
    40
    """
    cap = hi if cap is None else cap
    bisect = False
    while hi - lo > 1:
        guess = (
            (lo + hi) // 2
            if bisect or hi > cap
            else _interpolate(lo, peak(lo), hi, peak(hi), usable)
        )
        guess = min(max(guess, lo + 1), hi - 1)
        width = hi - lo
        if peak(guess) <= usable:
            lo = guess
        else:
            hi = guess
        bisect = (hi - lo) * 2 > width
    return lo


def _line_at(a: int, peak_a: int, b: int, peak_b: int, at: int) -> float:
    """The line through (a, peak_a) and (b, peak_b), at ``at``."""
    return peak_a + (peak_b - peak_a) * (at - a) / (b - a)


def _interpolate(a: int, peak_a: int, b: int, peak_b: int, usable: int) -> int:
    """Where the line through (a, peak_a) and (b, peak_b) reaches ``usable``."""
    if peak_b <= peak_a:
        return b
    return int(a + (usable - peak_a) * (b - a) / (peak_b - peak_a))


# A measured peak this far under its prediction (or further) lets the run grow its micro-batch.
GROW_BELOW = 0.8


def refit_micro_batch(
    curve: list[tuple[int, int]],
    micro_batch: int,
    measured: int,
    limit: int,
    *,
    target: int,
    top: int,
    smallest: int = 1,
    grow: bool = True,
) -> int:
    """The micro-batch a measured peak says fits, after the run's first optimizer steps: the
    plan's predictions (``curve``: (micro-batch, predicted bytes), read as a line between and
    beyond its points) scaled by what the step at ``micro_batch`` really took (``measured``).
    Over ``limit``: the largest smaller micro-batch under it, balanced over ``target``. Far
    under the prediction (below :data:`GROW_BELOW` of it, with ``grow``): the largest up to
    ``top`` (at most twice ``micro_batch``: the OOM back-off guards the rest) under it. Else
    ``micro_batch``. The update is the same at any micro-batch: only memory and speed change.

    >>> curve = [(1, 1100), (64, 8000)]  # the plan's: about 1000 + 110 per sample
    >>> refit_micro_batch(curve, 64, 9600, 8000, target=256, top=256)  # 20 % over: 51 fit
    43
    >>> refit_micro_batch(curve, 64, 4000, 8000, target=256, top=256)  # half: grow, at most x2
    128
    """
    points = sorted(dict(curve).items())
    predicted = _on_curve(points, micro_batch)
    if not points or predicted <= 0 or measured <= 0:
        return micro_batch
    scale = measured / predicted

    def fits(b: int) -> bool:
        return scale * _on_curve(points, b) <= limit

    if measured > limit:
        fitting = [b for b in range(smallest, micro_batch) if fits(b)]
        return _balanced(target, max(fitting)) if fitting else smallest
    if grow and scale < GROW_BELOW:
        fitting = [b for b in range(micro_batch + 1, min(top, 2 * micro_batch) + 1) if fits(b)]
        if fitting:
            return max(micro_batch, _balanced(target, max(fitting)))
    return micro_batch


def refit_to_measured(
    plan: Plan,
    micro_batch: int,
    measured: int,
    card: tuple[int, int] | None = None,
    *,
    target: int,
    top: int | None = None,
) -> int:
    """:func:`refit_micro_batch` for a ``plan`` made on the CPU for a card, once the step at
    ``micro_batch`` measured ``measured`` bytes (the allocator's reserved peak) there: the
    limit is the plan's usable memory, or less where the ``card`` (``(total, outside the
    allocator)``, :func:`bigbatch.device.card_memory`) has less left (:func:`limit_on_card`).
    ``top`` (default ``target``) bounds a grow.

    >>> import torch
    >>> spec = lambda b: StepSpec(lambda: torch.nn.Linear(256, 10), (256,), b)
    >>> plan = plan_micro_batch(spec, 64, "1GB", overhead=0)
    >>> refit_to_measured(plan, 16, 10 * plan.usable_bytes, target=64)  # 10x over: the floor
    1
    """
    limit = limit_on_card(plan.usable_bytes, plan.budget_bytes, plan.overhead_bytes, card)
    return refit_micro_batch(
        list(plan.curve), micro_batch, measured, limit, target=target, top=top or target
    )


def _on_curve(points: list[tuple[int, int]], b: int) -> float:
    """The predicted peak at ``b`` on the line through the plan's predictions (extended past
    the first and last by their end segments; flat from a single point)."""
    if not points:
        return 0.0
    if len(points) == 1:
        return float(points[0][1])
    for (b0, p0), (b1, p1) in itertools.pairwise(points):
        if b <= b1 or (b1, p1) == points[-1]:
            return p0 + (p1 - p0) * (b - b0) / (b1 - b0)
    return float(points[-1][1])


def plan_under_budget(
    spec_at: Callable[[int], StepSpec],
    target_batch: int,
    budget: str | int,
    *,
    device: str = "cpu",
    overhead: int | None = None,
    margin: float = DEFAULT_MARGIN,
    calibrate: bool = True,
    max_micro_batch: int | None = None,
    extra_bytes: int = 0,
) -> Plan:
    """The planning path every caller takes (``bigbatch plan``, ``bigbatch train``, the
    ensemble, fastai's ``plan_learner``): the budget, CPU workspace calibration at the
    micro-batch sizes whose real step fits it, the process overhead (unless given: read after
    calibration, see below), then :func:`plan_micro_batch`. What calibration could not measure
    is in ``plan.calibration_note`` (and in a :class:`DoesNotFitError`'s message).

    Calibration's real steps leave what a training process has too: kernels oneDNN compiled,
    library code paged in, the profiler's buffers (resnet10t and convnext_atto 33-35 MiB, a
    small GPT 16 MiB here, after their freed tensors went back). Read before calibration, the
    overhead missed that much, and training in the same process went past the plan by it.

    >>> import torch
    >>> spec = lambda b: StepSpec(lambda: torch.nn.Linear(256, 10), (256,), b)
    >>> plan_under_budget(spec, 64, "1GB", overhead=0).micro_batch
    64
    """
    spec_at = _held_line(spec_at, target_batch)
    budget_bytes = resolve_budget(budget, device)
    given = overhead
    overhead = default_overhead(budget, device) if overhead is None else overhead
    calibration, note = None, ""
    trace = OptimizerTrace()  # shared by every prediction of this plan
    known: dict[int, MemoryPrediction] = {}
    if calibrate and torch.device(device).type == "cpu":
        usable = usable_bytes(budget_bytes, overhead, device, margin)
        floor = _floor_log(spec_at, trace)
        calibration, note = calibrate_within(spec_at(2), usable, optimizer_trace=trace, floor=floor)
        if floor is not None:
            known[floor.spec.batch_size] = replay_with_calibration(floor, calibration)
        del floor  # its log (a few MiB for a large model) is not the training process's
        if given is None:
            overhead = overhead_bytes(device)
    try:
        plan = plan_micro_batch(
            spec_at,
            target_batch,
            budget_bytes,
            device=device,
            margin=margin,
            overhead=overhead,
            calibration=calibration,
            max_micro_batch=max_micro_batch,
            extra_bytes=extra_bytes,
            optimizer_trace=trace,
            known=known,
        )
    except DoesNotFitError as exc:
        if not note:
            raise
        raise DoesNotFitError(f"{exc}; {note}", exc.floor) from exc
    plan.calibration, plan.calibration_note = calibration, note
    return plan


def _floor_log(spec_at: Callable[[int], StepSpec], trace: OptimizerTrace) -> StepLog | None:
    """The step at the smallest micro-batch (1, or 2 for BatchNorm), traced once without a
    calibration: it bounds what the calibration's steps need (so the step at 4 is not traced
    for that) and, replayed, is the plan's calibrated floor. None where the step is measured
    or cannot run even at 2 (the planner then says why)."""
    for b in (1, 2):
        try:
            return trace_step(spec_at(b), optimizer_trace=trace)[1]
        except ValueError as exc:
            if b == 2 or not batchnorm_on_one_sample(exc):
                return None
    return None


def fastest(
    plan: Plan, spec_at: Callable[[int], StepSpec], *, candidates: int = 4, steps: int = 3
) -> Plan:
    """Time the plan's micro-batch and up to ``candidates - 1`` smaller ones that also fit (the
    balanced sizes of 2x, 4x ... its steps), a few real steps each on the device, and choose the
    fastest: the largest micro-batch is not always (kernels that suit another size; caches).
    ``plan.samples_per_s`` keeps every candidate's measured throughput. Costs ``warmup +
    steps`` real training steps per candidate.
    """
    from bigbatch.memory.measure import samples_per_second

    sizes: list[int] = []
    step_count = plan.micro_batches
    while len(sizes) < candidates:
        micro = _balanced(plan.target_batch, max(1, math.ceil(plan.target_batch / step_count)))
        if micro not in sizes:
            sizes.append(micro)
        if micro == 1:
            break
        step_count *= 2
    plan.samples_per_s = {b: samples_per_second(spec_at(b), steps=steps) for b in sizes}
    best = max(plan.samples_per_s, key=lambda b: plan.samples_per_s[b])
    if best != plan.micro_batch:
        plan.micro_batch, plan.micro_batches = best, math.ceil(plan.target_batch / best)
        spec = spec_at(best).in_window(plan.target_batch)
        plan.prediction = predict_peak(spec, calibration=plan.calibration)
        plan.predicted_peak_bytes = plan.prediction.planning_bytes
    return plan
