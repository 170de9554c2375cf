"""Prove that a built Hugging Face ``Trainer`` accumulates exactly, on its own model, data,
collator and loss: one window of its training rows through its own ``training_step``, as
micro-batches and as one big batch, the gradients compared and a difference explained.

``Trainer`` normalises the loss in one of three ways (the model's own over the window's count
``num_items_in_batch``, a ``compute_loss_func``'s, or ``loss / gradient_accumulation_steps``), a
subclass may override ``compute_loss`` and a collator decides what is counted: which of them a
run takes is easier to measure than to read, and this measures it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from typing import Any

import torch

from bigbatch.device import rng_state, set_rng_state
from bigbatch.inexact import InexactLayer, describe_inexact_layers, find_inexact_layers
from bigbatch.integrations import require
from bigbatch.verify import (
    ROUNDOFF_CAPS,
    ROUNDOFF_FACTOR,
    TOLERANCES,
    CaseResult,
    compare_gradients,
)

require("transformers", "hf")

__all__ = ["verify_trainer"]

Gradients = dict[str, torch.Tensor]


def verify_trainer(trainer: Any, micro_batches: Sequence[int] | None = None) -> CaseResult:
    """Measure whether ``trainer`` (a built ``transformers.Trainer``, TRL's ``SFTTrainer`` or a
    subclass of either) accumulates exactly: the first rows of its training set, collated by its
    own collator, go through its own ``training_step`` as micro-batches of ``micro_batches``
    rows, then once as one big batch; the gradients are compared per top-level module. By
    default the window is one of its micro-batches' rows (``per_device_train_batch_size``; two
    where that is one), split unevenly (all but one row, then one), so the big batch fits where
    training does and ``loss / N`` parts from it even where every row counts the same; on a
    CPU, or with room, pass a longer window (``micro_batches=[4, 4, 2]``).

    The tolerance is ``1e-12`` relative in float64 and grows, at any precision (``bf16``/``fp16``
    autocast included), with the big batch's own round-off, measured as the same big batch with
    its rows in reverse order (no float64 copy of the model is made); under ``SFTTrainer``'s
    fused LM head, which sums in float32, it is float32's. A difference is explained, measured:
    dropout or BatchNorm modules (the window again with them in eval mode), random draws
    elsewhere (the big batch under another seed: dropout inside attention), else how Trainer
    normalised (``loss / gradient_accumulation_steps``, a ``compute_loss`` of your own that
    returns a mean, a count that misses the labels' shift). The trainer's gradients, modes and
    random state are as they were afterwards; the gradients compared are copied to the CPU. It
    runs in one process.

    >>> import torch, transformers
    >>> class Mean(torch.nn.Module):  # a model of one's own, its loss a mean over its batch
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(3, 1).double()
    ...     def forward(self, x, labels):
    ...         return {"loss": ((self.fc(x).squeeze(-1) - labels) ** 2).mean()}
    >>> _ = torch.manual_seed(0)
    >>> rows = [{"x": torch.randn(3).double(), "labels": torch.randn(()).double()}
    ...         for _ in range(8)]
    >>> args = transformers.TrainingArguments("/tmp/verify", per_device_train_batch_size=4,
    ...     gradient_accumulation_steps=2, use_cpu=True, report_to=[])
    >>> result = verify_trainer(transformers.Trainer(Mean(), args, train_dataset=rows))
    >>> result.micro_batch_counts, result.passed  # 3 rows, then 1: loss / 2 is not their mean
    ([3, 1], False)
    """
    sizes = _window_sizes(trainer.args, micro_batches)
    loader = trainer.get_train_dataloader()  # its columns removed and collator wrapped as train's
    rows = _first_rows(loader.dataset, sum(sizes))
    collate, starts = loader.collate_fn, [sum(sizes[:i]) for i in range(len(sizes))]
    window = [collate(rows[at : at + n]) for at, n in zip(starts, sizes, strict=True)]
    # The model's own loss on the whole batch, uncounted, is its mean: the big batch Trainer's
    # count must reach (GPT-2's, counted unshifted, does not). Any other loss takes the count.
    counted = not _models_own_loss(trainer)
    big = [collate(rows)]
    with _kept(trainer):
        got = _window_gradients(trainer, window)
        ref = _window_gradients(trainer, big, counted=counted)
        dtype = _precision(trainer)
        again = _window_gradients(trainer, [collate(rows[::-1])], counted=counted)
        _, roundoff, _ = compare_gradients(again, ref)
        tolerance = _tolerance(dtype, roundoff)
        max_abs, max_rel, groups = compare_gradients(got, ref)
        passed = max_rel <= tolerance
        explanation = "" if passed else _explain(trainer, window, big, ref, counted, tolerance)
    return CaseResult(
        case=type(trainer).__name__,
        method="trainer",
        dtype=str(dtype).replace("torch.", ""),
        micro_batch_counts=[
            _count(trainer, batch, n) for batch, n in zip(window, sizes, strict=True)
        ],
        max_abs=max_abs,
        max_rel=max_rel,
        tolerance=tolerance,
        passed=passed,
        groups=groups,
        explanation=explanation,
        roundoff=roundoff,
    )


def _window_sizes(args: Any, micro_batches: Sequence[int] | None) -> list[int]:
    """The rows of each micro-batch of the window to verify, refused in one line when unusable.

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=3,
    ...                        world_size=1)
    >>> _window_sizes(args, None), _window_sizes(args, [4, 4, 2])
    ([3, 1], [4, 4, 2])
    """
    if getattr(args, "world_size", 1) > 1:
        raise ValueError(
            f"verify_trainer runs in one process, and this one is one of {args.world_size}: "
            "run the script with python rather than torchrun (the check is of the loss, the "
            "counts and the collator, which each rank shares with one process)"
        )
    if micro_batches is None:
        # The rows of one micro-batch in all: its big batch fits where training does (the
        # rows of the whole accumulation at once are what a card without room cannot hold).
        rows = args.per_device_train_batch_size
        return [rows - 1, 1] if rows > 1 else [1, 1]
    sizes = [int(n) for n in micro_batches]
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(
            f"micro_batches={list(micro_batches)} is no window to accumulate: give two or more "
            "micro-batch sizes of at least one row each, e.g. micro_batches=[4, 4, 2]"
        )
    return sizes


def _first_rows(dataset: Any, n: int) -> list[Any]:
    """The first ``n`` rows of a training set, indexable or iterable."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        rows = [dataset[i] for i in range(min(n, len(dataset)))]
    else:
        rows = list(islice(iter(dataset), n))
    if len(rows) < n:
        raise ValueError(
            f"the trainer's training set holds {len(rows)} rows and the window to verify takes "
            f"{n}: pass smaller micro_batches, e.g. micro_batches=[{max(1, len(rows) // 2)}, "
            f"{max(1, len(rows) - len(rows) // 2)}]"
        )
    return rows


@contextmanager
def _kept(trainer: Any) -> Iterator[None]:
    """Give back the model's gradients, train/eval modes and every random generator, and the
    trainer's accumulation count, as they were: verifying must not move a run."""
    model = trainer.model
    grads = {p: p.grad for p in model.parameters()}
    modes = {m: m.training for m in model.modules()}
    rng = rng_state()
    had = "current_gradient_accumulation_steps" in vars(trainer)
    steps = getattr(trainer, "current_gradient_accumulation_steps", None)
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g
        for m, training in modes.items():
            m.training = training
        set_rng_state(rng)
        if had:
            trainer.current_gradient_accumulation_steps = steps
        else:
            vars(trainer).pop("current_gradient_accumulation_steps", None)


def _window_gradients(
    trainer: Any, window: list[Any], counted: bool = True, *, seed: int = 0
) -> Gradients:
    """The gradient ``trainer`` sums over ``window`` (collated micro-batches) as its training
    loop does: counted by its ``get_batch_samples`` (unless not ``counted``), each through its
    ``training_step``, the random generators seeded with ``seed``."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same draws for every run, where the model draws any
    batches, count = trainer.get_batch_samples(iter(window), len(window), trainer.args.device)
    count = count if counted else None
    trainer.current_gradient_accumulation_steps = len(batches)
    for inputs in batches:
        trainer.training_step(model, inputs, count)
    # Kept off the accelerator: the comparison must not need a card's room for three gradients.
    out = {
        name: p.grad.detach().to("cpu", copy=True)
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return out


def _models_own_loss(trainer: Any) -> bool:
    """Whether ``trainer`` trains with the model's own loss: no ``compute_loss_func``, and no
    ``compute_loss`` but transformers' or TRL's."""
    return trainer.compute_loss_func is None and _overrides(trainer, "compute_loss") is None


def _precision(trainer: Any) -> torch.dtype:
    """The precision the gradients are computed in: autocast's, else the trainable weights',
    and at most float32 under ``SFTTrainer``'s fused LM head, which sums its tiles' products in
    float32 whatever the weights."""
    from bigbatch.memory.lm_setup import _fused_lm_head  # lazily: the planner is not needed before

    if getattr(trainer.args, "bf16", False):
        return torch.bfloat16
    if getattr(trainer.args, "fp16", False):
        return torch.float16
    trained = [p.dtype for p in trainer.model.parameters() if p.requires_grad]
    dtype = trained[0] if trained else torch.float64
    sft = any(
        cls.__name__ == "SFTTrainer" and cls.__module__.startswith("trl")
        for cls in type(trainer).__mro__
    )
    fused = sft and _fused_lm_head() is not None
    return torch.float32 if fused and dtype == torch.float64 else dtype


def _tolerance(dtype: torch.dtype, roundoff: float) -> float:
    """The relative difference that is round-off at ``dtype``, given the big batch's distance
    from itself in reverse order: that distance grows the tolerance past the precision's floor
    even for float64 weights, where a part of the step computes in a lower precision.

    >>> _tolerance(torch.float64, 1e-17), _tolerance(torch.float64, 1e-7)
    (1e-12, 4e-07)
    """
    floor = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    cap = ROUNDOFF_CAPS.get(dtype, ROUNDOFF_CAPS[torch.float32])
    return min(max(floor, ROUNDOFF_FACTOR * roundoff), cap)


def _count(trainer: Any, batch: Any, rows: int) -> int:
    """What ``trainer`` counts in one micro-batch (tokens, labels), or its rows where it
    counts nothing."""
    _, count = trainer.get_batch_samples(iter([batch]), 1, trainer.args.device)
    return rows if count is None else int(count)


def _explain(
    trainer: Any,
    window: list[Any],
    big: list[Any],
    ref: Gradients,
    counted: bool,
    tolerance: float,
) -> str:
    """Why the window's gradient is not the big batch's (``ref``, from ``big``), measured:
    dropout or BatchNorm modules (both again with them in eval mode), random draws elsewhere
    (the big batch against itself under another seed), else how the trainer normalised."""
    trainer.model.train()  # as training_step leaves it: the layers active in training
    layers = find_inexact_layers(trainer.model)
    said = ""
    with _quiet(trainer, layers):
        if layers:  # the big batch again, its layers quiet: ref holds their draws
            ref = _window_gradients(trainer, big, counted=counted)
            _, rel, _ = compare_gradients(_window_gradients(trainer, window), ref)
            said = (
                f"{describe_inexact_layers(layers)} With those layers in eval mode the relative "
                f"difference is {rel:.1e}, "
            )
            if rel <= tolerance:
                return said + "so they explain the difference."
            said += "so something else differs too. "
        _, drawn, _ = compare_gradients(_window_gradients(trainer, big, counted, seed=1), ref)
    if drawn > tolerance:
        settings = _config_dropout(trainer.model)
        return said + (
            f"The big batch differs from itself by {drawn:.1e} under another seed: the step "
            "draws random numbers outside dropout modules (dropout inside attention"
            + (f"; the config sets {settings}" if settings else "")
            + "): set them to 0 to verify the rest."
        )
    return said + _explain_normalisation(trainer, window)


def _config_dropout(model: Any) -> str:
    """The dropout probabilities over 0 in ``model``'s config (``attention_dropout=0.1``), which
    may draw masks outside any dropout module; "" where there are none.

    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(to_dict=lambda: {"attention_dropout": 0.1, "hidden_size": 8})
    >>> _config_dropout(SimpleNamespace(config=config))
    'attention_dropout=0.1'
    """
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    settings = to_dict() if callable(to_dict) else {}
    return ", ".join(
        f"{key}={value:g}"
        for key, value in settings.items()
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0
    )


@contextmanager
def _quiet(trainer: Any, layers: list[InexactLayer]) -> Iterator[None]:
    """``layers`` in eval mode while running, which ``training_step``'s ``model.train()`` would
    undo: a pre-forward hook puts each back (:func:`_kept` restores the modes after)."""
    names = {layer.name for layer in layers}

    def quiet(module: torch.nn.Module, _: Any) -> None:
        module.train(False)  # returning the module would replace the layer's inputs

    handles = [
        module.register_forward_pre_hook(quiet)
        for name, module in trainer.model.named_modules()
        if name in names
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _overrides(trainer: Any, method: str) -> str | None:
    """The class of ``trainer``'s own (neither transformers' nor TRL's) ``method``, if any."""
    for cls in type(trainer).__mro__:
        if method in vars(cls):
            own = cls.__module__.split(".")[0] not in ("transformers", "trl")
            return cls.__name__ if own else None
    return None


def _explain_normalisation(trainer: Any, window: list[Any]) -> str:
    """How ``trainer`` normalised the window's loss, and the fix that makes it the big batch's."""
    _, count = trainer.get_batch_samples(iter(window), len(window), trainer.args.device)
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and count is not None) or (
            trainer.compute_loss_func is not None
        )
    own = _overrides(trainer, "compute_loss")
    if not scaled:
        return (
            "Trainer divided each micro-batch's loss by the number of micro-batches (loss / N: "
            "the model's forward takes no num_items_in_batch and no compute_loss_func was "
            "given), which weights every micro-batch equally; the big batch weights each by "
            "its count. Give Trainer the loss: compute_loss_func=bigbatch.integrations.hf."
            "token_loss() (a sum over the window's count)."
        )
    if own:
        return (
            f"{own}.compute_loss is your own: Trainer passed it num_items_in_batch={int(count)} "
            "(the window's count) and does not divide what it returns, so it must return the "
            "sum of its terms divided by num_items_in_batch, not their mean."
        )
    if trainer.compute_loss_func is not None:
        return (
            f"compute_loss_func is given num_items_in_batch={int(count)} (the window's count) "
            "and Trainer does not divide what it returns: it must return the sum of its terms "
            "divided by num_items_in_batch, as bigbatch.integrations.hf.token_loss() does."
        )
    if _counts_unshifted(trainer, window[0]):
        return (
            "Trainer counted labels, not the labels[..., 1:] a causal LM predicts (the model "
            "declares no causal-LM loss_type): one token per sequence too many. Wrap the "
            "collator: data_collator=bigbatch.integrations.hf.shift_labels_collator(collator)."
        )
    return (
        f"The model's loss is given num_items_in_batch={count!s} and is not the sum of its "
        "terms divided by it (a forward that takes **kwargs and returns its own mean, or a "
        "loss that couples the samples of a batch): give Trainer compute_loss_func="
        "bigbatch.integrations.hf.token_loss()."
    )


def _counts_unshifted(trainer: Any, batch: Any) -> bool:
    """Whether ``trainer`` counted a causal LM's labels whole where its loss predicts
    ``labels[..., 1:]``: a model that generates, without a causal-LM ``loss_type``."""
    generates = getattr(trainer.model, "can_generate", lambda: False)()
    return (
        bool(generates)
        and not getattr(trainer, "_loss_shifts_labels", True)
        and "shift_labels" not in batch
    )
