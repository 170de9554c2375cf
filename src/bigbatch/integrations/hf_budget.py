"""Hugging Face ``Trainer`` at run time under a plan: :class:`MemoryBudget` caps CUDA's
allocator at the budget, measures the first steps and refits the micro-batch from them
(:func:`refit_sizes`, :func:`step_need_bytes`); :func:`train_with_backoff` goes on at the new
sizes, and retries an out-of-memory run at half the micro-batch and twice the accumulation
(the same update), evaluation's batch apart; :func:`check_trainer` and
:func:`check_evaluation_held` refuse a built trainer that would hold more than the plan traced.
Imported from :mod:`bigbatch.integrations.hf`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bigbatch.integrations import require
from bigbatch.integrations.hf_model_check import check_plan_matches
from bigbatch.integrations.hf_plan import (
    _described,
    _eval_batch,
    _plan_precision,
    _planned_dtype,
    _prediction,
    _ranks,
    _smoothing,
    _trl_classes,
    trainer_batch_sizes,
    with_sizes,
)
from bigbatch.integrations.hf_verify import _overrides

require("transformers", "hf")

__all__ = [
    "MemoryBudget",
    "check_evaluation_held",
    "check_trainer",
    "refit_sizes",
    "step_need_bytes",
    "train_with_backoff",
]


SIZES_FILE = "bigbatch-sizes.json"  # in the output folder: see _sizes_path


def _sizes_path(args: Any) -> Path:
    """Where a rank out of memory under torchrun leaves the sizes every rank resumes at."""
    return Path(str(getattr(args, "output_dir", "")), SIZES_FILE)


def _trainer_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class MemoryBudget(_trainer_callback_base()):  # type: ignore[misc]
    """A ``Trainer`` callback: caps this process's CUDA allocator at ``cap_bytes`` (the budget
    less the CUDA context: past it, an allocation raises out-of-memory as on a card of that
    size) for the run, and records the allocator's peak over the first ``steps`` optimizer
    steps in :attr:`measured_bytes`, beside the plan's prediction in the log (each run's line
    also in :attr:`logged`).

    Given the ``plan`` (an :class:`~bigbatch.memory.lm.LMPlan`), the measurement refits the
    micro-batch as ``bigbatch train`` does (:func:`~bigbatch.memory.plan.refit_micro_batch`):
    over the plan's usable memory it shrinks before an out-of-memory error, far under the
    prediction it grows (at most twice). Trainer's micro-batch is fixed for a run, so the
    callback then has Trainer save a checkpoint and stop, with the new sizes in :attr:`refit`;
    :func:`train_with_backoff` resumes from that checkpoint with them: the same global batch,
    the same update. On a CPU it records the process's peak and refits nothing.

    >>> MemoryBudget(8 * 2**30).cap_bytes
    8589934592
    """

    def __init__(
        self,
        cap_bytes: int,
        *,
        predicted_bytes: int | None = None,
        steps: int = 2,
        plan: Any = None,
    ):
        self.cap_bytes, self.steps, self.plan = cap_bytes, steps, plan
        if predicted_bytes is None and plan is not None:
            predicted_bytes = plan.peak_bytes
        self.predicted_bytes = predicted_bytes
        self.measured_bytes: int | None = None
        self.refit: tuple[int, int] | None = None  # (micro-batch, accumulation) to resume with
        self.checked = False  # refits once a run, as bigbatch train does
        self.logged: list[dict[str, int]] = []  # each run's line, as in Trainer's log history
        self._before: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from bigbatch.device import (
            cap_cuda_allocator,
            describe_device,
            emulates_bf16,
            reset_peak_memory,
        )

        if self.plan is not None and kwargs.get("model") is not None:
            check_plan_matches(self.plan, kwargs["model"], args.device, args)  # before a step
        device = torch.device(args.device)
        if getattr(args, "bf16", False) and emulates_bf16(device):  # Trainer lets it run
            logging.getLogger("bigbatch").warning(
                "bf16=True on %s, which has no bfloat16 units (before Ampere): torch emulates "
                "it, several times slower than fp16 in the same memory; fp16=True (a plan with "
                "--precision fp16) trains at the card's speed",
                describe_device(device),
            )
        if self.plan is not None:
            _note_logits_unmade(self.plan, args)
            _note_kernels_unplanned(args)
        capped = cap_cuda_allocator(args.device, self.cap_bytes)
        self._before = None if capped is None else capped[1]
        reset_peak_memory(args.device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from bigbatch.device import peak_allocated_bytes, peak_memory_bytes

        if state.global_step > self.steps:
            return
        peak = peak_memory_bytes(args.device)
        if peak is not None:
            self.measured_bytes = peak[0]
        if state.global_step != self.steps or peak is None:
            return
        line = {"bigbatch/measured_peak_bytes": peak[0]}
        allocated = peak_allocated_bytes(args.device)
        if allocated is not None:
            line["bigbatch/measured_allocated_bytes"] = allocated
        if self.predicted_bytes:
            line["bigbatch/predicted_peak_bytes"] = self.predicted_bytes
        whole_process = peak[1]  # a CPU's resident memory: not what the plan predicts
        if self.plan is not None and not self.checked and not whole_process:
            from bigbatch.device import card_memory
            from bigbatch.distributed import maxima_over_ranks

            self.checked = True
            micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
            # Under torchrun every rank must resume at the same sizes: the largest needs and
            # peaks, and the most memory beside the allocator (NCCL's), decide.
            card = card_memory(args.device)
            need = step_need_bytes(self.plan, peak[0], allocated)
            agreed = [need, peak[0], card[1] if card else 0]
            need, reserved, outside = maxima_over_ranks(agreed, args.device)
            if card is not None:
                card = (card[0], outside)
                line["bigbatch/outside_allocator_bytes"] = outside
            line["bigbatch/step_need_bytes"] = need
            new = refit_sizes(self.plan, micro, steps, need, card=card)
            if new[0] > micro:
                # The measured micro-steps may all have been shorter than the planned length:
                # grow only where the reserved peak, too, is far under the plan.
                by_reserved = refit_sizes(self.plan, micro, steps, reserved, card=card)
                new = by_reserved if by_reserved[0] > micro else (micro, steps)
            if new != (micro, steps):
                self.refit = new
                line["bigbatch/refit_micro_batch"] = new[0]
                control.should_save = True  # Trainer's checkpoint: the run resumes from it
                control.should_training_stop = True
        self.logged.append(line)
        state.log_history.append({**line, "step": state.global_step})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from bigbatch.device import uncap_cuda_allocator

        uncap_cuda_allocator(args.device, self._before)


def step_need_bytes(plan: Any, reserved: int, allocated: int | None) -> int:
    """What a rank's step needs, in the plan's terms (the allocator's reserved bytes for one
    micro-batch of the planned length), from its measured ``reserved`` and ``allocated`` peaks.

    Sequences padded to each micro-batch's longest change the step's tensor sizes every
    micro-step, and the caching allocator keeps the blocks each size left: its reserved peak
    climbs over the first steps to whatever cap it has (where it gives its cache back rather
    than fail), far past what any one step needs. So the allocated peak decides, scaled by the
    reserved-to-allocated ratio the plan predicted for its step; the reserved peak bounds it.
    :class:`MemoryBudget` shrinks by this need, and grows only where the reserved peak is far
    under the plan too (the measured sequences may all have been shorter than planned).

    >>> from types import SimpleNamespace
    >>> plan = SimpleNamespace(plan=SimpleNamespace(
    ...     prediction=SimpleNamespace(allocated_bytes=800, planning_bytes=1000)))
    >>> step_need_bytes(plan, 1900, 840)  # fragmented by changing lengths: 840 x 1000/800
    1050
    >>> step_need_bytes(plan, 1000, None)  # no allocated peak (off CUDA): the reserved one
    1000
    """
    prediction = _prediction(plan)
    predicted = getattr(prediction, "allocated_bytes", 0) or 0
    if allocated is None or prediction is None or predicted <= 0:
        return reserved
    return min(reserved, round(allocated * prediction.planning_bytes / predicted))


def refit_sizes(
    plan: Any,
    micro_batch: int,
    accumulation: int,
    measured: int,
    *,
    card: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """``(per_device_train_batch_size, gradient_accumulation_steps)`` for a rank whose step at
    ``micro_batch`` measured ``measured`` bytes (the allocator's reserved peak), against the
    ``plan``'s predictions: the same sequences a step, a micro-batch that divides them. With
    the ``card``'s ``(total, outside the allocator)`` (:func:`bigbatch.device.card_memory`),
    the limit is also what the card has left (:func:`~bigbatch.memory.plan.limit_on_card`).

    >>> from types import SimpleNamespace
    >>> plan = SimpleNamespace(per_rank_extra_bytes=0, plan=SimpleNamespace(
    ...     curve=[(1, 1100), (4, 1400)], usable_bytes=2000, budget_bytes=2500, overhead_bytes=250))
    >>> refit_sizes(plan, 4, 3, 700)  # half the prediction: twice the micro-batch that divides 12
    (6, 2)
    >>> refit_sizes(plan, 4, 3, 2100)  # over the usable memory: smaller, before an OOM
    (3, 4)
    >>> refit_sizes(plan, 4, 3, 1400, card=(2500, 900))  # as planned, but NCCL took 650 more
    (3, 4)
    """
    from bigbatch.memory.plan import limit_on_card, refit_micro_batch

    share = micro_batch * accumulation  # a rank's sequences a step
    extra = plan.per_rank_extra_bytes  # DDP's buckets, FSDP2's shards: outside the curve
    one = plan.plan
    # The one-process plan's usable is a rank's less extra.
    limit = limit_on_card(one.usable_bytes + extra, one.budget_bytes, one.overhead_bytes, card)
    largest = refit_micro_batch(
        [(b, peak + extra) for b, peak in one.curve],
        micro_batch,
        measured,
        limit,
        target=share,
        # Trainer's micro-batch divides the share, often well under what the plan found fits
        # (7 of 12 -> 6): growing is bounded by the measurement (at most twice), not the plan.
        top=share,
    )
    return trainer_batch_sizes(share, largest)


def _note_logits_unmade(plan: Any, args: Any) -> None:
    """Say, as training begins, where ``SFTTrainer``'s fused LM head will make none of the
    logits a plan of the model's own loss holds for it (a tenth of its peak or more: room the
    micro-batch could have), as ``bigbatch plan`` says when it plans."""
    from bigbatch.memory.budget import format_bytes
    from bigbatch.memory.lm_setup import _fused_lm_head

    frees = getattr(plan, "logits_a_fused_head_frees", None)
    if "SFTConfig" not in _trl_classes(args) or frees is None or _smoothing(args):
        return  # Trainer's loss, or SFTTrainer's smoothed one, makes the whole logits
    logits = frees()
    if logits and _fused_lm_head() is not None:
        logging.getLogger("bigbatch").warning(
            "the plan holds %s of logits that SFTTrainer's own loss, through its fused LM "
            "head, never makes: it fits, with that much unused; plan with --loss trl "
            '(loss="trl" in Python) to give the micro-batch that room',
            format_bytes(logits),
        )


def _note_kernels_unplanned(args: Any) -> None:
    """Say, as training begins, where ``args`` run other kernels than the plan traced
    (transformers' own layers, run eagerly): Inductor's under ``torch_compile``, Liger's under
    ``use_liger_kernel`` (Trainer's takes the loss too, without the whole logits). Neither is
    modelled, in either direction; the first steps' measurement is what holds them."""
    ran = [
        f"{flag}=True"
        for flag in ("torch_compile", "use_liger_kernel")
        if getattr(args, flag, False)
    ]
    if ran:
        logging.getLogger("bigbatch").warning(
            "%s runs other kernels than the plan traced (transformers' own layers, eager), "
            "whose memory it does not model: MemoryBudget's measurement of the first steps "
            "refits the micro-batch to what they hold (on a GPU)",
            " and ".join(ran),
        )


def check_trainer(trainer: Any, plan: Any) -> None:
    """Refuse, in one line with the fix, a built ``trainer`` that would hold more than ``plan``
    traced in what its arguments do not show: ``compute_loss_func`` under a plan of
    ``SFTTrainer``'s fused LM head (``--loss trl``: the function takes the model's whole logits,
    which the plan's micro-batch would not hold), a collator that puts a micro-batch's
    sequences in one row under a plan that pads them (transformers'
    ``DataCollatorWithFlattening``, TRL's with ``padding_free``: another step than the plan
    traced), and an evaluation keeping every pass's logits (:func:`check_evaluation_held`). Under
    a ``--loss trl`` plan, a subclass's own ``compute_loss`` is named in a warning: a model
    called there without ``fused_lm_head=True`` makes its whole logits.
    :func:`train_with_backoff` checks each trainer it builds; call it before
    ``trainer.train()`` of your own.

    >>> from types import SimpleNamespace
    >>> from bigbatch.memory.lm import LMSetup
    >>> plan = SimpleNamespace(setup=LMSetup(seq_len=2048, loss="trl"))
    >>> trainer = SimpleNamespace(args=SimpleNamespace(), compute_loss_func=len)  # SFTTrainer's
    >>> check_trainer(trainer, plan)
    Traceback (most recent call last):
    ...
    ValueError: the plan traces SFTTrainer's fused LM head, and a trainer given ...
    >>> trainer.compute_loss_func = None
    >>> check_trainer(trainer, plan)
    """
    _check_trainer(trainer, plan, warn=True)


def _check_trainer(trainer: Any, plan: Any, *, warn: bool) -> None:
    # train_with_backoff checks each trainer it builds, and says its warning once, not again
    # at each smaller micro-batch.
    if plan is None:
        return
    fused = getattr(plan.setup, "loss", "model") == "trl"
    if fused and getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError(
            "the plan traces SFTTrainer's fused LM head, and a trainer given compute_loss_func "
            "hands that function the model's whole logits (SFTTrainer too, which deprecates "
            "it), which the plan's micro-batch would not hold: drop compute_loss_func "
            "(SFTTrainer's own loss is exact over token counts), or plan with --loss model"
        )
    own = _overrides(trainer, "compute_loss")
    # Whether it calls the head fused only running it shows: a warning, not an error.
    if warn and fused and own is not None:
        logging.getLogger("bigbatch").warning(
            "the plan traces SFTTrainer's fused LM head, and %s overrides compute_loss: a "
            "model called there without fused_lm_head=True makes its whole logits, which the "
            "plan's micro-batch would not hold; compute the loss with "
            "super().compute_loss(...), or plan with --loss model",
            own,
        )
    _check_collator(trainer, plan)
    check_evaluation_held(trainer, plan)


def _check_collator(trainer: Any, plan: Any) -> None:
    """Refuse, under a plan that pads sequences, a trainer whose collator puts a micro-batch's
    sequences in one row (transformers' ``DataCollatorWithFlattening``, TRL's collator with
    ``padding_free``): another step than the plan traced, as :func:`with_plan` refuses such
    arguments. A wrapped collator (``shift_labels_collator``'s, or any that sets
    ``__wrapped__``) is judged by the one underneath; a collator of the user's own is not
    judged."""
    if getattr(plan.setup, "packing", False):
        return
    import inspect

    import transformers

    collator = getattr(trainer, "data_collator", None)
    if callable(collator):
        collator = inspect.unwrap(collator)
    flattens = isinstance(collator, transformers.DataCollatorWithFlattening)
    if not flattens and getattr(collator, "padding_free", False) is not True:
        return
    raise ValueError(
        f"the plan ({_described(plan)}) pads each micro-batch's sequences and this trainer's "
        f"collator ({type(collator).__name__}) puts them in one row, another step than the plan "
        "traced: plan with --packing, or pad them"
    )


def _budgets(trainer: Any) -> list[MemoryBudget]:
    handler = getattr(trainer, "callback_handler", None)
    return [c for c in getattr(handler, "callbacks", []) if isinstance(c, MemoryBudget)]


def train_with_backoff(
    make_trainer: Callable[[Any], Any], args: Any, *, log: Callable[[str], None] = print
) -> Any:
    """``make_trainer(args).train()``, and on running out of memory the same run again at half
    the micro-batch and twice the accumulation (the global batch, so the update, unchanged;
    exact with Trainer's token count), from the last checkpoint Trainer saved in
    ``args.output_dir`` if any. Raises the error when micro-batch 1 runs out too. A
    :class:`MemoryBudget` callback that refitted the micro-batch after the first steps stopped
    the run at a checkpoint: it goes on from there at the new sizes. Out of memory while
    Trainer evaluates, the evaluation batch halves instead, training's sizes unchanged.

    Under ``torchrun`` a rank that runs out of memory (training or evaluating) cannot tell the
    others, which wait for it in their next collective: it writes the smaller sizes to
    ``bigbatch-sizes.json`` in ``args.output_dir`` and raises, so that torchrun stops every
    rank at once; relaunched (``torchrun --max-restarts N`` does it, with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch 2.5+'s restarts may read the last
    attempt's addresses from the store torchrun shares, pytorch/pytorch#135712), every rank
    resumes there at those sizes.

    ``make_trainer(args)`` builds the Trainer (model, data, callbacks) anew for each try.

    >>> from types import SimpleNamespace
    >>> class Trainer:  # stands in for transformers.Trainer: out of memory above 2 sequences
    ...     def __init__(self, args):
    ...         self.args = args
    ...     def train(self, resume_from_checkpoint=None):
    ...         if self.args.per_device_train_batch_size > 2:
    ...             raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    ...         return "trained"
    >>> args = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=2,
    ...                        output_dir="a-folder-not-made-yet")
    >>> train_with_backoff(Trainer, args)
    out of memory at micro-batch 8: again at 4 x 4 accumulation, the same global batch
    out of memory at micro-batch 4: again at 2 x 8 accumulation, the same global batch
    'trained'
    """
    from transformers.trainer_utils import get_last_checkpoint

    from bigbatch.device import free_memory

    args, shrunk = _resumed_sizes(args, log)
    tries = 0
    while True:
        failed, refit, trainer = None, None, None
        tries += 1
        try:
            trainer = make_trainer(args)
            for budget in _budgets(trainer):
                budget.checked = budget.checked or shrunk  # no growing back after an OOM
                _check_trainer(trainer, budget.plan, warn=tries == 1)
            folder = args.output_dir
            checkpoint = get_last_checkpoint(folder) if os.path.isdir(folder) else None
            result = trainer.train(resume_from_checkpoint=checkpoint)
            for budget in _budgets(trainer):
                refit, budget.refit = refit or budget.refit, None
            if refit is None:
                # The sizes carried over a restart are spent: a new run here plans afresh.
                _sizes_path(args).unlink(missing_ok=True)
                return result
        except Exception as exc:
            failed = _retried(exc, args, log)
            if failed is None:
                raise
            shrunk = shrunk or failed == "training"
        finally:
            trainer = None  # drop the model, optimizer and the exception's frames first
        if failed:
            free_memory(host_oom=False)
        if failed == "evaluation":
            args = _evaluation_halved(args, log)
            continue
        if failed:
            refit = _halved(args)
        if refit is not None:
            log(_resized(args.per_device_train_batch_size, refit, out_of_memory=bool(failed)))
            args = with_sizes(args, *refit)


def check_evaluation_held(trainer: Any, plan: Any) -> None:
    """Refuse a ``Trainer`` that would keep every evaluation pass's logits on the card until its
    evaluation ends, past the room ``plan`` leaves beside evaluating (its usable memory less its
    evaluation peak): with ``compute_metrics``, Trainer concatenates each pass's logits onto the
    ones before (both copies alive at each concatenation), unless ``eval_accumulation_steps=1``
    moves each pass's to the CPU (a larger one keeps that many passes' on the card, which are
    counted), ``preprocess_logits_for_metrics`` reduces them, ``batch_eval_metrics`` computes
    the metrics a pass at a time, or ``prediction_loss_only`` keeps none (SFTTrainer too, which
    makes them in a forward pass more: refused outright under a plan of its fused LM head,
    ``--loss trl``, whose evaluation batch holds no logits). Sequences of the plan's length,
    every rank's (gathered onto each): ``sequences x tokens x vocabulary``, in float32 under
    mixed precision (accelerate returns a bf16 or fp16 forward's outputs so), else in the
    weights' dtype. Checked by :func:`train_with_backoff` before training starts (halving the
    evaluation batch, as it does on running out of memory evaluating, would not shrink them).

    >>> from types import SimpleNamespace
    >>> from bigbatch.memory.lm import LMSetup
    >>> plan = SimpleNamespace(setup=LMSetup(seq_len=2048), vocab=152_064, usable_bytes=20e9,
    ...                        eval_peak_bytes=18e9, peak_bytes=19e9)
    >>> args = SimpleNamespace(eval_strategy="steps", eval_accumulation_steps=None)
    >>> trainer = SimpleNamespace(args=args, compute_metrics=len, eval_dataset=[0] * 100,
    ...                           preprocess_logits_for_metrics=None)
    >>> check_evaluation_held(trainer, plan)
    Traceback (most recent call last):
    ...
    ValueError: Trainer keeps every evaluation pass's logits on the card until evaluation ends ...
    >>> args.eval_accumulation_steps = 1  # each pass's logits to the CPU
    >>> check_evaluation_held(trainer, plan)
    """
    from bigbatch.memory.budget import format_bytes

    if plan is None:
        return
    args = trainer.args
    strategy = getattr(args, "eval_strategy", "no")
    if str(getattr(strategy, "value", strategy)) == "no":
        return
    if getattr(trainer, "compute_metrics", None) is None or getattr(
        args, "prediction_loss_only", False
    ):
        return
    if getattr(plan.setup, "loss", "model") == "trl":
        raise ValueError(
            "the plan traces SFTTrainer's evaluation through its fused LM head, and with "
            "compute_metrics SFTTrainer makes each pass's whole logits too, in a forward pass "
            "more (TRL deprecates it), which the plan's evaluation batch would not hold: drop "
            "compute_metrics (SFTTrainer logs its mean_token_accuracy itself), or plan with "
            "--loss model"
        )
    steps = int(getattr(args, "eval_accumulation_steps", None) or 0)
    if getattr(args, "batch_eval_metrics", False) or steps == 1:
        return  # a pass's logits at a time, which the plan's evaluation peak holds
    if getattr(trainer, "preprocess_logits_for_metrics", None) is not None:
        return  # what it keeps of the logits is the user's to size
    datasets = getattr(trainer, "eval_dataset", None)
    datasets = datasets.values() if isinstance(datasets, dict) else [datasets]
    sized = [len(d) for d in datasets if d is not None and hasattr(d, "__len__")]
    if not sized:
        return
    sequences, kept = _logits_kept(args, max(sized), steps)
    tokens, vocab = plan.setup.seq_len, int(plan.vocab)
    # The logits as Trainer keeps them: float32 under mixed precision (accelerate hands an
    # autocast forward's 16-bit outputs back in float32), else in the weights' dtype.
    sixteen_bit = _planned_dtype(plan) in (torch.float16, torch.bfloat16)
    width = 2 if _plan_precision(plan) == "fp32" and sixteen_bit else 4
    held = sequences * tokens * vocab * width
    beside = plan.eval_peak_bytes if plan.eval_peak_bytes is not None else plan.peak_bytes
    room = int(plan.usable_bytes - beside)
    if 2 * held <= room:
        return
    raise ValueError(
        f"Trainer keeps {kept}: {sequences} sequences x {tokens} tokens x {vocab:,} vocabulary "
        f"= {format_bytes(held)}, twice that as it concatenates them, past the "
        f"{format_bytes(max(room, 0))} the plan leaves beside evaluating: set "
        "eval_accumulation_steps=1 (each pass's logits to the CPU), or reduce them in "
        "preprocess_logits_for_metrics (logits.argmax(-1))"
    )


def _logits_kept(args: Any, sequences: int, steps: int) -> tuple[int, str]:
    """How many of the evaluation's ``sequences`` Trainer keeps the logits of on the card at
    once, and what keeps them: all of them, or ``eval_accumulation_steps`` passes' (``steps``),
    each pass's gathered from every rank, where those are fewer."""
    at_a_time = steps * _eval_batch(args) * _ranks(args)
    if steps and at_a_time < sequences:
        return at_a_time, (
            f"{steps} evaluation passes' logits on the card at a time (compute_metrics, "
            f"eval_accumulation_steps={steps})"
        )
    return sequences, (
        "every evaluation pass's logits on the card until evaluation ends (compute_metrics)"
    )


def _evaluation_halved(args: Any, log: Callable[[str], None]) -> Any:
    """``args`` at half the evaluation batch, said; training's sizes stay."""
    smaller = _eval_batch(args) // 2
    log(
        f"out of memory evaluating {_eval_batch(args)} sequences a forward pass: again at "
        f"{smaller} from the last checkpoint, training's sizes unchanged"
    )
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return with_sizes(args, micro, steps, eval_batch=smaller)


def _resized(micro: int, refit: tuple[int, int], *, out_of_memory: bool) -> str:
    """The line that says why the run goes on at ``refit``'s sizes."""
    if out_of_memory:
        return (
            f"out of memory at micro-batch {micro}: again at {refit[0]} x {refit[1]} "
            "accumulation, the same global batch"
        )
    return (
        f"memory measured at micro-batch {micro}: on at {refit[0]} x {refit[1]} accumulation "
        "from the checkpoint, the same global batch"
    )


def _retried(exc: BaseException, args: Any, log: Callable[[str], None]) -> str | None:
    """What a run that raised ``exc`` retries with less memory: ``evaluation`` (out of memory
    while Trainer evaluated: its batch halves) or ``training`` (its micro-batch halves);
    None for what is raised as it is. Under torchrun a rank out of memory in training hands
    the halved sizes over first (:func:`_hand_over`)."""
    from bigbatch.distributed import is_distributed
    from bigbatch.memory.oom import is_oom

    if not is_oom(exc):
        return None
    failed = "evaluation" if _in_evaluation(exc) else "training"
    if failed == "evaluation" and _eval_batch(args) == 1:
        return None
    if failed == "training" and args.per_device_train_batch_size == 1:
        return None
    if is_distributed():
        _hand_over(args, log, evaluation=failed == "evaluation")
        return None
    return failed


def _in_evaluation(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while Trainer evaluated (its evaluation loop on the stack)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in ("evaluation_loop", "prediction_step"):
            return True
        tb = tb.tb_next
    return False


def _halved(args: Any) -> tuple[int, int]:
    """The next smaller micro-batch that divides a rank's share, and its accumulation."""
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    smaller = max(m for m in range(1, micro) if micro % m == 0)
    return smaller, steps * (micro // smaller)


def _hand_over(args: Any, log: Callable[[str], None], *, evaluation: bool = False) -> None:
    """A rank out of memory under torchrun, in training or (``evaluation``) in Trainer's
    evaluation: the sizes every rank resumes at, in the output folder, before this process
    raises and torchrun stops the others."""
    import json

    import torch.distributed as dist

    from bigbatch.io import atomic_write_text

    micro, steps, world = (
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        _ranks(args),
    )
    eval_batch = _eval_batch(args)
    if evaluation:
        eval_batch //= 2
        what = f"evaluating {_eval_batch(args)} sequences a forward pass"
        resumes = f"at evaluation batch {eval_batch}, training's sizes unchanged"
    else:
        micro, steps = _halved(args)
        what = f"at micro-batch {args.per_device_train_batch_size}"
        resumes = f"at {micro} x {steps} accumulation, the same global batch"
    sizes = {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": steps,
        "per_device_eval_batch_size": eval_batch,
        "world_size": world,
        "out_of_memory_at": None if evaluation else args.per_device_train_batch_size,
        "evaluation_out_of_memory_at": _eval_batch(args) if evaluation else None,
    }
    path = _sizes_path(args)
    sizes |= _earlier_causes(path, args, evaluation=evaluation)
    atomic_write_text(path, json.dumps(sizes) + "\n")
    log(
        f"out of memory {what} on rank {dist.get_rank()} of {world}: the others wait for it "
        "in a collective, so this process stops (and torchrun stops them); relaunched, every "
        f"rank resumes {resumes} from the last checkpoint ({path}; "
        "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts 3 ...` relaunches by "
        "itself)"
    )


def _earlier_causes(path: Path, args: Any, *, evaluation: bool) -> dict[str, int]:
    """What an earlier restart of this run ran out of memory at (the other kind than this one:
    training's micro-batch where this is evaluation, and the reverse), from the sizes file it
    left, where ``args`` runs at that file's sizes; so that a second restart names both."""
    import json

    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    # The file is this run's where this rank runs at its sizes (it resumed from it).
    same = ["world_size", "per_device_train_batch_size", "gradient_accumulation_steps"]
    here = [_ranks(args), args.per_device_train_batch_size, args.gradient_accumulation_steps]
    if not evaluation:
        same, here = [*same, "per_device_eval_batch_size"], [*here, _eval_batch(args)]
    key = "out_of_memory_at" if evaluation else "evaluation_out_of_memory_at"
    earlier = saved.get(key)
    if isinstance(earlier, int) and [saved.get(k) for k in same] == here:
        return {key: earlier}
    return {}


def _resumed_sizes(args: Any, log: Callable[[str], None]) -> tuple[Any, bool]:
    """``args`` at the sizes a rank of this run left before it ran out of memory under torchrun
    (:func:`_hand_over`), and whether training's were smaller; a file of another global batch
    or number of ranks is not this run's and is left alone."""
    from bigbatch.io import read_json

    path = _sizes_path(args)
    if not path.is_file():
        return args, False
    saved = read_json(path, f"delete {path} (the sizes a rank left after running out of memory)")
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    new = (saved.get("per_device_train_batch_size"), saved.get("gradient_accumulation_steps"))
    if not all(isinstance(n, int) and n > 0 for n in new):
        return args, False
    same_run = new[0] * new[1] == micro * steps
    same_run = same_run and saved.get("world_size") == _ranks(args)
    eval_batch = saved.get("per_device_eval_batch_size")
    if not (isinstance(eval_batch, int) and 0 < eval_batch < _eval_batch(args)):
        eval_batch = None  # an older file without it, or no smaller
    shrunk = new[0] < micro
    if not same_run or not (shrunk or eval_batch):
        return args, False
    why = []
    if shrunk:
        why.append(f"{new[0]} x {new[1]} accumulation, the same global batch")
    if eval_batch:
        why.append(f"evaluation batch {eval_batch}")
    at = [f"micro-batch {saved['out_of_memory_at']}"] if saved.get("out_of_memory_at") else []
    if saved.get("evaluation_out_of_memory_at"):
        at.append(f"evaluation batch {saved['evaluation_out_of_memory_at']}")
    where = f" at {' and '.join(at)}" if at else ""
    log(f"resuming at {' and '.join(why)}: a rank ran out of memory{where} ({path})")
    return with_sizes(args, *(new if shrunk else (micro, steps)), eval_batch=eval_batch), shrunk
