"""The model a Hugging Face ``Trainer`` run trains, checked against the plan it runs under
(:func:`check_plan_matches`): the device kind, the trained parameters, the weights' bytes and
dtype, bitsandbytes' 4-bit layers and their preparation, gradient checkpointing, and the
arguments as :func:`~bigbatch.integrations.hf.with_plan` checks them. Imported from
:mod:`bigbatch.integrations.hf`; :class:`~bigbatch.integrations.hf.MemoryBudget` runs it when
training begins.
"""

from __future__ import annotations

from typing import Any

import torch

from bigbatch.integrations import require
from bigbatch.integrations.hf_plan import (
    _check_arguments,
    _described,
    _plan_precision,
    _planned_dtype,
    _prediction,
)

require("transformers", "hf")

__all__ = ["check_plan_matches"]


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
    are not double-quantized where the plan's are, that runs another attention than the plan
    traced (SDPA where the plan has flash_attention_2: a mask a layer and the key-value heads
    repeated; eager: the attention matrices), that runs without the gradient checkpointing the
    plan counted on (its activations several times the plan's), or arguments with another
    precision or optimizer (as :func:`with_plan` refuses them) or, where Trainer evaluates, an
    evaluation batch over the plan's. The plan would hold for none. :class:`MemoryBudget`
    checks this when training begins.

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
    _check_attention(plan, model, described)
    if args is not None:
        _check_arguments(plan, args)
    _check_checkpointing(plan, model, described)


def _check_attention(plan: Any, model: Any, described: str) -> None:
    """A model that runs another attention than the plan traced (transformers records it in the
    config as ``_attn_implementation``; a peft model forwards it): each keeps other tensors.
    A vision-language model's language model records its own (in ``text_config``, which
    ``set_attn_implementation`` can set apart from the rest): the step's is that one. The hub
    kernel transformers loads for flash_attention_2 where flash-attn is not installed
    (``kernels-community/flash-attn2``) runs in the same wrapper: the plan's."""
    from transformers import modeling_flash_attention_utils as flash

    from bigbatch.memory.lm_setup import ATTENTIONS, _text_config

    planned = getattr(plan.setup, "attn", "auto")
    config = getattr(model, "config", None)
    runs = getattr(_text_config(config), "_attn_implementation", None)
    fallback = getattr(flash, "FLASH_ATTN_KERNEL_FALLBACK", {}).get(planned)
    if planned == "auto" or not isinstance(runs, str) or runs in (planned, fallback):
        return
    other = f", or plan with --attn {runs}" if runs in ATTENTIONS else ""
    raise ValueError(
        f"the plan ({described}) traced {planned} attention and this model runs {runs}: load it "
        f"with attn_implementation='{planned}' (from_pretrained(..., **model_arguments(plan)) "
        f"does){other}"
    )


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
