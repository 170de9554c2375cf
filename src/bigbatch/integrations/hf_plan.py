"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` set from a plan of ``bigbatch plan --hf``
(:func:`bigbatch.memory.lm.plan_lm`): the batch sizes and the arguments that make the run the
one the plan traced (:func:`with_plan`, :func:`trainer_arguments`), the model's loading
arguments (:func:`model_arguments`, :func:`quantization_arguments`), and the checks that refuse,
in one line with the fix, arguments the plan does not hold (the model's are in
:mod:`bigbatch.integrations.hf_model_check`). Imported from :mod:`bigbatch.integrations.hf`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from bigbatch.integrations import require

require("transformers", "hf")

__all__ = [
    "model_arguments",
    "quantization_arguments",
    "trainer_arguments",
    "trainer_batch_sizes",
    "with_plan",
]


def trainer_batch_sizes(
    global_batch: int, max_micro_batch: int, world_size: int = 1
) -> tuple[int, int]:
    """``(per_device_train_batch_size, gradient_accumulation_steps)`` for ``global_batch``
    sequences a step over ``world_size`` ranks: the largest micro-batch up to
    ``max_micro_batch`` that divides each rank's share (Trainer's micro-batches are all one
    size), so that micro-batch x accumulation x ranks is ``global_batch`` exactly.

    >>> trainer_batch_sizes(64, 6, world_size=2)  # 32 a rank: 4 x 8, not 6 x 6 (36)
    (4, 8)
    """
    if global_batch < 1 or max_micro_batch < 1 or world_size < 1:
        raise ValueError("the global batch, micro-batch and ranks must be positive")
    if global_batch % world_size:
        raise ValueError(
            f"a global batch of {global_batch} does not split over {world_size} ranks: give a "
            f"multiple of {world_size}"
        )
    per_rank = global_batch // world_size
    micro = max(m for m in range(1, min(max_micro_batch, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


# Trainer's optimizers (``TrainingArguments.optim``) by the optimizer a plan traces for each
# (bigbatch.memory.step.make_optimizer's names); the first of each is the one to name.
_TRAINER_OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw_fused",
    "adamw_8bit": "adamw_8bit",
    "adamw_bnb_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
    "sgd": "sgd",
    "rmsprop": "rmsprop",
    "adagrad": "adagrad",
}


def trainer_arguments(plan: Any) -> dict[str, Any]:
    """The fields of ``TrainingArguments`` (TRL's ``SFTConfig``) that ``plan`` (an
    :class:`~bigbatch.memory.lm.LMPlan`) holds for: :func:`with_plan`'s micro-batch,
    accumulation and evaluation batch (at most the micro-batch where not planned), the
    precision it traced (``bf16``, ``fp16``), its optimizer as Trainer names it (``optim``:
    Trainer's default where the plan holds for it, as an ``adamw`` plan does for the fused
    AdamW of transformers 5; None for one Trainer has no name for) and, where it counts on
    checkpointing (without FSDP2, whose checkpointing is accelerate's ``fsdp_config``'s),
    ``activation_checkpointing=True`` (``gradient_checkpointing`` before transformers 5), and
    the ``label_smoothing_factor`` it traced, where it did (``--label-smoothing``).

    >>> import transformers
    >>> from bigbatch.memory.lm import LMSetup, plan_lm
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                num_attention_heads=4, vocab_size=100)
    >>> plan = plan_lm(cfg, LMSetup(seq_len=32, lora_r=4), 8, "64MB", device="cpu",
    ...                precision="fp32", overhead=0)
    >>> trainer_arguments(plan)
    {'per_device_train_batch_size': 8, 'gradient_accumulation_steps': 1, 'per_device_eval_batch_size': 8, 'bf16': False, 'fp16': False, 'optim': 'adamw_torch_fused'}
    """
    micro, steps = trainer_batch_sizes(
        plan.global_batch, plan.plan.max_micro_batch, plan.setup.world_size
    )
    traced = plan.plan.prediction
    said = {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": steps,
        "per_device_eval_batch_size": _planned_eval_batch(plan, micro),
        "bf16": traced.precision == "bf16",
        "fp16": traced.precision == "fp16",
        "optim": _trainer_optim(traced.optimizer),
    }
    if plan.setup.sharded:
        said["fsdp"] = True  # FSDP2: transformers 5's default version
    if getattr(plan.setup, "label_smoothing", 0.0):
        said["label_smoothing_factor"] = plan.setup.label_smoothing
    return said | _checkpointing_argument(plan)


def _checkpointing_argument(plan: Any, args: Any = None) -> dict[str, Any]:
    """Trainer's checkpointing flag, on, where ``plan`` counts on checkpointing and ``args``
    (where given) have it off: ``activation_checkpointing`` (``gradient_checkpointing``
    before transformers 5). Not for FSDP2, which checkpoints through accelerate's
    ``fsdp_config`` (transformers warns against the argument there)."""
    if not plan.setup.gradient_checkpointing or plan.setup.fsdp:
        return {}
    if args is not None:  # the transformers that made them named it
        new = hasattr(args, "activation_checkpointing")
    else:
        import transformers

        new = "activation_checkpointing" in {
            f.name for f in dataclasses.fields(transformers.TrainingArguments)
        }
    name = "activation_checkpointing" if new else "gradient_checkpointing"
    if args is not None and getattr(args, name, False):
        return {}
    said: dict[str, Any] = {name: True}
    if args is not None and name == "gradient_checkpointing":
        # Before transformers 5, Trainer's default was reentrant checkpointing; the plan
        # traced the non-reentrant kind (transformers 5's default).
        said["gradient_checkpointing_kwargs"] = getattr(
            args, "gradient_checkpointing_kwargs", None
        ) or {"use_reentrant": False}
    return said


# A plan traced with the multi-tensor AdamW holds for the fused one too: the same state, and
# no update temporaries (its step counts, 512-byte blocks each on the card, are what it adds).
_ALSO_HOLDS_FOR = {"adamw": ("adamw_fused",)}


def _trainer_optim(optimizer: str) -> str | None:
    """Trainer's name for a plan's optimizer (None: Trainer has none for it): Trainer's own
    default where the plan holds for it (an ``adamw`` plan and transformers' fused AdamW, its
    default from torch 2.8: naming the multi-tensor one would slow the user's run for
    nothing), else the first that runs the plan's optimizer."""
    holds = (optimizer, *_ALSO_HOLDS_FOR.get(optimizer, ()))
    names = [k for k, v in _TRAINER_OPTIMIZERS.items() if v in holds]
    default = _trainers_default_optim()
    if default in names:
        return default
    return next((k for k in names if _TRAINER_OPTIMIZERS[k] == optimizer), None)


def _trainers_default_optim() -> str | None:
    """``TrainingArguments.optim``'s default in the transformers installed (None without
    one)."""
    try:
        import transformers
    except ImportError:
        return None
    field = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}.get("optim")
    default = getattr(field, "default", None)
    return None if default is None else str(getattr(default, "value", default))


def with_plan(args: Any, plan: Any) -> Any:
    """``args`` (``TrainingArguments``, TRL's ``SFTConfig``) with the micro-batch and the
    accumulation of ``plan`` (an :class:`~bigbatch.memory.lm.LMPlan`), for its global batch,
    and its evaluation batch (``per_device_eval_batch_size``: Trainer's default of 8 sequences
    runs out of memory beside an 8B model at 2048 tokens, by its logits alone; where the plan
    has none, at most the micro-batch), and Trainer's activation checkpointing on where the
    plan counts on it (:func:`trainer_arguments` names the flag). Refuses the arguments of
    TRL's trainers whose step is not a plan's (DPO's preference pairs, GRPO's generations),
    arguments that change the global batch on running out of memory (``auto_find_batch_size``)
    or count each rank's tokens apart (``average_tokens_across_devices=False``), arguments for
    another number of ranks than the plan's or that shard otherwise (DDP where it planned
    FSDP2's shards, FSDP where it planned DDP, weights kept gathered after each forward) or
    that place memory where it did not (DeepSpeed, CPU offload, checkpointing only every n-th
    layer), TRL's arguments that let sequences run past the plan's length (``max_length`` over
    ``--seq-len``, or ``None``: the plan's micro-batch would not hold them), arguments that
    smooth the labels where the plan did not (``label_smoothing_factor``: Trainer then takes
    the whole logits in float32) or the other way round, and arguments that compute in another
    precision or train with another optimizer than the plan traced (:func:`trainer_arguments`
    names the plan's): the plan would not hold for them.

    >>> from types import SimpleNamespace
    >>> from bigbatch.memory.lm import LMSetup
    >>> plan = SimpleNamespace(global_batch=32, setup=LMSetup(seq_len=512),
    ...                        plan=SimpleNamespace(max_micro_batch=6))
    >>> args = SimpleNamespace(world_size=1, per_device_train_batch_size=8,
    ...                        gradient_accumulation_steps=1)
    >>> new = with_plan(args, plan)
    >>> new.per_device_train_batch_size, new.gradient_accumulation_steps
    (4, 8)
    """
    _check_trainer_kind(args)  # first: its other settings would be judged as an SFT run's
    ranks = _ranks(args)
    if ranks != plan.setup.world_size:
        raise ValueError(
            f"the plan is for {plan.setup.world_size} rank(s) and these arguments run on "
            f"{ranks}: plan with --world-size {ranks}"
        )
    limit, planned = getattr(args, "max_length", None), plan.setup.seq_len  # TRL truncates there
    # TRL wants max_length=None where padding_free runs without packing (it cannot truncate
    # there: the inputs come truncated), so that None says nothing of the lengths.
    free_alone = getattr(args, "padding_free", False) and not getattr(args, "packing", False)
    if limit is None and "SFTConfig" in _trl_classes(args) and not free_alone:
        raise ValueError(
            f"these arguments set max_length=None, under which SFTTrainer truncates no sequence, "
            f"and one past the plan's {planned} tokens would not fit its micro-batch (nor would "
            f"halving it help): set max_length={planned} (a no-op for data within it), or plan "
            "with --seq-len of the longest"
        )
    if isinstance(limit, int) and limit > planned:
        raise ValueError(
            f"these arguments let sequences run to max_length={limit} tokens, past the plan's "
            f"{planned}: set max_length={planned}, or plan with --seq-len {limit}"
        )
    _check_arguments(plan, args, eval_batch=False)  # its evaluation batch is set here
    micro, steps = trainer_batch_sizes(plan.global_batch, plan.plan.max_micro_batch, ranks)
    eval_batch = _planned_eval_batch(plan, micro, _eval_batch(args))
    checkpointing = _checkpointing_argument(plan, args)
    return with_sizes(args, micro, steps, eval_batch=eval_batch, **checkpointing)


def model_arguments(plan: Any) -> dict[str, Any]:
    """The keyword arguments of ``AutoModelForCausalLM.from_pretrained`` that load the model
    ``plan`` (an :class:`~bigbatch.memory.lm.LMPlan`) describes: its weights' ``dtype``, its
    ``attn_implementation`` and, for ``--qlora``, bitsandbytes' ``quantization_config``
    (:func:`quantization_arguments`'s). Its adapters: ``lora_config(plan.setup)``
    (:func:`~bigbatch.memory.lm.lora_config`). A plan names the attention it traced (``auto``,
    never planned so, leaves it to transformers).

    >>> from types import SimpleNamespace
    >>> from bigbatch.memory.lm import LMSetup
    >>> plan = SimpleNamespace(setup=LMSetup(seq_len=1024, lora_r=16, dtype="fp16", attn="sdpa"))
    >>> model_arguments(plan)
    {'dtype': torch.float16, 'attn_implementation': 'sdpa'}
    """
    kwargs: dict[str, Any] = {"dtype": _planned_dtype(plan)}
    if plan.setup.attn != "auto":
        kwargs["attn_implementation"] = plan.setup.attn
    if plan.setup.quant:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(**quantization_arguments(plan))
    return kwargs


def quantization_arguments(plan: Any) -> dict[str, Any]:
    """The keyword arguments of transformers' ``BitsAndBytesConfig`` for a ``--qlora`` plan
    (an :class:`~bigbatch.memory.lm.LMPlan`): 4-bit NF4, double-quantized as planned and
    computing in the plan's 16-bit dtype (bitsandbytes' default, float32, doubles every
    dequantized weight), packed in the plan's storage dtype where it is not bitsandbytes'
    uint8 (under FSDP2: a 16-bit dtype, which it shards), or LLM.int8; empty for a plan
    without a quantized base.

    >>> from types import SimpleNamespace
    >>> from bigbatch.memory.lm import LMSetup
    >>> quantization_arguments(SimpleNamespace(setup=LMSetup(512, lora_r=16, quant=4, dtype="fp16")))
    {'load_in_4bit': True, 'bnb_4bit_quant_type': 'nf4', 'bnb_4bit_use_double_quant': True, 'bnb_4bit_compute_dtype': torch.float16}
    >>> fsdp = LMSetup(512, lora_r=16, quant=4, dtype="bf16", world_size=8, fsdp=True)
    >>> quantization_arguments(SimpleNamespace(setup=fsdp))["bnb_4bit_quant_storage"]
    torch.bfloat16
    """
    from bigbatch.memory.lm import quant_compute_dtype, quant_storage_dtype

    setup = plan.setup
    if setup.quant == 8:
        return {"load_in_8bit": True}
    if setup.quant != 4:
        return {}
    dtype = _planned_dtype(plan)
    if dtype == "auto":
        raise ValueError(
            "this plan, saved by an older bigbatch, does not record the weights' dtype that sets "
            "the 4-bit layers' compute dtype: plan again (bigbatch plan --hf ... --save), or plan "
            "with --dtype"
        )
    kwargs = {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": setup.double_quant,
        "bnb_4bit_compute_dtype": quant_compute_dtype(dtype),
    }
    storage = quant_storage_dtype(setup, _plan_precision(plan))
    if storage != torch.uint8:  # bitsandbytes' default
        kwargs["bnb_4bit_quant_storage"] = storage
    return kwargs


def _prediction(plan: Any) -> Any:
    """The plan's traced prediction, or None for a plan without one (as tests build them)."""
    return getattr(getattr(plan, "plan", None), "prediction", None)


def _plan_precision(plan: Any) -> str:
    """The precision the plan traced (bf16 where a stand-in plan does not say)."""
    return str(getattr(_prediction(plan), "precision", "") or "bf16")


def _planned_dtype(plan: Any) -> Any:
    """The weights' dtype as planned: ``--dtype``, or the config's the plan recorded; "auto"
    (transformers reads the config's, as the planner did) for a plan saved before it was."""
    from bigbatch.memory.lm import weights_dtype

    if plan.setup.dtype != "auto":
        return weights_dtype(None, plan.setup)
    held = getattr(plan, "weights_dtype", "")
    return getattr(torch, held) if held else "auto"


def _planned_eval_batch(plan: Any, micro: int, asked: int | None = None) -> int:
    """The plan's evaluation batch; where it planned none (``plan_lm(..., evaluation=False)``,
    or a plan an earlier bigbatch saved under torchrun with FSDP2), at most the training
    micro-batch: a forward pass without gradients of what a training step held fits where
    that step does, and Trainer's default of 8 may not."""
    planned = getattr(plan, "eval_batch", None)
    if planned is not None:
        return int(planned)
    return min(micro, asked) if asked else micro


def _described(plan: Any) -> str:
    """The plan as its refusals name it: its model and its fine-tune."""
    return ", ".join(x for x in (getattr(plan, "source", ""), plan.setup.describe()) if x)


def _trl_classes(args: Any) -> list[str]:
    """The names of TRL's classes among ``args``' own and its bases' (``["SFTConfig"]``)."""
    return [c.__name__ for c in type(args).__mro__ if c.__module__.split(".")[0] == "trl"]


def _check_trainer_kind(args: Any) -> None:
    """Refuse the arguments of TRL's trainers whose step is not the one a plan traces (a
    causal LM's loss over each sequence, Trainer's or SFTTrainer's): a preference pair's two
    sequences (DPO, ORPO, KTO, CPO), a reference model's forward, a reward model's head,
    generations (GRPO, RLOO, PPO) hold more than the plan has."""
    from_trl = _trl_classes(args)
    if from_trl and "SFTConfig" not in from_trl:
        name = type(args).__name__
        raise ValueError(
            f"these are the arguments of TRL's {from_trl[0].removesuffix('Config')} trainer "
            f"({name}), whose step holds more than a plan traces (a causal LM's loss over "
            "each sequence, as Trainer and SFTTrainer run it; not preference pairs, a "
            "reference model, a reward head or generations): bigbatch plans supervised "
            "fine-tunes (TrainingArguments, SFTConfig); set this trainer's sizes yourself"
        )


def _check_arguments(plan: Any, args: Any, *, eval_batch: bool = True) -> None:
    """Refuse ``args`` that change the global batch or its count (:func:`_check_counts`),
    make another loss (:func:`_check_loss`), shard otherwise, compute in another precision,
    or train with another optimizer, than the plan traced, or (with ``eval_batch``) evaluate
    more sequences a pass than it planned (but the sharding, a plan without its prediction, as
    tests build one, is let be)."""
    _check_trainer_kind(args)
    _check_counts(args)
    _check_loss(plan, args)
    _check_sharding(plan, args)
    _check_placement(plan, args)
    _check_packing(plan, args)
    traced = _prediction(plan)
    if traced is None:
        return
    described = _described(plan)
    optim = getattr(args, "optim", None)
    optim = str(getattr(optim, "value", optim))  # Trainer's is an enum of its names
    want = _trainer_optim(traced.optimizer)
    ran = _TRAINER_OPTIMIZERS.get(optim)
    holds = ran == traced.optimizer or ran in _ALSO_HOLDS_FOR.get(traced.optimizer, ())
    if optim != "None" and not holds:
        fix = f"set optim={want!r}" if want else "plan with an optimizer Trainer has"
        if optim in _TRAINER_OPTIMIZERS:
            fix += f", or plan with --optimizer {_TRAINER_OPTIMIZERS[optim]}"
        else:
            fix += f" (bigbatch plans {', '.join(_TRAINER_OPTIMIZERS)})"
        raise ValueError(
            f"the plan ({described}) traces the {traced.optimizer} optimizer and these "
            f"arguments train with optim={optim!r}: {fix}"
        )
    ran = next((p for p in ("bf16", "fp16") if getattr(args, p, False)), "fp32")
    # bf16 and fp16 hold the same bytes; autocast or not changes the activations' dtype and,
    # for float32 weights, adds their 16-bit copies.
    if (ran == "fp32") != (traced.precision == "fp32"):
        fix = f"set {traced.precision}=True"
        if traced.precision == "bf16":
            fix += " (fp16=True on a card without bfloat16 units)"
        if ran != "fp32":
            fix = "set bf16=False and fp16=False"
        raise ValueError(
            f"the plan ({described}) computes in {traced.precision} and these arguments in "
            f"{ran}: {fix}, or plan with --precision {ran}"
        )
    if eval_batch:
        _check_eval_batch(plan, args, described)


# TRL's packing strategies that put a micro-batch's sequences in one row (padding_free); its
# "wrapped" one cuts rows of max_length, padded rows' shape.
_ONE_ROW_PACKINGS = ("bfd", "bfd_split", "bfd-requeue")


def _one_row_packing(args: Any) -> str | None:
    """Why ``args`` (TRL's ``SFTConfig``) put each micro-batch's sequences in one row with
    ``position_ids`` that restart at each (the plan's ``--packing``), or ``None`` where they
    pad them: ``padding_free=True``, or ``packing=True`` with the ``bfd`` strategies that
    imply it.

    >>> from types import SimpleNamespace
    >>> _one_row_packing(SimpleNamespace(packing=True, packing_strategy="bfd"))
    'packing=True (its bfd strategy is padding-free)'
    >>> _one_row_packing(SimpleNamespace(packing=True, packing_strategy="wrapped")) is None
    True
    """
    if getattr(args, "padding_free", False):
        return "padding_free=True"
    strategy = getattr(args, "packing_strategy", "bfd")
    if getattr(args, "packing", False) and strategy in _ONE_ROW_PACKINGS:
        return f"packing=True (its {strategy} strategy is padding-free)"
    return None


def _check_packing(plan: Any, args: Any) -> None:
    """Refuse ``args`` that put a micro-batch's sequences in one row under a plan that pads
    them: another step than the plan traced. SDPA's and eager attention's mask then spans the
    whole row (for 8 sequences, 8 times a padded micro-batch's mask: 1.76x its peak with SDPA
    for a small Llama at 256 tokens, more for longer ones); flash_attention_2's row, one
    sequence of the row's length to the allocator, reserved more than its padded plan (5.46
    GiB against 4.76 for 2 x 4096 tokens on a 4-layer Llama of 512). A plan of one row bounds
    padded sequences from above and is let be."""
    one_row = _one_row_packing(args)
    if one_row is None or getattr(plan.setup, "packing", False):
        return
    raise ValueError(
        f"the plan ({_described(plan)}) pads each micro-batch's sequences and these arguments "
        f"put them in one row ({one_row}), another step than the plan traced: plan with "
        "--packing, or set packing=False and padding_free=False"
    )


def _check_loss(plan: Any, args: Any) -> None:
    """Refuse ``args`` whose loss is not the big batch's under accumulation (label smoothing in
    a transformers whose LabelSmoother divides each micro-batch by its own token count) or
    makes other tensors than the plan's: label smoothing where the plan traced none (Trainer's
    LabelSmoother takes the whole logits in float32) or none where it traced some, and a plan
    of TRL's fused LM head (``--loss trl``) for a run whose loss makes the whole logits
    instead, which its micro-batch would not hold: Trainer's arguments, or a TRL without that
    head."""
    from bigbatch.memory.lm_model import _smoother_counts_tokens
    from bigbatch.memory.lm_setup import _check_loss as check_this_trl

    planned = getattr(plan.setup, "label_smoothing", 0.0)
    factor = _smoothing(args)
    if factor and not _smoother_counts_tokens():
        import transformers

        raise ValueError(
            f"these arguments smooth the labels (label_smoothing_factor={factor}), and the "
            f"LabelSmoother of transformers {transformers.__version__} divides each "
            "micro-batch by its own token count, so the accumulated update is not the big "
            "batch's: pip install 'transformers>=5.15', or set label_smoothing_factor=0"
        )
    if factor and not planned:
        raise ValueError(
            f"these arguments smooth the labels (label_smoothing_factor={factor}) and the plan "
            "does not: Trainer's LabelSmoother takes the whole logits in float32, which its "
            f"micro-batch would not hold: plan with --label-smoothing {factor:g}"
        )
    if planned and not factor:
        raise ValueError(
            f"the plan traces label smoothing ({planned:g}) and these arguments do not smooth: "
            f"set label_smoothing_factor={planned:g} (trainer_arguments(plan) names it), or "
            "plan without --label-smoothing"
        )
    if getattr(plan.setup, "loss", "model") != "trl":
        return
    if "SFTConfig" not in _trl_classes(args):
        raise ValueError(
            f"the plan traces TRL's fused LM head (SFTTrainer's loss) and these are "
            f"{type(args).__name__}, whose loss is the model's own over the whole logits, "
            "which its micro-batch would not hold: plan with --loss model, or train with TRL's "
            "SFTTrainer"
        )
    check_this_trl(plan.setup)  # the TRL that trains has the head the plan traced


def _smoothing(args: Any) -> float:
    """The label smoothing ``args`` train with: ``label_smoothing_factor``, which TRL's
    SFTTrainer applies only to its default loss (``loss_type="nll"``)."""
    factor = float(getattr(args, "label_smoothing_factor", 0) or 0)
    if "SFTConfig" in _trl_classes(args) and getattr(args, "loss_type", "nll") != "nll":
        return 0.0
    return factor


def _check_counts(args: Any) -> None:
    """Refuse the two arguments of Trainer's that break the update a plan keeps, each without
    a word: ``auto_find_batch_size`` (on running out of memory, Trainer starts its loop again
    at 90 % of the micro-batch with the same accumulation: another global batch, from its
    first step, with the weights it had trained so far), and over several ranks
    ``average_tokens_across_devices=False`` (each rank divides its loss by its own token
    count, and the ranks' gradients are averaged: the big batch's update only where every
    rank holds as many tokens)."""
    if getattr(args, "auto_find_batch_size", False):
        raise ValueError(
            "these arguments set auto_find_batch_size=True, which on running out of memory "
            "starts training again at 90 % of the micro-batch and the same accumulation (another "
            "global batch): set auto_find_batch_size=False (train_with_backoff halves the "
            "micro-batch and doubles the accumulation, the same update)"
        )
    ranks = _ranks(args)
    if ranks > 1 and getattr(args, "average_tokens_across_devices", True) is False:
        raise ValueError(
            f"these arguments set average_tokens_across_devices=False over {ranks} ranks: each "
            "rank divides its loss by its own token count, not the global batch's, and ranks "
            "holding different numbers of tokens give another update: set "
            "average_tokens_across_devices=True (Trainer's default)"
        )


_SHARDING = {"full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2"}


_ARGS = "these arguments"


def _fsdp_settings(args: Any) -> tuple[set[str], dict[str, Any], str]:
    """The FSDP that Trainer runs with ``args``: its options (``full_shard``, ...), its
    config, and where they come from: the arguments (``fsdp``, ``fsdp_config``), else
    ``accelerate launch``'s FSDP config, which reaches Trainer through the environment
    (``ACCELERATE_USE_FSDP``, ``FSDP_*``; accelerate's default version there is 1)."""
    fsdp = getattr(args, "fsdp", None)  # True (transformers 5), or the older options
    if isinstance(fsdp, bool) or fsdp is None:
        options = {"full_shard"} if fsdp else set()
    elif isinstance(fsdp, str):
        options = set(fsdp.split())
    else:
        options = {str(getattr(o, "value", o)) for o in fsdp}
    if options or os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return options, dict(getattr(args, "fsdp_config", None) or {}), _ARGS
    env = os.environ
    config = {
        "version": env.get("FSDP_VERSION", "1"),
        "reshard_after_forward": env.get("FSDP_RESHARD_AFTER_FORWARD", "true"),
        "cpu_offload": env.get("FSDP_OFFLOAD_PARAMS", "false"),
    }
    return {"full_shard"}, config, "accelerate launch's FSDP settings"


def _check_sharding(plan: Any, args: Any) -> None:
    """Refuse arguments over several ranks that shard otherwise than the plan: DDP where it
    planned FSDP2's shards (each rank would hold the whole model), FSDP where it planned DDP's
    copies, FSDP's version 1, or weights kept gathered after each forward (``shard_grad_op``,
    ``reshard_after_forward=False``) where it traced them freed."""
    setup = plan.setup
    if setup.world_size <= 1:
        return
    options, config, where = _fsdp_settings(args)
    shards = bool(options & _SHARDING)
    version = _fsdp_version(config)
    reshards = str(config.get("reshard_after_forward", "shard_grad_op" not in options))
    ranks = setup.world_size
    if setup.fsdp and not shards:
        raise ValueError(
            f"the plan shards the model over {ranks} ranks with FSDP2 and {where} "
            "hold it whole on each rank (DDP): set fsdp=True (FSDP2, transformers 5's "
            "default version), or plan without --fsdp"
        )
    if shards and not setup.fsdp:
        raise ValueError(
            f"the plan is for DDP over {ranks} ranks (the model whole on each) and {where} "
            "shard it with FSDP: plan with --fsdp, or "
            + ("leave fsdp unset" if where == _ARGS else "launch without FSDP")
        )
    if shards and version != 2:
        raise ValueError(
            f"the plan traced FSDP2 and {where} run FSDP version {version}: set "
            + ("fsdp_config={'version': 2}" if where == _ARGS else "fsdp_version: 2 there")
        )
    if shards and reshards.lower() not in ("true", "1"):
        raise ValueError(
            "the plan traced FSDP2 freeing each unit's gathered weights after its forward and "
            f"{where} keep them (reshard_after_forward=False, shard_grad_op): set "
            + (
                "fsdp_config={'reshard_after_forward': True}"
                if where == _ARGS
                else "fsdp_reshard_after_forward: true there"
            )
        )


def _check_placement(plan: Any, args: Any) -> None:
    """Refuse arguments that place the step's memory otherwise than the plan traced it, each of
    which Trainer would run without a word: DeepSpeed (its ZeRO partitions and buckets), FSDP's
    CPU offload (shards held on the host), activations offloaded to the host (TRL's
    ``activation_offloading``, or checkpointed ones), or checkpointing only every n-th layer
    where the plan checkpoints each (what the others keep would not fit the plan's micro-batch).
    Offloading would hold less than the plan, which then picked a micro-batch without it: the
    slower steps would buy nothing."""
    deepspeed = getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None)
    if deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise ValueError(
            "this run trains with DeepSpeed, whose ZeRO partitions and buffers a plan does not "
            "trace: shard with FSDP2 instead (fsdp=True; plan with --fsdp --world-size N), or "
            "leave DeepSpeed out (deepspeed=, accelerate launch's DeepSpeed config)"
        )
    options, config, where = _fsdp_settings(args)
    offloads = str(config.get("cpu_offload", False)).lower() in ("true", "1")
    if "offload" in options or (offloads and options & _SHARDING):
        raise ValueError(
            f"{where} offload FSDP's shards to the CPU (cpu_offload), which a plan does not "
            "trace (it holds each rank's shards on the card, and its micro-batch fits so): "
            "drop the offload"
        )
    if getattr(args, "activation_offloading", False) is True:
        raise ValueError(
            "these arguments offload the activations to the CPU (SFTConfig "
            "activation_offloading=True), which a plan does not trace (its micro-batch fits with "
            "them on the card, and offloading would only slow it): drop activation_offloading"
        )
    kwargs = _checkpointing_kwargs(args)
    checkpoints = plan.setup.gradient_checkpointing or any(
        getattr(args, name, False) is True
        for name in ("activation_checkpointing", "gradient_checkpointing")
    )
    if checkpoints and str(kwargs.get("offload", False)).lower() in ("true", "1"):
        raise ValueError(
            "these arguments offload the checkpointed activations to the host "
            "(activation_checkpointing_kwargs offload=True), which a plan does not trace (its "
            "micro-batch fits with them on the card): drop offload"
        )
    every = int(kwargs.get("every_n_layers", 1))
    if every > 1 and plan.setup.gradient_checkpointing:
        raise ValueError(
            f"the plan checkpoints every decoder layer and these arguments one in {every} "
            f"(activation_checkpointing_kwargs every_n_layers={every}): the others' "
            "activations would not fit its micro-batch; drop every_n_layers"
        )


def _checkpointing_kwargs(args: Any) -> dict[str, Any]:
    """Trainer's checkpointing keywords (``activation_checkpointing_kwargs``;
    ``gradient_checkpointing_kwargs`` before transformers 5), a dict (also from JSON text)."""
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        kwargs = getattr(args, name, None)
        if isinstance(kwargs, str):
            import json

            kwargs = json.loads(kwargs)
        if isinstance(kwargs, dict) and kwargs:
            return kwargs
    return {}


def _fsdp_version(config: Any) -> int:
    """The FSDP version Trainer runs for ``fsdp_config``: the one it names (``version``, or
    ``fsdp_version`` where TrainingArguments has not yet stripped the prefix), else its
    transformers' default: FSDP2 from transformers 5, version 1 before."""
    named = config.get("version", config.get("fsdp_version"))
    if named is not None:
        return int(named)
    return 2 if _transformers_major() >= 5 else 1


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _check_eval_batch(plan: Any, args: Any, described: str) -> None:
    """Refuse an evaluation batch over the plan's where Trainer evaluates (it would run out of
    memory at the first evaluation, after training up to it)."""
    planned = getattr(plan, "eval_batch", None)
    strategy = getattr(args, "eval_strategy", "no")
    if planned is None or str(getattr(strategy, "value", strategy)) == "no":
        return
    if _eval_batch(args) > planned:
        raise ValueError(
            f"per_device_eval_batch_size={_eval_batch(args)} is over the plan's evaluation "
            f"batch ({described}: {planned}): set per_device_eval_batch_size={planned} "
            "(with_plan does)"
        )


def _ranks(args: Any) -> int:
    """The ranks ``args`` train on (``TrainingArguments.world_size``; 1 without it)."""
    return int(getattr(args, "world_size", 1) or 1)


def _eval_batch(args: Any) -> int:
    """Trainer's evaluation batch a rank (its default 8 where ``args`` has none)."""
    return int(getattr(args, "per_device_eval_batch_size", 8) or 8)


def with_sizes(
    args: Any,
    micro_batch: int,
    accumulation: int,
    *,
    eval_batch: int | None = None,
    **other: Any,
) -> Any:
    """``args`` with another micro-batch and accumulation, and evaluation batch where given
    (a copy for a dataclass), and the ``other`` fields given."""
    changes = {
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": accumulation,
        **other,
    }
    if eval_batch is not None:
        changes["per_device_eval_batch_size"] = eval_batch
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        return dataclasses.replace(args, **changes)
    for key, value in changes.items():
        setattr(args, key, value)
    return args
