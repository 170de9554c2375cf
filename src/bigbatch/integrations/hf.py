"""Hugging Face Transformers: the right count for token losses in ``Trainer`` and your own loop.

- **Your own loop**: a causal LM called with ``labels=`` shifts them inside and predicts
  ``labels[..., 1:]``: ``acc.backward(out.loss, labels=labels, shift=True)``.
- **``Trainer`` with a Transformers causal LM**: transformers >= 4.46 passes the window's token
  count (``num_items_in_batch``) to the model's loss, but counts ``labels[..., 1:]`` only when
  the model declares a causal-LM ``loss_type``. GPT-2 (``GPT2LMHeadModel``) and other models
  whose class name does not end in ``ForCausalLM`` leave it unset (transformers warns
  "loss_type=None ... unrecognized"): Trainer then counts one label per sequence too many and
  every update is scaled down (by 12.8 % in ``tests/integrations/test_hf.py``). Wrap the
  collator: ``Trainer(..., data_collator=shift_labels_collator(collator))`` adds the shifted
  labels as ``shift_labels``, which Trainer counts and the model's loss uses as they are.
- **``Trainer`` with a model of your own** whose forward returns a mean loss: ``Trainer`` cannot
  pass it the window's count, so it divides each micro-batch's mean by
  ``gradient_accumulation_steps``, which is wrong as soon as micro-batches hold different numbers
  of tokens. Give ``Trainer`` the loss instead: ``Trainer(..., compute_loss_func=token_loss())``
  sums the token losses and divides by the window's count.
- **A plan for Trainer and TRL**: :func:`with_plan` sets ``per_device_train_batch_size`` and
  ``gradient_accumulation_steps`` of ``TrainingArguments`` (or TRL's ``SFTConfig``) from
  ``bigbatch plan --hf``'s plan (:func:`bigbatch.memory.lm.plan_lm`) for the global batch
  asked, which they never change; :class:`MemoryBudget` caps CUDA's allocator at the budget,
  measures the first steps and refits the micro-batch from them (Trainer's is fixed for a run:
  it stops at a checkpoint); :func:`train_with_backoff` goes on from there at the new sizes, and
  retries an out-of-memory run at half the micro-batch and twice the accumulation from
  Trainer's last checkpoint, the same update.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bigbatch.integrations import require
from bigbatch.integrations.hf_verify import _overrides, verify_trainer

require("transformers", "hf")

__all__ = [
    "MemoryBudget",
    "check_evaluation_held",
    "check_plan_matches",
    "check_trainer",
    "model_arguments",
    "quantization_arguments",
    "refit_sizes",
    "shift_labels_collator",
    "step_need_bytes",
    "token_loss",
    "train_with_backoff",
    "trainer_arguments",
    "trainer_batch_sizes",
    "verify_trainer",
    "with_plan",
]


def token_loss(
    *, ignore_index: int = -100, logits_key: str = "logits", labels_shifted: bool = False
) -> Callable[[Any, torch.Tensor, Any], torch.Tensor]:
    """A ``compute_loss_func`` for ``Trainer``: token cross-entropy summed over the micro-batch
    and divided by the window's label count (``num_items_in_batch``), so the accumulated gradient
    equals the big batch's whatever the padding.

    Labels are used as they come (no shift): a model of your own that predicts the next token
    should get labels already shifted by its collator, because ``Trainer`` counts shifted labels
    only for Transformers' own causal-LM losses. On a Transformers causal LM's output (a
    ``...CausalLM...`` output class), whose usual labels are the input ids, unshifted labels
    would train it to predict the current token: that is refused unless you say the collator
    shifted them (``labels_shifted=True``). Such a model computes the right loss itself: drop
    ``compute_loss_func`` and see ``shift_labels_collator``.

    >>> loss = token_loss()
    >>> logits = torch.zeros(1, 3, 5); labels = torch.tensor([[1, 2, -100]])
    >>> round(float(loss({"logits": logits}, labels, num_items_in_batch=4)), 4)  # 2 of 4 tokens
    0.8047
    """

    def compute_loss(
        outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        if labels is None:
            raise ValueError(
                "token_loss got no labels: the batches need a 'labels' entry (ignore_index for "
                "padding)"
            )
        if num_items_in_batch is None:
            raise ValueError(
                "Trainer passed no num_items_in_batch, so the window's token count is unknown: "
                "use transformers >= 4.46 and give the batches a 'labels' entry"
            )
        if not labels_shifted and "CausalLM" in type(outputs).__name__:
            raise ValueError(
                f"token_loss got a causal LM's output ({type(outputs).__name__}) and uses labels "
                "as they are, so input-id labels would train it to predict the current token. "
                "Drop compute_loss_func (the model's own loss shifts and counts right; wrap the "
                "collator with shift_labels_collator for models without a loss_type), or shift "
                "the labels in your collator and pass token_loss(labels_shifted=True)"
            )
        logits = outputs[logits_key] if isinstance(outputs, dict) else outputs[0]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # a sum over many tokens: not in half precision
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1).to(logits.device),
            ignore_index=ignore_index,
            reduction="sum",
        )
        return total / num_items_in_batch

    return compute_loss


def shift_labels_collator(
    collator: Callable[[list[Any]], dict[str, Any]], *, ignore_index: int = -100
) -> Callable[[list[Any]], dict[str, Any]]:
    """Wrap a ``Trainer`` collator so each batch also carries ``shift_labels``: the labels a
    causal LM predicts (``labels[..., 1:]``, padded with ``ignore_index``). Trainer counts them
    for ``num_items_in_batch`` and Transformers' causal-LM loss uses them instead of shifting.

    >>> collate = shift_labels_collator(lambda items: {"labels": torch.tensor(items)})
    >>> collate([[5, 6, 7]])["shift_labels"].tolist()
    [[6, 7, -100]]
    """

    def collate(items: list[Any]) -> dict[str, Any]:
        batch = collator(items)
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor):
            raise ValueError(
                "shift_labels_collator needs batches with a 'labels' tensor (the collator "
                f"returned {sorted(batch)})"
            )
        pad = torch.full_like(labels[..., :1], ignore_index)
        batch["shift_labels"] = torch.cat([labels[..., 1:], pad], dim=-1)
        return batch

    return collate


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


def _check_loss(plan: Any, args: Any) -> None:
    """Refuse ``args`` whose loss is not the big batch's under accumulation (label smoothing in
    a transformers whose LabelSmoother divides each micro-batch by its own token count) or
    makes other tensors than the plan's: label smoothing where the plan traced none (Trainer's
    LabelSmoother takes the whole logits in float32) or none where it traced some, and a plan
    of TRL's fused LM head (``--loss trl``) for a run whose loss makes the whole logits
    instead, which its micro-batch would not hold: Trainer's arguments, or a TRL without that
    head."""
    from bigbatch.memory.lm import _check_loss as check_this_trl
    from bigbatch.memory.lm import _smoother_counts_tokens

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


SIZES_FILE = "bigbatch-sizes.json"  # in the output folder: see _sizes_path


def _ranks(args: Any) -> int:
    """The ranks ``args`` train on (``TrainingArguments.world_size``; 1 without it)."""
    return int(getattr(args, "world_size", 1) or 1)


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


def check_plan_matches(plan: Any, model: Any, device: Any = None, args: Any = None) -> None:
    """Refuse, in one line with the fix, to train ``model`` (on ``device``, with Trainer's
    ``args``, where given) under a ``plan`` (an :class:`~bigbatch.memory.lm.LMPlan`, a loaded
    one too) made for another fine-tune: one for another kind of device (a CPU's plan for a
    CUDA run), one whose trained parameters are not the plan's number (another model, LoRA
    rank or targets, layers trained whole beside the adapters), whose weights take over 5 %
    more bytes than the plan's (loaded in float32 where the plan has the config's bfloat16)
    or that are in another dtype than a plan's own ``--dtype`` (bf16 where a T4's plan has
    fp16: the same bytes, emulated there), whose 4-bit layers compute in another dtype than
    the plan's (bitsandbytes' default float32: :func:`model_arguments` loads the plan's) or
    are not double-quantized where the plan's are,
    that runs without the gradient checkpointing the plan counted on (its activations
    several times the plan's), or arguments with another precision or optimizer (as
    :func:`with_plan` refuses them) or, where Trainer evaluates, an evaluation batch over the
    plan's. The plan would hold for none. :class:`MemoryBudget` checks this when training
    begins.

    >>> from types import SimpleNamespace
    >>> from torch import nn
    >>> from bigbatch.memory.lm import LMSetup
    >>> plan = SimpleNamespace(setup=LMSetup(seq_len=512, lora_r=8), source="my-model",
    ...                        sizes=SimpleNamespace(trainable_count=16))
    >>> check_plan_matches(plan, nn.Linear(4, 4))
    Traceback (most recent call last):
    ...
    ValueError: the plan (my-model, LoRA r=8 (all-linear), 512 tokens, padded) trains 16 parameters and this model 20: plan this fine-tune (bigbatch plan --hf ... --save), or train the one the plan describes
    """
    from bigbatch.memory.budget import format_bytes

    sizes, setup = getattr(plan, "sizes", None), getattr(plan, "setup", None)
    if sizes is None or setup is None:
        return
    described = _described(plan)
    planned_for = getattr(_prediction(plan), "device", "")
    kind = torch.device(device).type if device is not None else planned_for
    if planned_for and kind in ("cpu", "cuda") and kind != planned_for:  # the kinds planned
        raise ValueError(
            f"the plan ({described}) is for {planned_for} and this run trains on {kind}: plan "
            f"with --device {kind}"
        )
    fix = "plan this fine-tune (bigbatch plan --hf ... --save), or train the one the plan describes"
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trained != sizes.trainable_count:
        raise ValueError(
            f"the plan ({described}) trains {sizes.trainable_count:,} parameters and this model "
            f"{trained:,}: {fix}"
        )
    # Quantized bases are left out: bitsandbytes keeps part of their storage outside the
    # parameters (the quantization state), which the plan's stand-ins count in them. A few %
    # over is let through: norms some recipes keep in float32 weigh that little; a whole
    # model in float32 where the plan has 16-bit weights is twice the plan's.
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not setup.quant and weights > 1.05 * sizes.parameters:
        raise ValueError(
            f"the plan ({described}) has {format_bytes(sizes.parameters)} of weights and this "
            f"model {format_bytes(weights)}: load it in the dtype planned (--dtype; auto is the "
            "config's, from_pretrained(..., dtype=torch.bfloat16) for bf16), or plan with "
            "--dtype fp32"
        )
    _check_weights_dtype(plan, model, described)
    _check_quantized_layers(plan, model, described)
    _check_qlora_prep(plan, model, described)
    if args is not None:
        _check_arguments(plan, args)
    _check_checkpointing(plan, model, described)


def _check_checkpointing(plan: Any, model: Any, described: str) -> None:
    """A plan that counts on checkpointing every decoder layer against a model that runs
    without it, or with it on one layer in n (transformers' ``every_n_layers``)."""
    if not plan.setup.gradient_checkpointing:
        return
    # transformers' own flag, or torch's checkpoint wrappers (accelerate's FSDP
    # activation_checkpointing wraps the decoder layers in them).
    checkpointing = any(
        getattr(m, "gradient_checkpointing", False) is True
        or hasattr(m, "_checkpoint_wrapped_module")
        for m in model.modules()
    )
    if not checkpointing:
        raise ValueError(
            f"the plan ({described}) counts on gradient checkpointing and this model runs "
            "without it: turn it on in the arguments (activation_checkpointing=True; "
            "gradient_checkpointing=True before transformers 5), or plan without "
            "--gradient-checkpointing"
        )
    # transformers' every_n_layers leaves the other decoder layers' flags off (accelerate's
    # FSDP wrappers leave them all off: not this).
    flags = [
        getattr(m, "gradient_checkpointing", False) is True
        for m in model.modules()
        if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__[1:])
    ]
    if 0 < sum(flags) < len(flags):
        raise ValueError(
            f"the plan ({described}) checkpoints every decoder layer and this model "
            f"{len(flags) - sum(flags)} of its {len(flags)} without (every_n_layers): "
            "checkpoint every layer (activation_checkpointing_kwargs without every_n_layers)"
        )


def _check_weights_dtype(plan: Any, model: Any, described: str) -> None:
    """A plan with a ``--dtype`` of its own (a T4's fp16) against the dtype the model's frozen
    weights (every weight, for a full fine-tune) are in: fp16 and bf16 weigh the same, so the
    bytes' check cannot tell them apart, but bf16 weights under fp16 autocast run emulated on
    a card without bfloat16 units, and autocast's casts are memory the plan did not trace.
    A quantized base keeps its other weights in float32 whatever the plan: not checked."""
    from bigbatch.memory.lm import dtype_flag, weights_dtype

    setup = plan.setup
    if setup.dtype == "auto" or setup.quant:
        return
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point() and (not setup.lora_r or not p.requires_grad):
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    held = max(counts, key=counts.__getitem__, default=None)
    if held is None or dtype_flag(held) == setup.dtype:
        return
    want = weights_dtype(None, setup)  # the plan's own --dtype, as lm reads it
    raise ValueError(
        f"the plan ({described}) has {setup.dtype} weights and this model's are "
        f"{str(held).removeprefix('torch.')}: load it with from_pretrained(..., "
        f"dtype={want}), or plan with --dtype {dtype_flag(held)}"
    )


def _check_qlora_prep(plan: Any, model: Any, described: str) -> None:
    """A plan of a quantized base readied as TRL's SFTTrainer does (``--qlora-prep trl``: the
    other weights as loaded, the adapters in bfloat16) against a model peft readied, heavier
    by float32 copies: float32 adapters (``get_peft_model``'s), or the base's other weights in
    float32 (``prepare_model_for_kbit_training``'s). A lighter model than the plan's (a peft
    plan, TRL's model) is let through: the plan bounds it."""
    from bigbatch.memory.bnb import is_packed

    setup = plan.setup
    if not setup.quant or getattr(setup, "qlora_prep", "peft") != "trl":
        return
    planned = _planned_dtype(plan)
    held = {"adapters": 0, "other weights": 0}
    for p in model.parameters():
        if p.dtype == torch.float32 and not is_packed(p):
            held["adapters" if p.requires_grad else "other weights"] += p.numel()
    if planned == torch.float32:  # loaded in float32, as the plan has them
        held["other weights"] = 0
    what = [k for k, n in held.items() if n]
    if what:
        raise ValueError(
            f"the plan ({described}) readies the base as TRL's SFTTrainer does (the other "
            f"weights as loaded, the adapters in bfloat16) and this model's {' and '.join(what)} "
            "are float32, as peft's prepare_model_for_kbit_training and get_peft_model leave "
            "them: give SFTTrainer the model from_pretrained loads, with "
            "peft_config=lora_config(plan.setup), or plan with --qlora-prep peft"
        )


def _check_quantized_layers(plan: Any, model: Any, described: str) -> None:
    """A 4-bit base whose layers compute in another dtype than the plan's (bitsandbytes'
    default, float32, doubles each dequantized weight and its matmul's input; bf16 on a T4's
    plan runs emulated), or that are not double-quantized where the plan's are (each block's
    scale in float32: half a bit a weight, against the plan's eighth; BitsAndBytesConfig's
    default). The layers say theirs: ``compute_dtype``, and whether their scales are
    quantized."""
    from bigbatch.memory.lm import quant_compute_dtype

    setup = plan.setup
    if setup.quant != 4:
        return
    dtype = _planned_dtype(plan)
    layers = [
        m for m in model.modules() if isinstance(getattr(m, "compute_dtype", None), torch.dtype)
    ]
    if dtype != "auto":  # a plan saved before it recorded the weights' dtype: not known
        want = quant_compute_dtype(dtype)
        other = {m.compute_dtype for m in layers} - {want}
        if other:
            named = ", ".join(sorted(str(d).removeprefix("torch.") for d in other))
            raise ValueError(
                f"the plan ({described}) has its 4-bit layers compute in "
                f"{str(want).removeprefix('torch.')} and this model's compute in {named}: "
                "load it with from_pretrained(..., **model_arguments(plan)) "
                f"(BitsAndBytesConfig(..., bnb_4bit_compute_dtype={want}))"
            )
    _check_quant_storage(plan, layers, described)
    single = sum(_double_quantized(m) is False for m in layers)
    if setup.double_quant and single:
        raise ValueError(
            f"the plan ({described}) double-quantizes its 4-bit layers and {single} of this "
            "model's are not (their scales take half a bit a weight, the plan's an eighth): "
            "load it with from_pretrained(..., **model_arguments(plan)) "
            "(BitsAndBytesConfig(..., bnb_4bit_use_double_quant=True)), or plan with "
            "--no-double-quant"
        )


def _check_quant_storage(plan: Any, layers: list[Any], described: str) -> None:
    """Under FSDP2, 4-bit layers packed in another dtype than the plan's: uint8 ones stay
    whole on each rank where the plan sharded 16-bit ones (each rank holds them all), and
    16-bit ones in another dtype than the gather's are cast by it, which loses them."""
    from bigbatch.memory.lm import quant_storage_dtype, quant_storage_for

    setup, precision = plan.setup, _plan_precision(plan)
    if not setup.sharded:
        return
    storage = quant_storage_for(setup, precision)
    want = quant_storage_dtype(setup, precision)
    held = {getattr(getattr(m, "weight", None), "dtype", want) for m in layers} - {want}
    if held:
        named = ", ".join(sorted(str(d).removeprefix("torch.") for d in held))
        raise ValueError(
            f"the plan ({described}) packs its 4-bit weights in {storage}, as FSDP2 "
            f"{'leaves them whole on each rank' if storage == 'uint8' else 'shards them'}, and "
            f"this model's are packed in {named}: load it with from_pretrained(..., "
            f"**model_arguments(plan)) (BitsAndBytesConfig(..., bnb_4bit_quant_storage={want}))"
        )


def _double_quantized(layer: Any) -> bool | None:
    """Whether a 4-bit layer's scales are quantized: the planner's stand-in says ``nested``,
    bitsandbytes' weight ``compress_statistics``; None where neither is said."""
    nested = getattr(layer, "nested", None)
    if nested is None:
        nested = getattr(getattr(layer, "weight", None), "compress_statistics", None)
    return nested if isinstance(nested, bool) else None


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
    from bigbatch.memory.lm import _fused_lm_head

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
    which the plan's micro-batch would not hold), and an evaluation keeping every pass's logits
    (:func:`check_evaluation_held`). Under such a plan, a subclass's own ``compute_loss`` is
    named in a warning: a model called there without ``fused_lm_head=True`` makes its whole
    logits. :func:`train_with_backoff` checks each trainer it builds; call it before
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
    check_evaluation_held(trainer, plan)


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


def _eval_batch(args: Any) -> int:
    """Trainer's evaluation batch a rank (its default 8 where ``args`` has none)."""
    return int(getattr(args, "per_device_eval_batch_size", 8) or 8)


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
