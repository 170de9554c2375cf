"""The evaluation step's memory, and its batch under the training run's budget.

Validation and prediction run the model without gradients, so a batch several times the
training micro-batch often fits; but they also meet shapes training does not (whole images
after training on crops, a whole volume's logits beside its sliding-window patches), where one
sample can need more than training's micro-batch. Both are predicted here as training is: on
fake tensors, with the training process's state alive (the weights, the optimizer state, an
EMA copy), and on CUDA through the caching allocator's model.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bigbatch.memory.budget import format_bytes
from bigbatch.memory.fake_branches import real_branches
from bigbatch.memory.fsdp import storage_resizes
from bigbatch.memory.meta import build_on_meta, to_empty_shared
from bigbatch.memory.plan import largest_fitting
from bigbatch.memory.predict import (
    MemoryPrediction,
    _assemble,
    _follow_layers,
    _stacked,
    _start_journal,
    tracing_for,
)
from bigbatch.memory.stack import Recorded
from bigbatch.memory.step import StepSpec, make_inputs, run_step_loss

__all__ = ["STATE_COPIES", "EvaluationPlan", "plan_evaluation_batch", "predict_evaluation_peak"]

# Tensors the size of the weights an optimizer keeps between steps, alive while evaluating.
STATE_COPIES = {
    "adamw": 2,
    "adamw_fused": 2,
    "adam": 2,
    "sgd": 0,
    "sgd_momentum": 1,
    "rmsprop": 1,
    "adagrad": 1,
}


def predict_evaluation_peak(
    spec: StepSpec, *, state_copies: int | None = None, held_bytes: int = 0
) -> MemoryPrediction:
    """The peak of one no-grad forward pass (and loss) of ``spec`` in eval mode, with what a
    training process holds meanwhile: the weights, ``state_copies`` weight-sized tensors (the
    optimizer's state, by default :data:`STATE_COPIES` of ``spec.optimizer``; add one for an
    EMA copy) and ``held_bytes`` besides (a whole volume's input and logits beside its
    sliding-window patches). Gradients are gone: training frees them at each optimizer step.

    >>> spec = StepSpec(lambda: torch.nn.Linear(1024, 1024), (1024,), 64, optimizer="sgd")
    >>> p = predict_evaluation_peak(spec)
    >>> p.parameters, p.gradients, p.optimizer_state
    (4198400, 0, 0)
    """
    copies = STATE_COPIES.get(spec.optimizer, 2) if state_copies is None else state_copies
    trace = functools.partial(_evaluation_trace, copies=copies, held_bytes=held_bytes)
    return _stacked(spec, trace) or trace(spec)


def _evaluation_trace(
    spec: StepSpec, record: list[Recorded] | None = None, *, copies: int, held_bytes: int
) -> MemoryPrediction:
    """:func:`predict_evaluation_peak`'s trace at the model's own depth (``record``: its
    events with their layers, for bigbatch.memory.stack)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    target = torch.device(spec.device)
    model = build_on_meta(spec.model)
    device, tracker, rules = tracing_for(target, cudnn_benchmark=spec.cudnn_benchmark)
    _start_journal(tracker, record)
    param_uids: set[int] = set()
    state_uids: set[int] = set()
    resizes = storage_resizes(tracker.resized)  # FSDP2 frees each layer's gathered weights
    with rules, FakeTensorMode(allow_non_fake_inputs=True), tracker, real_branches(), resizes:
        model = to_empty_shared(model, device).eval()
        for t in [*model.parameters(), *model.buffers()]:
            tracker.track(t)
            param_uids.add(tracker.uid_of(t))  # type: ignore[arg-type]
        _follow_layers(tracker, spec, model)
        state = [torch.empty_like(p) for p in model.parameters() for _ in range(copies)]
        state += [torch.empty(held_bytes, dtype=torch.uint8, device=device)] if held_bytes else []
        state_uids = tracker.uids_of(state)
        x = make_inputs(spec, device)
        tracker.counting = True
        with torch.no_grad(), tracker.in_phase("forward"):
            loss = run_step_loss(spec, model, x, device.type)
        if record is not None and tracker.journal is not None and tracker.events is not None:
            kinds: tuple[set[int], set[int], set[int]] = (param_uids, set(), state_uids)
            record.append(tracker.journal.recorded(tracker.events, kinds, tracker.cuda))
        del loss, x, state, model
    # FSDP2's unsharded weights (storages it resizes) count as weights, as its shards do.
    uids: tuple[set[int], set[int], set[int]] = (
        param_uids | tracker.resized_uids,
        set(),
        state_uids,
    )
    return _assemble(tracker, uids, spec, target.type, t0)


@dataclass(frozen=True)
class EvaluationPlan:
    """Evaluation's batch, its predicted peak, and the shape it was planned for
    (:func:`plan_evaluation_batch` makes one).

    >>> EvaluationPlan(8, 900 * 2**20, 1000 * 2**20, (3, 32, 32), True).summary()
    'validation batch 8 (inputs of 3x32x32): predicted peak 900.0 MiB of 1000.0 MiB usable'
    """

    batch: int
    predicted_peak_bytes: int
    usable_bytes: int
    shape: tuple[int, ...]
    fits: bool  # False: even a batch of 1 is predicted over ``usable_bytes``

    def summary(self, what: str = "validation") -> str:
        shape = "x".join(map(str, self.shape))
        line = (
            f"{what} batch {self.batch} (inputs of {shape}): predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of {format_bytes(self.usable_bytes)} usable"
        )
        if not self.fits:
            line += "; over the budget even at 1: it will run out of memory unless the back-off's CPU path saves it"
        return line


def plan_evaluation_batch(
    peak_at: Callable[[int], int], largest: int, usable: int, shape: tuple[int, ...]
) -> EvaluationPlan:
    """The largest evaluation batch up to ``largest`` whose predicted peak (``peak_at(b)``, in
    bytes) fits ``usable``: guessed from the line through the peaks at 1 and 2 and confirmed
    by the guess and its neighbour, else searched between the sizes known to fit and not
    (:func:`~bigbatch.memory.plan.largest_fitting`). A batch of 1 that does not fit is returned
    with ``fits=False``: evaluation then relies on its OOM back-off.

    >>> plan_evaluation_batch(lambda b: 100 + 10 * b, 64, 500, (3, 32, 32)).batch
    40
    """
    if largest < 1:
        raise ValueError(f"the largest evaluation batch must be >= 1, got {largest}")
    peak = functools.cache(peak_at)  # the search asks the same sizes again

    def planned(batch: int) -> EvaluationPlan:
        return EvaluationPlan(batch, peak(batch), usable, shape, True)

    if peak(1) > usable:
        return EvaluationPlan(1, peak(1), usable, shape, False)
    if largest == 1 or peak(2) > usable:
        return planned(1)
    # A forward's activations grow about linearly with the batch, so the line through 1 and 2
    # lands at or next to the answer, and a size far past the budget is not traced first (the
    # costliest: a 7B model's forward at 16 sequences of 1024 tokens, about 3 s on 2 cores).
    guess = min(max(_reaches(peak, usable), 2), largest)
    if peak(guess) > usable:
        return planned(largest_fitting(peak, 2, guess, usable))
    if guess == largest or peak(guess + 1) > usable:
        return planned(guess)
    if peak(largest) <= usable:  # the peak grows slower than the line: maybe all of it fits
        return planned(largest)
    return planned(largest_fitting(peak, guess + 1, largest, usable))


def _reaches(peak: Callable[[int], int], usable: int) -> int:
    """The largest size at or under ``usable`` on the line through the peaks at 1 and 2."""
    growth = peak(2) - peak(1)
    return 2 if growth <= 0 else 1 + (usable - peak(1)) // growth
