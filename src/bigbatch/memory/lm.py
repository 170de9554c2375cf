"""Language models from their ``config.json``: the fine-tune a user describes (full, LoRA,
QLoRA; checkpointing, attention, packing; one card, DDP or FSDP2) as the planner's
:class:`~bigbatch.memory.step.StepSpec`, and the plan per rank.

The model is built by transformers itself (``AutoModelForCausalLM.from_config``) on the meta
device, its adapters by peft (``get_peft_model``), its 4-bit or 8-bit base by
:mod:`bigbatch.memory.bnb`'s stand-ins for bitsandbytes' layers, and its step (the causal-LM
loss over ``labels``, padded ``[B, L]`` or packed ``[1, B*L]`` with ``position_ids``) is
traced on fake tensors like any other: no weights are read, no memory is allocated.

Across processes: FSDP2 is traced as one rank, the model under ``fully_shard`` on a fake
process group of N ranks (:mod:`bigbatch.memory.fsdp`), so the trace holds the rank's shards
and its all-gather and reduce-scatter buffers while they live. DDP's memory (and FSDP2's,
where this process already has a process group, under torchrun) is composed from one
process's trace (:func:`per_rank_bytes`): DDP adds its gradient buckets; FSDP2 keeps ``1/N``
of the weights, gradients and optimizer state and adds its gather buffers.

>>> setup = LMSetup(seq_len=512, lora_r=8)
>>> setup.describe()
'LoRA r=8 (all-linear), 512 tokens, padded'
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.device import AMPERE, device_kind
from bigbatch.io import atomic_write_text
from bigbatch.memory.bnb import QuantizedLinear, is_packed, paged_state_bytes, quantize_linears
from bigbatch.memory.budget import format_bytes
from bigbatch.memory.cards import Card, find_card
from bigbatch.memory.evaluate import (
    STATE_COPIES,
    EvaluationPlan,
    plan_evaluation_batch,
    predict_evaluation_peak,
)
from bigbatch.memory.fake_branches import known_values
from bigbatch.memory.fsdp import (
    fake_ranks,
    shard_as_trainer,
    shard_decoder_layers,
    trainer_sharding,
)
from bigbatch.memory.meta import build_on_meta
from bigbatch.memory.plan import (
    DEFAULT_MARGIN,
    DoesNotFitError,
    Plan,
    default_overhead,
    plan_micro_batch,
    resolve_budget,
    usable_bytes,
)
from bigbatch.memory.predict import MemoryPrediction, predict_peak
from bigbatch.memory.stack import LayerStack
from bigbatch.memory.step import StepSpec

__all__ = [
    "ATTENTIONS",
    "LOSSES",
    "QLORA_PREPS",
    "QUANT_STORAGES",
    "LMPlan",
    "LMSetup",
    "ModelSizes",
    "dtype_flag",
    "lm_factory",
    "lm_spec_at",
    "load_lm_config",
    "lora_config",
    "model_sizes",
    "per_rank_bytes",
    "plan_lm",
    "quant_compute_dtype",
    "quant_storage_dtype",
    "quant_storage_for",
    "with_chosen_attention",
]

ATTENTIONS = ("auto", "sdpa", "eager", "flash_attention_2")
LOSSES = ("model", "trl")
# torchrun's variables, which the process tracing an FSDP2 rank apart must not see (_run_apart).
_TORCHRUN = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
_TORCHRUN |= {"GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"}
_APART_S = 1800  # a plan apart that takes half an hour is stuck: composed instead
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_STORAGE_DTYPES = {"uint8": torch.uint8, **_DTYPES}
QUANT_STORAGES = ("auto", *_STORAGE_DTYPES)
# How a quantized base is readied for its adapters: peft's prepare_model_for_kbit_training
# then get_peft_model, or TRL's SFTTrainer given peft_config= (see LMSetup.qlora_prep).
QLORA_PREPS = ("peft", "trl")


@dataclass(frozen=True)
class LMSetup:
    """A language-model fine-tune as a fine-tuner says it.

    ``lora_r`` 0 is a full fine-tune; ``quant`` 4 (QLoRA's NF4) or 8 (LLM.int8) quantizes the
    base's linear layers and needs ``lora_r``; ``dtype`` is the weights' (``auto``: the
    config's, as ``from_pretrained`` loads them); ``packing`` puts a micro-batch's sequences
    in one row (TRL's ``padding_free``) instead of padding each to ``seq_len``.

    ``qlora_prep`` is how a quantized base is readied for its adapters: ``peft``, peft's
    ``prepare_model_for_kbit_training`` then ``get_peft_model`` (the base's other weights and
    the adapters in float32); ``trl``, TRL's ``SFTTrainer`` given ``peft_config=`` (TRL 1.x:
    the other weights as loaded, the adapters in bfloat16), lighter by the float32 copies.

    ``loss`` is what makes the loss: ``model``, the model's own, over the whole
    ``[tokens x vocabulary]`` logits (Trainer's); ``trl``, TRL's ``SFTTrainer`` (its fused LM
    head, in TRL versions that have ``add_fused_lm_head``): log-probabilities from tiles of
    the logits, never the whole of them. ``label_smoothing`` is Trainer's
    ``label_smoothing_factor``: over 0, its ``LabelSmoother`` over the whole logits (in float32
    under mixed precision, as accelerate hands them back), and with ``loss="trl"`` SFTTrainer's
    fused head after it, without gradients.

    >>> LMSetup(seq_len=2048, lora_r=16, quant=4, gradient_checkpointing=True).describe()
    'QLoRA 4-bit r=16 (all-linear), 2048 tokens, padded, gradient checkpointing'
    >>> LMSetup(seq_len=2048, lora_r=16, quant=4, qlora_prep="trl").describe()
    "QLoRA 4-bit r=16 (all-linear), 2048 tokens, padded, prepared as TRL's SFTTrainer does"
    """

    seq_len: int
    lora_r: int = 0
    lora_targets: str = "all-linear"  # peft's target_modules: comma-separated names
    lora_alpha: int | None = None
    lora_dropout: float = 0.0
    quant: int = 0  # 0, 4 or 8 bits for the base's linear layers (bitsandbytes)
    double_quant: bool = True
    # The dtype 4-bit values are packed in (bnb_4bit_quant_storage): auto is uint8, and under
    # FSDP2 the training precision's 16-bit dtype, which FSDP2 shards (see quant_storage_for).
    quant_storage: str = "auto"
    qlora_prep: str = "peft"  # peft or trl: what readies a quantized base (QLORA_PREPS)
    gradient_checkpointing: bool = False
    attn: str = "auto"  # auto: as from_pretrained chooses (SDPA where the model has it, else eager)
    packing: bool = False
    dtype: str = "auto"  # the weights': auto, bf16, fp16, fp32
    world_size: int = 1
    fsdp: bool = False
    # What makes the loss (LOSSES): the model's own, over the whole logits (Trainer's), or
    # TRL's SFTTrainer's fused LM head, its log-probabilities from tiles of the logits.
    loss: str = "model"
    # Trainer's label_smoothing_factor: over 0, its LabelSmoother takes the whole logits (and
    # SFTTrainer, under loss="trl", then runs its fused head without gradients for the metrics).
    label_smoothing: float = 0.0

    @property
    def sharded(self) -> bool:
        """Whether each rank holds FSDP2's shards (``fsdp`` over more than one rank).

        >>> LMSetup(seq_len=512, world_size=4, fsdp=True).sharded
        True
        """
        return self.fsdp and self.world_size > 1

    def describe(self, table: bool = False) -> str:
        """The fine-tune in a line; with ``table``, without the length and the ranks (a
        table's rows give them).

        >>> LMSetup(seq_len=2048, lora_r=16, dtype="fp16", world_size=4, fsdp=True).describe()
        'LoRA r=16 (all-linear), 2048 tokens, padded, fp16 weights, FSDP2 over 4 ranks'
        >>> LMSetup(seq_len=2048, lora_r=16, world_size=4, fsdp=True).describe(table=True)
        'LoRA r=16 (all-linear), padded, FSDP2'
        >>> LMSetup(seq_len=512, label_smoothing=0.1).describe()
        'full fine-tune, 512 tokens, padded, label smoothing 0.1'
        """
        kind = "full fine-tune"
        if self.lora_r:
            kind = f"LoRA r={self.lora_r} ({self.lora_targets})"
            if self.quant:
                kind = f"QLoRA {self.quant}-bit r={self.lora_r} ({self.lora_targets})"
        length = [] if table else [f"{self.seq_len} tokens"]
        parts = [kind, *length, "packed" if self.packing else "padded"]
        if self.gradient_checkpointing:
            parts.append("gradient checkpointing")
        if self.attn not in ("auto", "sdpa"):
            parts.append(self.attn)
        if self.quant == 4 and self.quant_storage not in ("auto", "uint8"):
            parts.append(f"4-bit in {self.quant_storage} storage")
        if self.quant and self.qlora_prep == "trl":
            parts.append("prepared as TRL's SFTTrainer does")
        if self.loss == "trl":
            parts.append("TRL's fused LM head")
        if self.label_smoothing:
            parts.append(f"label smoothing {self.label_smoothing:g}")
        if self.dtype != "auto":  # from_pretrained(..., dtype=) loads them so
            parts.append(f"{self.dtype} weights")
        if table and self.fsdp:
            parts.append("FSDP2")
        elif self.world_size > 1 and not table:
            parts.append(f"{'FSDP2' if self.fsdp else 'DDP'} over {self.world_size} ranks")
        return ", ".join(parts)


def load_lm_config(source: str | Path, *, trust_remote_code: bool = False) -> Any:
    """A causal LM's config from a ``config.json`` (the file or its folder) or a hub name read
    from the Hugging Face cache (fetched, config only, when not cached and the hub is
    reachable). Raises ``ValueError`` with the fix for what transformers cannot build. A model
    with code of its own (``auto_map``) is refused unless ``trust_remote_code``, as in
    transformers, and never asked about on the terminal; trusted, its model is built by its
    code too.

    >>> import tempfile, transformers
    >>> folder = tempfile.mkdtemp()
    >>> transformers.LlamaConfig(num_hidden_layers=2).save_pretrained(folder)
    >>> load_lm_config(folder).model_type
    'llama'
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    text = str(source)
    local = Path(text).expanduser()
    try:
        if local.exists():
            if local.is_dir() and not (local / "config.json").is_file():
                raise ValueError(f"{text}: a folder without config.json; give the model's folder")
            try:
                config = AutoConfig.from_pretrained(str(local), trust_remote_code=trust_remote_code)
            except OSError as exc:  # transformers' word for a file that is not JSON
                raise ValueError(
                    f"{text}: {str(exc).rstrip('.')}: give a model's config.json as "
                    "transformers saves it"
                ) from None
        else:
            config = _hub_config(text, trust_remote_code)
    except _config_validation_errors() as exc:
        # transformers 5 checks each field's type as the config is read.
        raise ValueError(f"{text}: {' '.join(str(exc).split())}: fix it in config.json") from None
    except ValueError as exc:
        message = str(exc)
        if "trust_remote_code" in message:
            raise ValueError(
                f"{text}: its config.json names code of its own (auto_map) that builds the "
                "model: add --trust-remote-code (trust_remote_code=True) if you trust its source"
            ) from None
        if "does not recognize this architecture" in message or "model type" in message:
            kind = message.split("`")[1] if "`" in message else "?"
            import transformers

            raise ValueError(
                f"{text}: model type {kind!r} is not one transformers {transformers.__version__} "
                "knows: pip install -U transformers, or check config.json's model_type"
            ) from None
        raise
    if _remote(config):
        causal = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    else:
        causal = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
    if not causal:
        raise ValueError(
            f"{text}: a {config.model_type!r} model has no causal-LM head in transformers "
            "(AutoModelForCausalLM): --hf plans decoder language models"
        )
    return config


def _config_validation_errors() -> tuple[type[Exception], ...]:
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # a hub client older than transformers 5's
        return ()
    return (StrictDataclassError,)


def _model_name(config: Any) -> str:
    """The model class the config names (``LlamaForCausalLM``), else its ``model_type``."""
    return str((getattr(config, "architectures", None) or [config.model_type])[0])


def _remote(config: Any) -> bool:
    """Whether ``config`` is of a class the model's own code defines (loaded trusted)."""
    return type(config).__module__.startswith("transformers_modules")


def _hub_config(name: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    if name.count("/") > 1 or name.startswith((".", "/", "~")):
        raise ValueError(f"{name}: no such file or folder; give a config.json or a hub name")
    trust = {"trust_remote_code": trust_remote_code}
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True, **trust)
    except OSError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise ValueError(
            f"{name}: not in the Hugging Face cache and HF_HUB_OFFLINE is set: fetch its config "
            f"once online (`hf download {name} config.json`) or give the path of a config.json"
        )
    try:
        with _hub_warnings_off():
            return AutoConfig.from_pretrained(name, **trust)  # config.json alone, into the cache
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{name}: no config.json in the Hugging Face cache, and fetching it failed ({first}): "
            f"check the name, log in for a gated model (`hf auth login`), or give a config.json's path"
        ) from None


@contextlib.contextmanager
def _hub_warnings_off() -> Iterator[None]:
    """The hub's warning of each failed request off while a config is fetched: the error that
    follows says why it failed, in one line."""
    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(level)


def _text_config(config: Any) -> Any:
    """The language model's part of ``config``: a vision-language model's (Gemma 3, Mistral 3)
    ``text_config``, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's positions allow (None when the config says none)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(_text_config(config), key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def weights_dtype(config: Any, setup: LMSetup) -> torch.dtype:
    """The weights' dtype: ``setup.dtype``, or with ``auto`` the config's (float32 if none)."""
    if setup.dtype != "auto":
        return _DTYPES[setup.dtype]
    return _config_dtype(config) or torch.float32


def _config_dtype(config: Any) -> torch.dtype | None:
    """The dtype the config names for its weights, or None."""
    # transformers 5 says dtype (torch_dtype, its old name, warns when read)
    key = "dtype" if "dtype" in config.to_dict() or hasattr(config, "dtype") else "torch_dtype"
    dtype = getattr(config, key, None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def dtype_flag(dtype: torch.dtype | None) -> str:
    """``--dtype``'s name for ``dtype`` (``LMSetup.dtype``): bf16, fp16 or fp32; ``auto`` for
    any other.

    >>> dtype_flag(torch.bfloat16), dtype_flag(torch.float64)
    ('bf16', 'auto')
    """
    return next((flag for flag, d in _DTYPES.items() if d == dtype), "auto")


def quant_storage_for(setup: LMSetup, precision: str = "bf16") -> str:
    """The dtype ``setup``'s 4-bit values are packed in (``bnb_4bit_quant_storage``): the one
    it names, else bitsandbytes' uint8, which FSDP2 cannot shard (accelerate leaves such
    weights whole on each rank), and under FSDP2 the dtype its mixed-precision policy gathers
    in at ``precision`` (bf16, or fp16), which it shards as any other weight and never casts.

    >>> quant_storage_for(LMSetup(512, lora_r=16, quant=4))
    'uint8'
    >>> quant_storage_for(LMSetup(512, lora_r=16, quant=4, world_size=8, fsdp=True), "fp16")
    'fp16'
    """
    if setup.quant_storage != "auto":
        return setup.quant_storage
    if setup.quant == 4 and setup.sharded:
        return "fp16" if precision == "fp16" else "bf16"
    return "uint8"


def quant_storage_dtype(setup: LMSetup, precision: str = "bf16") -> torch.dtype:
    """:func:`quant_storage_for`'s dtype, as ``BitsAndBytesConfig(bnb_4bit_quant_storage=)``
    takes it.

    >>> quant_storage_dtype(LMSetup(512, lora_r=16, quant=4, world_size=8, fsdp=True))
    torch.bfloat16
    """
    return _STORAGE_DTYPES[quant_storage_for(setup, precision)]


def quant_compute_dtype(weights: torch.dtype) -> torch.dtype:
    """The dtype a quantized base's layers compute in (bitsandbytes' ``compute_dtype``, the
    dtype of the weight each layer dequantizes for its matmul) for weights in ``weights``: the
    weights' own 16-bit dtype, and bfloat16 for float32 weights (bitsandbytes' float32 default
    doubles every dequantized weight).

    >>> quant_compute_dtype(torch.float16), quant_compute_dtype(torch.float32)
    (torch.float16, torch.bfloat16)
    """
    return weights if weights in (torch.float16, torch.bfloat16) else torch.bfloat16


def check_setup(
    config: Any, setup: LMSetup, global_batch: int | None = None, precision: str = ""
) -> None:
    """Refuse, with the fix, what cannot be planned or trained as given (with
    ``global_batch`` sequences a step and in ``precision``, where given)."""
    _check_fp16_weights(config, setup, precision)
    n = setup.world_size
    if global_batch is not None and (global_batch < 1 or global_batch % n):
        raise ValueError(
            f"the global batch {global_batch} must be a positive multiple of the {n} ranks "
            "(each takes the same number of sequences)"
        )
    longest = max_positions(config)
    if setup.seq_len < 1:
        raise ValueError(f"--seq-len must be a positive number of tokens, got {setup.seq_len}")
    if longest is not None and setup.seq_len > longest:
        raise ValueError(
            f"--seq-len {setup.seq_len} is longer than the model's {longest} positions "
            f"(max_position_embeddings): use --seq-len {longest} or less"
        )
    _check_adapters(setup)
    storage = _checked_storage(setup, precision or "bf16")
    if setup.quant:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as exc:  # an ImportError, or a library that fails to load
            raise ValueError(
                f"--qlora needs bitsandbytes, which cannot load here ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): pip install bitsandbytes "
                "(Linux or Windows), or plan LoRA on a 16-bit base without --qlora"
            ) from None
    if setup.attn not in ATTENTIONS:
        raise ValueError(f"--attn must be one of {', '.join(ATTENTIONS)}, got {setup.attn!r}")
    _check_loss(setup)
    if setup.fsdp and setup.world_size < 2:
        raise ValueError("--fsdp shards over ranks: give --world-size 2 or more")
    if setup.quant == 8 and setup.fsdp:
        raise ValueError(
            "--qlora 8 with --fsdp: FSDP2 shards LLM.int8's weights as any other and loses "
            "their scales (accelerate leaves only 4-bit ones whole): plan --qlora 4, or 8-bit "
            "with DDP (no --fsdp)"
        )
    if storage == "uint8" and setup.quant and setup.fsdp and not _fsdp_leaves_out_params():
        raise ValueError(
            f"--qlora with --fsdp needs torch 2.7 or later (this is {torch.__version__}): "
            "FSDP2 leaves uint8-packed weights whole on each rank through fully_shard's "
            "ignored_params, as accelerate does; pip install -U torch, plan with DDP, or let "
            "FSDP2 shard them (--quant-storage bf16)"
        )


def _check_loss(setup: LMSetup) -> None:
    """``--loss`` one of :data:`LOSSES`; ``trl`` where this TRL has its fused LM head;
    ``--label-smoothing`` a factor Trainer takes."""
    if setup.loss not in LOSSES:
        raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {setup.loss!r}")
    if not 0 <= setup.label_smoothing < 1:
        raise ValueError(
            f"--label-smoothing must be at least 0 and below 1 (Trainer's "
            f"label_smoothing_factor, 0.1 say), got {setup.label_smoothing}"
        )
    if setup.loss == "trl" and _fused_lm_head() is None:
        try:
            import trl

            where = f"TRL {trl.__version__} computes SFTTrainer's loss over the whole logits"
        except ImportError:
            where = "TRL is not installed"
        raise ValueError(
            f"--loss trl plans TRL's fused LM head, and {where}: plan with --loss model, or "
            "pip install -U trl"
        )


def _add_sft_trainers_head(model: nn.Module) -> None:
    """TRL's fused LM head as SFTTrainer puts it on the model it trains (under peft's wrapper),
    with the outputs its metrics read."""
    add_fused_lm_head = _fused_lm_head()
    if add_fused_lm_head is not None:
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))


def _fused_lm_head() -> Callable[..., None] | None:
    """TRL's ``add_fused_lm_head``, which SFTTrainer puts on the model it trains; None where this
    TRL has none (or there is no TRL)."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:
        return None
    return add_fused_lm_head


def _check_adapters(setup: LMSetup) -> None:
    """LoRA's and the quantized base's settings, refused where they are not ones or are given
    without what they set."""
    if setup.lora_r < 0:
        raise ValueError(f"--lora takes the adapters' rank, >= 1 (e.g. 16), got {setup.lora_r}")
    if setup.lora_r and not setup.lora_targets.replace(",", "").strip():
        raise ValueError(
            "--lora-targets names no module: give comma-separated names (q_proj,v_proj), or "
            "all-linear (the default)"
        )
    if not 0.0 <= setup.lora_dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {setup.lora_dropout}")
    if setup.quant and not setup.lora_r:
        raise ValueError(
            "a quantized base cannot be trained itself: add --lora R (QLoRA trains adapters)"
        )
    if setup.quant not in (0, 4, 8):
        raise ValueError(f"--qlora takes 4 or 8 bits, got {setup.quant}")
    # The adapters' settings without adapters would plan a full fine-tune in silence.
    adapter_flags = [
        flag
        for flag, given in (
            ("--lora-targets", setup.lora_targets != "all-linear"),
            ("--lora-dropout", setup.lora_dropout != 0.0),
            ("lora_alpha", setup.lora_alpha is not None),
        )
        if given
    ]
    if adapter_flags and not setup.lora_r:
        raise ValueError(
            f"{', '.join(adapter_flags)} set LoRA's adapters and this plan has none (a full "
            "fine-tune): add --lora R, or drop them"
        )
    if not setup.double_quant and setup.quant != 4:
        raise ValueError("--no-double-quant is for a 4-bit base: add --qlora, or drop it")
    if setup.qlora_prep not in QLORA_PREPS:
        raise ValueError(
            f"--qlora-prep must be one of {', '.join(QLORA_PREPS)}, got {setup.qlora_prep!r}"
        )
    if setup.qlora_prep != "peft" and not setup.quant:
        raise ValueError(
            "--qlora-prep is for a quantized base (TRL readies other models as peft does): "
            "add --qlora, or drop it"
        )


def _checked_storage(setup: LMSetup, precision: str) -> str:
    """``setup``'s 4-bit storage at ``precision``, refused where it is not one, is given
    without a 4-bit base, or would be cast by FSDP2's gathers."""
    if setup.quant_storage not in QUANT_STORAGES:
        raise ValueError(
            f"--quant-storage must be one of {', '.join(QUANT_STORAGES)}, got "
            f"{setup.quant_storage!r}"
        )
    if setup.quant_storage != "auto" and setup.quant != 4:
        raise ValueError("--quant-storage is for a 4-bit base: add --qlora, or drop it")
    storage = quant_storage_for(setup, precision)
    gathered = precision if precision in ("bf16", "fp16") else storage  # fp32: no cast
    if setup.fsdp and storage not in ("uint8", gathered):
        raise ValueError(
            f"--quant-storage {storage} under FSDP2 in {precision}: its mixed-precision "
            f"policy would cast the packed 4-bit weights to {gathered} when it gathers them, "
            f"and they would be lost: --quant-storage {gathered}"
        )
    return storage


def _fsdp_leaves_out_params() -> bool:
    """Whether this torch's ``fully_shard`` takes ``ignored_params`` (from 2.7)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return False
    return "ignored_params" in inspect.signature(fully_shard).parameters


def lora_config(setup: LMSetup) -> Any:
    """peft's ``LoraConfig`` for ``setup``'s adapters (rank, alpha: twice the rank unless
    given, dropout, target modules), the adapters the planner builds.

    >>> lora_config(LMSetup(seq_len=512, lora_r=16, lora_targets="q_proj,v_proj")).lora_alpha
    32
    """
    from peft import LoraConfig

    targets: str | list[str] = setup.lora_targets
    if targets != "all-linear":
        targets = [t.strip() for t in setup.lora_targets.split(",") if t.strip()]
    return LoraConfig(
        r=setup.lora_r,
        lora_alpha=setup.lora_alpha or 2 * setup.lora_r,
        lora_dropout=setup.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def _apply_lora(model: nn.Module, setup: LMSetup) -> nn.Module:
    from peft import get_peft_model

    try:
        with warnings.catch_warnings():
            # peft reads transformers' renamed `is_gradient_checkpointing`: a FutureWarning
            # about the planner's own stand-in model, nothing the user can act on.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            # What peft settles itself, as it will in the run: its patterns for a mixture of
            # experts' fused weights (gate_up_proj), which all-linear leaves out, and
            # fan_in_fan_out for GPT-2's Conv1D. Said of every such plan, nothing to act on.
            warnings.filterwarnings("ignore", "The following (rank|alpha)_pattern keys did not")
            warnings.filterwarnings("ignore", "fan_in_fan_out is set to False but the target")
            return get_peft_model(model, lora_config(setup))
    except ValueError as exc:
        if "not found in the base model" not in str(exc) and "target module" not in str(exc):
            raise
        names = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ValueError(
            f"--lora-targets {setup.lora_targets} matches no linear layer of "
            f"{type(model).__name__}: name some of {', '.join(names)}, or all-linear"
        ) from None


def lm_factory(
    config: Any, setup: LMSetup, *, real_bitsandbytes: bool = False
) -> Callable[[], nn.Module]:
    """What builds the model to train: transformers' causal LM from ``config`` in the weights'
    dtype, its base quantized (``setup.quant``: the other weights in float32, as peft's
    ``prepare_model_for_kbit_training`` leaves them, or as loaded, as TRL's ``SFTTrainer``
    does: ``setup.qlora_prep``), LoRA adapters (peft keeps them in float32; TRL casts a
    quantized base's to bfloat16), activation checkpointing, TRL's fused LM head
    (``setup.loss``). Call it under the meta device (the planner does).
    ``real_bitsandbytes``: the base in bitsandbytes' own layers (quantized when moved to a
    GPU) rather than the planner's stand-ins, for a real step on a GPU.

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                num_attention_heads=4, vocab_size=100)
    >>> model = build_on_meta(lm_factory(cfg, LMSetup(seq_len=16, lora_r=4)))
    >>> sum(p.numel() for p in model.parameters() if p.requires_grad)
    8704
    """

    def build() -> nn.Module:
        from transformers import AutoModelForCausalLM

        dtype = weights_dtype(config, setup)
        # flash_attention_2 needs its package and a GPU; its memory is SDPA's flash kernel's
        # (the output and a float32 log-sum-exp a head and token), which the trace runs.
        attn = {"flash_attention_2": "sdpa", "auto": None}.get(setup.attn, setup.attn)
        try:
            # A copy: transformers sets the config's dtype and the step its use_cache, and the
            # caller's config (one they may load a model with next) keeps its own.
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(config),
                dtype=dtype,
                attn_implementation=attn,
                trust_remote_code=_remote(config),
            )
        except (TypeError, AttributeError, KeyError, IndexError) as exc:
            # A model's code reads values its config class leaves unset (ministral's head_dim):
            # a config written by hand, or cut down, lacks one.
            raise ValueError(
                f"transformers cannot build {_model_name(config)} from this config "
                f"({type(exc).__name__}: {exc}): a value its code needs is missing or of the "
                "wrong type; compare the config with the model's published config.json"
            ) from None
        model.config.use_cache = False
        if setup.quant:
            head = model.get_output_embeddings()
            skip = tuple(n for n, m in model.named_modules() if m is head)
            quantize_linears(
                model,
                bits=setup.quant,
                storage=quant_storage_dtype(setup),
                nested=setup.double_quant,
                compute_dtype=quant_compute_dtype(dtype),
                skip=skip,
                real=real_bitsandbytes,
            )
            if setup.qlora_prep == "peft":
                _upcast_as_peft_prepares(model)
        if setup.lora_r:
            model.requires_grad_(False)
            model = _apply_lora(model, setup)
        if setup.quant and setup.qlora_prep == "trl":
            # TRL's SFTTrainer casts a quantized base's adapters to bfloat16 (QLoRA's paper),
            # DoRA's magnitudes aside, whatever the training precision.
            for name, p in model.named_parameters():
                if p.requires_grad and "lora_magnitude_vector" not in name:
                    p.data = p.data.to(torch.bfloat16)
        if setup.gradient_checkpointing:
            enable_checkpointing(model)
            if setup.lora_r:
                model.enable_input_require_grads()
        if setup.loss == "trl":
            _add_sft_trainers_head(model.get_base_model() if setup.lora_r else model)
        return model

    return build


def _upcast_as_peft_prepares(model: nn.Module) -> None:
    """peft's ``prepare_model_for_kbit_training``: every 16-bit weight to float32 but the
    quantized ones."""
    for p in model.parameters():
        if p.dtype in (torch.float16, torch.bfloat16) and not is_packed(p):
            p.data = p.data.float()


def enable_checkpointing(model: nn.Module) -> None:
    """Transformers' activation checkpointing, non-reentrant (by its name since 5.0)."""
    kwargs = {"use_reentrant": False}
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs)
    else:
        getattr(model, "gradient_checkpointing_enable")(gradient_checkpointing_kwargs=kwargs)  # noqa: B009


def _lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss: torch.Tensor = model(**batch, use_cache=False).loss
    return loss


def _fused_head_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The step as TRL's SFTTrainer runs it: its fused LM head's summed log-probabilities."""
    loss: torch.Tensor = model(**batch, use_cache=False, fused_lm_head=True).loss
    return loss


def _smoothed_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The step as Trainer runs it with ``label_smoothing_factor``: the model's logits without
    its loss, then transformers' LabelSmoother over them (its factor leaves the memory be)."""
    from transformers.trainer_pt_utils import LabelSmoother

    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    where = logits.device.type
    if torch.is_autocast_enabled(where):
        # accelerate, which Trainer runs a mixed-precision forward through, hands its 16-bit
        # outputs back in float32 (convert_outputs_to_fp32), and the smoother runs outside its
        # autocast: a float32 copy of the logits, and every tensor it makes of them float32.
        logits = logits.float()
    counted = {}
    if _smoother_counts_tokens():
        counted["num_items_in_batch"] = (labels[..., 1:] != LabelSmoother.ignore_index).sum()
    with torch.autocast(where, enabled=False):
        loss: torch.Tensor = LabelSmoother(epsilon=0.1)(
            (logits,), labels, shift_labels=True, **counted
        )
    return loss


def _smoother_counts_tokens() -> bool:
    """Whether Trainer's LabelSmoother divides by the window's token count Trainer hands it
    (``num_items_in_batch``, transformers 5.15 and later), as an exact accumulation needs;
    before, it divides each micro-batch by its own.

    >>> _smoother_counts_tokens()  # transformers 5.23 here
    True
    """
    from transformers.trainer_pt_utils import LabelSmoother

    return "num_items_in_batch" in inspect.signature(LabelSmoother.__call__).parameters


def _sft_smoothed_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The step as TRL's SFTTrainer runs it with ``label_smoothing_factor``: Trainer's smoothed
    loss over the whole logits, then, with that loss's graph held, its fused head's forward
    without gradients, whose outputs feed its metrics."""
    loss = _smoothed_step(model, batch)
    with torch.no_grad():
        model(**batch, use_cache=False, fused_lm_head=True)
    return loss


def _step_of(setup: LMSetup) -> Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]:
    """The step that makes ``setup``'s loss, as the trainer it names runs it."""
    if setup.label_smoothing:
        return _sft_smoothed_step if setup.loss == "trl" else _smoothed_step
    return _fused_head_step if setup.loss == "trl" else _lm_step


def _sharded(
    unsharded: Callable[[], nn.Module], device: str, precision: str
) -> Callable[[], nn.Module]:
    """``unsharded``'s model under FSDP2 as Trainer runs it (accelerate's preparation), else
    as torch's ``fully_shard`` on each decoder layer and the root."""

    def factory() -> nn.Module:
        model = unsharded()
        # On the meta device it is traced (on the CPU); else a real step on the target.
        on_meta = any(p.is_meta for p in model.parameters())
        where = "cpu" if on_meta else torch.device(device).type
        if trainer_sharding():
            try:
                return shard_as_trainer(model, _wrapped_layers(model), where, precision)
            except (AttributeError, TypeError, ValueError, KeyError) as exc:
                warnings.warn(
                    f"accelerate's FSDP2 preparation did not run here ({type(exc).__name__}): "
                    "the ranks are planned as torch's fully_shard on each decoder layer and "
                    "the root, with the weights' own dtype",
                    RuntimeWarning,
                    stacklevel=2,
                )
                model = unsharded()  # afresh: the preparation may have sharded a part
        return shard_decoder_layers(model, _decoder_layers(model), where)

    return factory


def lm_spec_at(
    config: Any,
    setup: LMSetup,
    *,
    device: str = "cuda",
    precision: str = "bf16",
    optimizer: str = "adamw",
    real_bitsandbytes: bool = False,
    sharded: bool = False,
) -> Callable[[int], StepSpec]:
    """``spec_at(b)``: one rank's training step at micro-batch ``b`` sequences, for the planner.
    ``sharded``: the model under FSDP2 over the ranks of the process group, which
    :func:`~bigbatch.memory.fsdp.fake_ranks` makes for a trace: as Trainer runs it, through
    accelerate's own preparation (:func:`~bigbatch.memory.fsdp.shard_as_trainer`), else torch's
    ``fully_shard`` on each decoder layer and the root.

    Padded micro-batches are ``[b, seq_len]``, the longest sequence's length (the micro-batch
    that decides the peak), with one pad token (a micro-batch of several sequences has some:
    transformers then builds the attention mask, and SDPA takes it); packed ones one row of ``b * seq_len``
    tokens whose ``position_ids`` restart at each sequence.

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                num_attention_heads=4, vocab_size=100)
    >>> spec = lm_spec_at(cfg, LMSetup(seq_len=32), device="cpu", precision="fp32")(4)
    >>> spec.batch_size, spec.input_shape, spec.name  # predict_peak(spec) predicts it
    (4, (32,), 'llama full fine-tune, 32 tokens, padded')
    """
    _check_loss(setup)  # a step through a fused head this TRL lacks would fail mid-trace
    vocab = int(_text_config(config).vocab_size)
    length = setup.seq_len
    setup = _storage_named(setup, precision)
    factory = lm_factory(config, setup, real_bitsandbytes=real_bitsandbytes)
    if sharded:
        factory = _sharded(factory, device, precision)

    def batch(b: int, where: Any) -> dict[str, torch.Tensor]:
        # The values transformers' masks branch on are kept for the trace (known_values).
        if setup.packing:
            ids = torch.randint(0, vocab, (1, b * length), device=where)

            def restarts(device: Any = None) -> torch.Tensor:
                return torch.arange(length, device=device).repeat(b).unsqueeze(0)

            positions = known_values(restarts(where), restarts)
            return {"input_ids": ids, "labels": ids, "position_ids": positions}
        ids = torch.randint(0, vocab, (b, length), device=where)

        def padding(device: Any = None) -> torch.Tensor:
            mask = torch.ones(b, length, dtype=torch.long, device=device)
            if b > 1:  # one pad: transformers then builds the attention mask, as for real batches
                mask[-1, -1] = 0
            return mask

        mask = known_values(padding(where), padding)
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    def spec_at(b: int) -> StepSpec:
        return StepSpec(
            factory,
            (length,),
            b,
            optimizer=optimizer,
            precision=precision,  # type: ignore[arg-type]
            device=device,
            input_dtype=torch.long,
            vocab=vocab,
            name=f"{config.model_type} {setup.describe()}",
            step=_step_of(setup),
            batch=batch,
            layers=stack,
        )

    stack = None if sharded else _layer_stack(config, setup, real_bitsandbytes)
    return spec_at


def _layer_stack(config: Any, setup: LMSetup, real_bitsandbytes: bool) -> LayerStack | None:
    """The model's decoder layers, and the model with fewer of them (a CUDA trace is made
    from a shallow one's: bigbatch.memory.stack); one for all the sizes of a plan, which
    checks the extrapolation once for them all."""
    count = getattr(_text_config(config), "num_hidden_layers", None)
    if not isinstance(count, int):
        return None

    def at_depth(n: int) -> Callable[[], nn.Module]:
        shallow = copy.deepcopy(config)
        text = _text_config(shallow)
        text.num_hidden_layers = n
        kinds = getattr(text, "layer_types", None)  # one per layer (differing: not alike)
        if isinstance(kinds, list):
            text.layer_types = kinds[:n]
        return lm_factory(shallow, setup, real_bitsandbytes=real_bitsandbytes)

    return LayerStack(count, at_depth, _decoder_layers)


@dataclass(frozen=True)
class ModelSizes:
    """A built model's weights, by what training and sharding do with them (bytes;
    :func:`model_sizes`).

    >>> sizes = model_sizes(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)])))
    >>> sizes.layer, sizes.root, sizes.trainable_count
    (80, 80, 40)
    """

    parameters: int
    trainable: int  # adapters (LoRA), or every weight (full fine-tune)
    frozen: int
    layer: int  # the largest decoder layer's weights (FSDP2 gathers it)
    layer_trainable: int  # ... of which trainable (their gradients are reduce-scattered)
    root: int  # outside the decoder layers (embeddings, the head, the final norm)
    parameter_count: int
    trainable_count: int
    # Not floating point (a quantized base's packed weights): FSDP2 leaves them whole on each
    # rank, as accelerate does (bigbatch.memory.fsdp); all of them, and the largest layer's.
    unsharded: int = 0
    layer_unsharded: int = 0
    # The weights that train in a 16-bit dtype: FSDP2 under Trainer's mixed precision keeps
    # float32 masters of them (accelerate), with float32 gradients and optimizer state.
    trainable_half: int = 0


def _nbytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def model_sizes(model: nn.Module) -> ModelSizes:
    """Split ``model``'s weights into what FSDP2 shards per decoder layer and the root.

    >>> sizes = model_sizes(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)] * 2)))
    >>> sizes.parameters, sizes.layer
    (160, 80)
    """
    blocks = _decoder_layers(model)
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return ModelSizes(
        parameters=_nbytes(params),
        trainable=_nbytes(trainable),
        frozen=_nbytes(p for p in params if not p.requires_grad),
        layer=max((_nbytes(b.parameters()) for b in blocks), default=0),
        layer_trainable=max(
            (_nbytes(p for p in b.parameters() if p.requires_grad) for b in blocks), default=0
        ),
        root=_nbytes(p for p in params if id(p) not in in_blocks),
        # A quantized layer's packed weight holds out x in parameters, whatever its bytes.
        parameter_count=sum(p.numel() for p in params)
        + sum(
            m.in_features * m.out_features - m.weight.numel()
            for m in model.modules()
            if isinstance(m, QuantizedLinear)
        ),
        trainable_count=sum(p.numel() for p in trainable),
        unsharded=_nbytes(p for p in params if not p.is_floating_point()),
        trainable_half=_nbytes(p for p in trainable if p.element_size() == 2),
        layer_unsharded=max(
            (_nbytes(p for p in b.parameters() if not p.is_floating_point()) for b in blocks),
            default=0,
        ),
    )


def _wrapped_layers(model: nn.Module) -> list[nn.Module]:
    """The modules Trainer's FSDP2 makes units of: those of the classes the model says not to
    split (transformers' ``_no_split_modules``, accelerate's default; a vision tower's layers
    too), else the decoder layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names] or _decoder_layers(model)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 wraps one by one: the longest ``nn.ModuleList``'s members."""
    lists: list[list[nn.Module]] = [
        list(m) for m in model.modules() if isinstance(m, nn.ModuleList)
    ]
    return max(lists, key=len) if lists else []


def per_rank_bytes(
    sizes: ModelSizes,
    peak_parts: dict[str, int],
    setup: LMSetup,
    *,
    mixed_precision: bool = False,
    state_copies: int = 2,
    evaluation: bool = False,
) -> tuple[int, str]:
    """What one rank holds beyond (negative: below) the one-process trace's peak, and a note:
    DDP's ranks, and FSDP2's where a rank is not traced (:func:`plan_lm`'s ``apart=False``).
    Composed at the one process's peak, so FSDP2's is approximate: on CPU ranks 29-42 % over a
    traced rank for a small Llama's full fine-tune on 2-4 ranks (the optimizer step's
    temporaries and the peak's moment are one process's), 20-24 % with LoRA, 9-13 % with QLoRA
    (``benchmarks/fsdp_ranks.py``); on CUDA under a traced rank (0.85-0.93x for a small Llama
    on 2 ranks, 0.875x for a Qwen2.5-0.5B-shaped full fine-tune on 4, 0.98x with LoRA). With
    ``evaluation``, beyond a forward pass without gradients (``peak_parts`` its trace's): no
    gradients then, nor their reduce-scatter buffers (on CPU ranks 10-20 % over a traced
    rank's forward in fp32, up to 46 % in bf16).

    DDP keeps its own copy of the gradients in its buckets (``gradient_as_bucket_view`` off,
    the default). FSDP2 keeps ``1/N`` of the weights, gradients and optimizer state alive at
    the peak, and adds the root module's weights (gathered for the whole forward and backward),
    the current and the prefetched layer's unsharded weights, and the current layer's
    unsharded gradients with their reduce-scatter copy. Under ``mixed_precision`` (Trainer's
    bf16 or fp16, through accelerate) a rank's shards of 16-bit weights that train are float32
    masters, their gradients and ``state_copies`` of optimizer state float32 too; a quantized
    base's packed weights stay whole on each rank.

    >>> sizes = ModelSizes(1000, 1000, 0, 100, 100, 200, 500, 500)
    >>> per_rank_bytes(sizes, {"parameters": 1000, "gradients": 1000, "optimizer_state": 2000},
    ...                LMSetup(seq_len=8, world_size=4, fsdp=True))[0]  # -3000 + 200 + 400
    -2400
    """
    n = setup.world_size
    if n <= 1:
        return 0, ""
    if not setup.fsdp:
        return sizes.trainable, (
            f"DDP over {n} ranks: its gradient buckets ({format_bytes(sizes.trainable)}) on "
            "each rank"
        )
    resident = peak_parts.get("parameters", 0) + peak_parts.get("gradients", 0)
    resident += peak_parts.get("optimizer_state", 0)
    resident -= sizes.unsharded  # a quantized base's packed weights: whole on each rank
    saved = resident - resident // n
    layer = sizes.layer - sizes.layer_unsharded  # what a layer's all-gather brings
    gathered = sizes.root + 2 * layer + (0 if evaluation else 2 * sizes.layer_trainable)
    masters = 0
    if mixed_precision and not setup.quant:  # accelerate upcasts them, but beside 4-bit ones
        masters = sizes.trainable_half * ((1 if evaluation else 2) + state_copies) // n
    if evaluation:
        return gathered - saved + masters, ""
    note = (
        f"FSDP2 over {n} ranks, composed onto one process's trace: 1/{n} of the weights, "
        f"gradients and optimizer state, plus {format_bytes(gathered)} of gather buffers (the "
        "root's weights, two layers unsharded, a layer's gradients for the reduce-scatter)"
        + (
            f"; the quantized weights ({format_bytes(sizes.unsharded)}) whole on each rank"
            if sizes.unsharded
            else ""
        )
        + (
            f"; float32 masters of the weights that train, with their gradients and optimizer "
            f"state ({format_bytes(masters)} more)"
            if masters
            else ""
        )
    )
    return gathered - saved + masters, note


@dataclass
class LMPlan:
    """A language-model plan: the micro-batch and accumulation per rank for a global batch of
    sequences, and the per-rank peak with its parts (:func:`plan_lm`).

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                num_attention_heads=4, vocab_size=100)
    >>> p = plan_lm(cfg, LMSetup(seq_len=32, lora_r=4), 8, "64MB", device="cpu", precision="fp32",
    ...             overhead=0)
    >>> (p.micro_batch, p.accumulation), p.sizes.trainable_count, p.peak_bytes <= p.usable_bytes
    ((8, 1), 8704, True)
    >>> list(p.parts())[:4]
    ['weights', 'adapters', 'gradients', 'optimizer_state']
    """

    setup: LMSetup
    model_type: str
    global_batch: int  # sequences per optimizer step, all ranks together
    plan: Plan  # one rank's plan (its target: global_batch / world_size)
    sizes: ModelSizes
    fsdp_traced: bool = False  # one FSDP2 rank traced (else one process, the ranks composed)
    per_rank_extra_bytes: int = 0
    paged_bytes: int = 0
    vocab: int = 0
    notes: list[str] = field(default_factory=list)
    source: str = ""  # the config's name or path, as load_lm_config was given it
    # Trainer's evaluation batch a rank (per_device_eval_batch_size); None: not planned
    evaluation: EvaluationPlan | None = None
    # The weights' dtype as planned ("bfloat16"; --dtype auto resolved from the config), what
    # the model is loaded in; "" in plans saved before it was recorded.
    weights_dtype: str = ""

    @property
    def micro_batch(self) -> int:
        return self.plan.micro_batch

    @property
    def accumulation(self) -> int:
        return self.plan.micro_batches

    @property
    def peak_bytes(self) -> int:
        """One rank's predicted peak (on CUDA: reserved memory and handles)."""
        return self.plan.predicted_peak_bytes + self.per_rank_extra_bytes

    @property
    def usable_bytes(self) -> int:
        """What one rank's peak may reach: the budget less margin and overhead (the one-process
        plan's usable memory is this less what a rank holds beyond its trace)."""
        return self.plan.usable_bytes + self.per_rank_extra_bytes

    def parts(self) -> dict[str, int]:
        """The peak's parts: the base and adapter weights, gradients, optimizer state,
        activations, temporaries (of which ``logits``: the micro-batch's logits and the
        float32 copy the loss makes; none through TRL's fused LM head, which never makes them
        whole), the allocator's cache; per rank."""
        p = self.plan.prediction
        parts = p.parts()
        weights = parts.pop("parameters")
        ranks = self.setup.world_size if self.fsdp_traced else 1  # a rank holds its shard
        adapters = min(weights, self.sizes.trainable // ranks) if self.setup.lora_r else 0
        tokens = self.micro_batch * self.setup.seq_len
        logits = tokens * self.vocab * (2 + 4 if p.precision != "fp32" else 4)
        if self.setup.loss == "trl" and not self.setup.label_smoothing:
            logits = 0
        return {
            "weights": weights - adapters,
            "adapters": adapters,
            **parts,
            "logits": logits,
            "per_rank": self.per_rank_extra_bytes,
        }

    def logits_a_fused_head_frees(self) -> int:
        """The bytes of logits this plan of the model's own loss holds (unsmoothed) that TRL's
        ``SFTTrainer``, through its fused LM head, never makes, where they are a tenth of the
        peak or more, else 0: what a plan with ``--loss trl`` would give the micro-batch. Such
        a plan holds for ``SFTTrainer`` too, with that much unused."""
        if self.setup.loss != "model" or self.setup.label_smoothing:
            return 0
        logits = self.parts()["logits"]
        return logits if logits >= 0.1 * self.peak_bytes else 0

    def save(self, path: str | Path) -> Path:
        """Write the plan to ``path`` as JSON (whole or not at all, readable by all), for
        :meth:`load` where the model trains: plan once, on any machine, and let the training
        job start without tracing the step again (half a minute for an 8B model on 2 CPU cores).
        ``bigbatch plan --hf ... --save PATH`` writes the same file.

        >>> import tempfile, transformers
        >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
        >>> plan = plan_lm(cfg, LMSetup(seq_len=32, lora_r=4), 8, "64MB", device="cpu",
        ...                precision="fp32", overhead=0)
        >>> path = plan.save(Path(tempfile.mkdtemp()) / "plan.json")
        >>> LMPlan.load(path) == plan
        True
        """
        path = Path(path)
        # The CPU's workspace calibration describes this machine, not the card: left out.
        body = asdict(replace(self, plan=replace(self.plan, calibration=None)))
        head = {"format": PLAN_FORMAT, "version": PLAN_FORMAT_VERSION, "bigbatch": _version()}
        atomic_write_text(path, json.dumps(head | body, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LMPlan:
        """The plan :meth:`save` wrote to ``path``. A file that is not one, or one a newer
        bigbatch wrote, is refused in one line with the fix; nothing in it is executed (JSON).

        >>> LMPlan.load("missing.json")
        Traceback (most recent call last):
        ...
        FileNotFoundError: missing.json: no plan there; write one with `bigbatch plan --hf NAME_OR_PATH ... --save missing.json` (or LMPlan.save)
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no plan there; write one with `bigbatch plan --hf NAME_OR_PATH ... "
                f"--save {path}` (or LMPlan.save)"
            )
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(
                f"{path} is not a bigbatch language-model plan (`bigbatch plan --hf ... --save` "
                "and LMPlan.save write them)"
            )
        # The header off: what is left is the plan's own fields.
        del data["format"]
        version, written_by = data.pop("version", None), data.pop("bigbatch", "?")
        if not isinstance(version, int) or version > PLAN_FORMAT_VERSION:
            raise ValueError(
                f"{path} was written by bigbatch {written_by} in plan format {version}, newer "
                f"than this bigbatch {_version()} reads ({PLAN_FORMAT_VERSION}): upgrade bigbatch "
                "(pip install -U bigbatch), or plan again with this one"
            )
        try:
            p = data["plan"]
            p["prediction"] = _dataclass_from(MemoryPrediction, p["prediction"])
            p["curve"] = [(int(b), int(peak)) for b, peak in p["curve"]]
            p["samples_per_s"] = {int(b): float(v) for b, v in p["samples_per_s"].items()}
            data["plan"] = _dataclass_from(Plan, p)
            data["setup"] = _dataclass_from(LMSetup, data["setup"])
            data["sizes"] = _dataclass_from(ModelSizes, data["sizes"])
            if data.get("evaluation") is not None:
                evaluation = data["evaluation"] | {"shape": tuple(data["evaluation"]["shape"])}
                data["evaluation"] = _dataclass_from(EvaluationPlan, evaluation)
            return _dataclass_from(cls, data)
        except _UnknownFields as exc:  # a newer bigbatch's plan: fields added, same format
            raise ValueError(
                f"{path} was written by bigbatch {written_by}, with {exc} that this bigbatch "
                f"{_version()} does not know: upgrade bigbatch (pip install -U bigbatch), or plan "
                "again with this one"
            ) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"{path} is an incomplete or damaged plan ({type(exc).__name__}: {exc}): write "
                "it again with `bigbatch plan --hf ... --save`"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {
            "model_type": self.model_type,
            "setup": s.describe(),
            "dtype": s.dtype,  # the weights' (auto: the config's)
            "seq_len": s.seq_len,
            "world_size": s.world_size,
            "fsdp": s.fsdp,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "tokens_per_step": self.global_batch * s.seq_len,
            "peak_bytes_per_rank": self.peak_bytes,
            "budget_bytes": self.plan.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "parameters": self.sizes.parameter_count,
            "trainable_parameters": self.sizes.trainable_count,
            "parts": self.parts(),
            "paged_optimizer_bytes": self.paged_bytes,
            "eval_batch": self.eval_batch,
            "eval_peak_bytes_per_rank": self.eval_peak_bytes,
            "notes": [*self.notes, *self.plan.prediction.notes],
        }

    @property
    def eval_batch(self) -> int | None:
        """Trainer's evaluation batch a rank (``per_device_eval_batch_size``); None: not
        planned."""
        return self.evaluation.batch if self.evaluation else None

    @property
    def eval_peak_bytes(self) -> int | None:
        """One rank's predicted peak while evaluating at :attr:`evaluation`'s batch."""
        if self.evaluation is None:
            return None
        return self.evaluation.predicted_peak_bytes + self.per_rank_extra_bytes

    def summary(self) -> str:
        s = self.setup
        ranks = f" on each of {s.world_size} ranks" if s.world_size > 1 else ""
        parts = ", ".join(
            f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.parts().items() if v > 0
        )
        last = self.plan.last_micro_batch
        text = (
            f"{self.global_batch} sequences of {s.seq_len} tokens a step = micro-batch "
            f"{self.micro_batch} x {self.accumulation} accumulation"
            + (f" (the last {last})" if last != self.micro_batch else "")
            + f"{ranks}; predicted peak "
            f"{format_bytes(self.peak_bytes)} of {format_bytes(self.usable_bytes)} usable "
            f"(budget {format_bytes(self.plan.budget_bytes)}); {parts}"
        )
        if self.paged_bytes:
            text += f"; paged optimizer state {format_bytes(self.paged_bytes)} outside the budget"
        if self.evaluation is not None and self.eval_peak_bytes is not None:
            n = self.evaluation.batch
            text += (
                f"; evaluation {n} sequence{'s' if n > 1 else ''} a forward pass{ranks} (no "
                f"gradients), predicted peak {format_bytes(self.eval_peak_bytes)}"
            )
            if not self.evaluation.fits:
                text += " (over the budget even at 1: evaluate on a bigger card)"
        return text + "".join(f"; note: {n}" for n in self.notes)


PLAN_FORMAT = "bigbatch language-model plan"
PLAN_FORMAT_VERSION = 1  # raised when a field changes meaning; new fields with defaults keep it


def _version() -> str:
    from bigbatch import __version__

    return __version__


class _UnknownFields(ValueError):
    """A saved plan's fields that this bigbatch's classes lack (a newer one wrote them)."""


def _dataclass_from(cls: Any, data: dict[str, Any]) -> Any:
    """``cls(**data)``, refusing fields ``cls`` does not have (a newer plan's) by name.

    >>> _dataclass_from(LMSetup, {"seq_len": 512, "lora_r": 8}).describe()
    'LoRA r=8 (all-linear), 512 tokens, padded'
    """
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise _UnknownFields(f"{cls.__name__}'s field(s) {', '.join(sorted(unknown))}")
    return cls(**data)


# Over 80 lines: a plan's steps in the order they run, read top to bottom (the setup, the
# floor, the plan, evaluation), each a call of its own.
def plan_lm(
    config: Any,
    setup: LMSetup,
    global_batch: int,
    budget: str | int,
    *,
    device: str = "cuda",
    precision: str = "bf16",
    optimizer: str = "adamw",
    margin: float = DEFAULT_MARGIN,
    overhead: int | None = None,
    evaluation: bool = True,
    apart: bool = True,
) -> LMPlan:
    """Plan a fine-tune of ``config``'s model: the largest micro-batch (sequences per rank)
    under ``budget`` and the accumulation that makes ``global_batch`` sequences a step over
    ``setup.world_size`` ranks, never changing that batch; with ``evaluation``, Trainer's
    evaluation batch too (:attr:`LMPlan.evaluation`).

    An FSDP2 rank is traced on a fake process group. Where this process has a process group
    already (under torchrun, once ``TrainingArguments`` is made), that happens in a process of
    its own (:mod:`bigbatch.memory.lm_apart`, a few seconds more); with ``apart=False``, or
    where that cannot run, the ranks are composed onto this process's trace instead (quicker,
    but no bound: over a traced rank on CPU ranks, up to 15 % under one on CUDA).

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                num_attention_heads=4, vocab_size=100)
    >>> p = plan_lm(cfg, LMSetup(seq_len=32, lora_r=4), 8, "64MB", device="cpu", precision="fp32",
    ...             overhead=0)
    >>> p.micro_batch * p.accumulation
    8
    """
    check_setup(config, setup, global_batch, precision)
    kwargs: dict[str, Any] = {"device": device, "precision": precision, "optimizer": optimizer}
    # FSDP2 is traced as one rank on a fake process group, where this process has none of its
    # own (under torchrun it has: traced apart, else composed, as DDP always is).
    n, fsdp = setup.world_size, setup.sharded
    per_rank, traced, not_apart = global_batch // n, fsdp and not dist.is_initialized(), ""
    budget_bytes = resolve_budget(budget, device)
    if fsdp and not traced and apart:
        # A card's name goes as it is (the plan's notes name the card); any other budget in
        # bytes, as this process resolved it ("auto": its card's free memory), and so does
        # the overhead (its CUDA context, or on a CPU its size).
        sent = budget if isinstance(budget, str) and find_card(budget) else budget_bytes
        held = default_overhead(budget, device) if overhead is None else overhead
        options = {**kwargs, "margin": margin, "overhead": held, "evaluation": evaluation}
        got = _plan_apart(config, setup, global_batch, sent, options)
        if isinstance(got, LMPlan):
            return got
        not_apart = f"; not traced apart: {got}"
    setup = _named(config, setup, precision)
    notes = _setup_notes(config, setup, budget, precision)
    spec_at = lm_spec_at(config, setup, sharded=traced, **kwargs)
    with _refused_in_one_line(config, setup):
        sizes, paged = _sizes_and_paged_state(lm_spec_at(config, setup, **kwargs)(1), setup)
    overhead = default_overhead(budget, device) if overhead is None else overhead
    usable = usable_bytes(budget_bytes, overhead, device, margin)
    with fake_ranks(n) if traced else contextlib.nullcontext():
        # Composed: from the floor's weights, gradients and state, the same at every micro-batch.
        with _refused_in_one_line(config, setup):
            floor = predict_peak(spec_at(1).in_window(per_rank))
        extra, note = _beyond_the_trace(
            traced, sizes, floor.parts(), setup, precision, optimizer, evaluation_planned=evaluation
        )
        try:
            plan = plan_micro_batch(
                spec_at,
                per_rank,
                budget_bytes,
                device=device,
                margin=margin,
                overhead=overhead,
                extra_bytes=extra,
                known={1: floor},
            )
        except DoesNotFitError as exc:
            why = _does_not_fit(
                config, setup, floor, extra, (usable, budget_bytes, margin, overhead)
            )
            raise DoesNotFitError(why, exc.floor) from None
        beyond = _composed_evaluation(sizes, setup, precision, optimizer, extra, traced)
        evaluated = _plan_evaluation(spec_at, plan, per_rank, beyond) if evaluation else None
    return LMPlan(
        setup=setup,
        model_type=config.model_type,
        global_batch=global_batch,
        plan=plan,
        sizes=sizes,
        fsdp_traced=traced,
        per_rank_extra_bytes=extra,
        paged_bytes=paged,
        vocab=int(_text_config(config).vocab_size),
        notes=_plan_notes(note + not_apart, setup, device) + notes,
        source=str(getattr(config, "_name_or_path", "") or ""),
        evaluation=evaluated,
        weights_dtype=str(weights_dtype(config, setup)).removeprefix("torch."),
    )


def _plan_apart(
    config: Any, setup: LMSetup, global_batch: int, budget: str | int, options: dict[str, Any]
) -> LMPlan | str:
    """``plan_lm(config, setup, global_batch, budget, **options)`` in a process of its own, with
    no process group (:mod:`bigbatch.memory.lm_apart`); or, where it cannot run there, why (a
    line for the composed plan's notes). A plan that does not fit raises as here. What only
    this process can measure (an ``"auto"`` budget, the overhead) comes resolved in
    ``budget`` and ``options``; a model built by its own code (trusted here) is built there by
    the same code, copied beside its config."""
    request = {**options, "setup": asdict(setup), "global_batch": global_batch, "budget": budget}
    request["trust_remote_code"] = _remote(config)
    with tempfile.TemporaryDirectory(prefix="bigbatch-plan-") as folder:
        where = Path(folder)
        config.save_pretrained(where / "config")
        if _remote(config):
            try:
                _own_code_beside(config, where / "config")
            except (OSError, ImportError, ValueError) as exc:
                return f"its own code could not be copied for it ({type(exc).__name__}: {exc})"
        (where / "request.json").write_text(json.dumps(request))
        done = _run_apart(folder)
        if (where / "does_not_fit.json").is_file():
            said = json.loads((where / "does_not_fit.json").read_text())
            raise DoesNotFitError(said["message"], _dataclass_from(MemoryPrediction, said["floor"]))
        if not (where / "plan.json").is_file():
            return done or "it wrote no plan"
        plan = LMPlan.load(where / "plan.json")
    notes = list(plan.notes)
    notes[0] += " (in a process of its own: this one has a process group already)"
    return replace(plan, source=str(getattr(config, "_name_or_path", "") or ""), notes=notes)


def _own_code_beside(config: Any, folder: Path) -> None:
    """Copies the code that builds a trusted model (the files of what its ``auto_map`` names
    for its config and its causal-LM head, with what they import) into ``folder``, beside its
    saved ``config.json``, where transformers looks for it when loading from that folder."""
    import shutil

    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    named = config.auto_map
    for key in ("AutoConfig", "AutoModelForCausalLM"):
        refs = named.get(key)
        for ref in refs if isinstance(refs, list | tuple) else [refs]:
            if not ref:
                continue
            built_by = get_class_from_dynamic_module(ref, config._name_or_path)
            code = Path(str(sys.modules[built_by.__module__].__file__)).parent
            for source in code.glob("*.py"):
                if source.name != "__init__.py":
                    shutil.copyfile(source, folder / source.name)


def _run_apart(folder: str) -> str:
    """Runs ``python -m bigbatch.memory.lm_apart folder`` as no rank of torchrun's job, on no
    GPU, with this bigbatch; what went wrong, in a line, or nothing."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _TORCHRUN and not key.startswith("TORCHELASTIC_")
    }
    env["CUDA_VISIBLE_DEVICES"] = ""  # never a context on a card the job trains on
    here = str(Path(__file__).resolve().parents[2])  # wherever the script found bigbatch
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "bigbatch.memory.lm_apart", folder]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=_APART_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the process did not finish ({type(exc).__name__}: {exc})"
    lines = done.stderr.strip().splitlines()
    return (
        f"the process failed ({lines[-1] if lines else done.returncode})" if done.returncode else ""
    )


def _named(config: Any, setup: LMSetup, precision: str) -> LMSetup:
    """``setup`` with what it leaves to ``auto`` named, so that the plan says what the run
    loads: the attention transformers chooses, and a 4-bit base's storage."""
    return _storage_named(with_chosen_attention(config, setup), precision)


def _storage_named(setup: LMSetup, precision: str) -> LMSetup:
    """``setup`` with a 4-bit base's storage named (:func:`quant_storage_for` at ``precision``):
    what the model is built with, whoever builds it from the setup next."""
    if setup.quant != 4:
        return setup
    return replace(setup, quant_storage=quant_storage_for(setup, precision))


def with_chosen_attention(config: Any, setup: LMSetup) -> LMSetup:
    """``setup`` with the attention ``from_pretrained`` would choose for ``config``'s model in
    place of ``auto`` (SDPA where the model has it, else eager, as transformers decides), so
    that a plan names what it was traced with and what the run should load.

    >>> import transformers
    >>> cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, head_dim=16,
    ...                                 num_hidden_layers=1, num_attention_heads=4,
    ...                                 num_key_value_heads=2, vocab_size=100)
    >>> with_chosen_attention(cfg, LMSetup(seq_len=16)).attn  # no SDPA in transformers 5.23
    'eager'
    """
    if setup.attn != "auto":
        return setup
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            # Built as from_pretrained builds it without attn_implementation; transformers
            # records its choice in the model's config.
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(config), trust_remote_code=_remote(config)
            )
    except Exception:  # the planner's own build says what is wrong, in one line
        return replace(setup, attn="sdpa")
    chosen = str(getattr(model.config, "_attn_implementation", None) or "sdpa")
    return replace(setup, attn=chosen if chosen in ATTENTIONS else "sdpa")


def _plan_evaluation(
    spec_at: Callable[[int], StepSpec],
    plan: Plan,
    largest: int,
    beyond: Callable[[MemoryPrediction], int] | None = None,
) -> Any:
    """Trainer's evaluation batch a rank, up to ``largest``: forward passes without gradients
    at the plan's sequence length (the logits and their float32 copy for the loss: at long
    sequences and large vocabularies more than training's micro-batch holds), beside what
    training keeps meanwhile: the weights and the optimizer state (the gradients are freed at
    each optimizer step) and, on CUDA, the cuBLAS workspace and handle of autograd's thread,
    under the training plan's usable memory. An FSDP2 rank is traced as its training is, on
    the fake process group: its shards, each layer's gathered weights until FSDP2 frees them;
    ``beyond(prediction)``: what a rank composed onto one process's trace holds beyond it,
    less what training's rank does (the plan's usable memory has that taken off already)."""
    trained = plan.prediction

    def peak_at(b: int) -> int:
        p = predict_evaluation_peak(spec_at(b), state_copies=0, held_bytes=trained.optimizer_state)
        kept = max(0, trained.library_workspace_bytes - p.library_workspace_bytes)
        kept += max(0, trained.cuda_handle_bytes - p.cuda_handle_bytes)
        return p.planning_bytes + kept + (beyond(p) if beyond else 0)

    return plan_evaluation_batch(peak_at, largest, plan.usable_bytes, (spec_at(1).input_shape[0],))


def _card_for(budget: str | int, setup: LMSetup) -> Card | None:
    """The card ``budget`` names, if any; refuses what cannot run on it."""
    card = find_card(budget) if isinstance(budget, str) else None
    if card is not None and card.compute_capability < AMPERE and setup.attn == "flash_attention_2":
        major, minor = card.compute_capability
        raise ValueError(
            f"flash_attention_2 runs on Ampere or newer (compute capability {AMPERE[0]}.{AMPERE[1]}"
            f"), and the {card.short_name} is {major}.{minor}: plan with --attn sdpa"
        )
    return card


@contextlib.contextmanager
def _refused_in_one_line(config: Any, setup: LMSetup) -> Iterator[None]:
    """What transformers or torch refuse while the model is built and its step traced, which
    the same model would refuse on the card, as one line with the fix."""
    name = _model_name(config)
    # Fake tensors log the traceback of a kernel that refused its arguments at ERROR before
    # raising: what is refused here is said below in one line (anything else still raises).
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    except AssertionError as exc:  # torch's own checks of a layer's arguments
        raise ValueError(
            f"transformers cannot build {name} from this config ({exc}): check its values"
        ) from None
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        raise ValueError(
            f"{name} has no SDPA attention in this transformers: plan it with --attn eager"
        ) from None
    except AttributeError as exc:
        wrapped = _lora_over_a_tuple(exc) if setup.lora_r else None  # peft's: with LoRA only
        if wrapped is None:
            raise
        culprit, kind, others = wrapped
        raise ValueError(
            f"peft's LoRA cannot wrap {name}'s {culprit!r} modules ({kind}, an nn.Linear whose "
            f"forward returns a tuple), which --lora-targets {setup.lora_targets} includes: the "
            f"step fails in peft ({exc}) as training would; name the targets without them, e.g. "
            f"--lora-targets {','.join(others)} (LMSetup(lora_targets=...) in Python)"
        ) from None
    except RuntimeError as exc:
        # transformers 5 runs a mixture of experts' weights through torch's grouped_mm, which
        # takes 16-bit weights only.
        if "to be BFloat16 or supported Float16" not in str(exc):
            raise
        if setup.quant:
            raise ValueError(
                f"--qlora quantizes linear layers only: {name}'s experts are none, and are left "
                "in float32 as peft's prepare_model_for_kbit_training leaves what is not "
                "quantized, which torch's grouped_mm that runs them refuses: plan LoRA without "
                "--qlora"
            ) from None
        raise ValueError(
            f"{name}'s experts run through torch's grouped_mm, which takes bfloat16 or float16 "
            "weights, and these are float32 (--dtype, or the config's): plan with --dtype bf16, "
            "as the model trains"
        ) from None
    finally:
        fake_log.setLevel(level)


def _lora_over_a_tuple(exc: BaseException) -> tuple[str, str, list[str]] | None:
    """The module peft's LoRA wrapped whose forward returned a tuple (Llama 4's router, an
    nn.Linear), found in the failed step's frames, and the other wrapped modules' names; None
    where ``exc`` came from anything else."""
    from peft.tuners.lora import LoraLayer

    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    for frame in frames:
        layer = frame.f_locals.get("self")
        if isinstance(layer, LoraLayer) and isinstance(frame.f_locals.get("result"), tuple):
            break
    else:
        return None
    # The outermost module of the step holds every wrapped layer, under its own name.
    model = next(
        f.f_locals["self"] for f in frames if isinstance(f.f_locals.get("self"), nn.Module)
    )
    wrapped = [(n.rsplit(".", 1)[-1], m) for n, m in model.named_modules()]
    culprit = next((n for n, m in wrapped if m is layer), None)
    if culprit is None:  # a step run outside the model (a wrapper's): not said here
        return None
    kind = type(layer.get_base_layer()).__name__
    others = {n for n, m in wrapped if isinstance(m, LoraLayer) and n != culprit}
    return culprit, kind, sorted(others)


def _plan_notes(note: str, setup: LMSetup, device: str) -> list[str]:
    """The plan's notes: how the ranks were planned, and what the prediction leaves out."""
    flash = setup.attn == "flash_attention_2"
    nccl = setup.world_size > 1 and device_kind(device).distributed_backend == "nccl"
    return [m for m in (note, _FLASH_NOTE if flash else "", _NCCL_NOTE if nccl else "") if m]


def _check_fp16_weights(config: Any, setup: LMSetup, precision: str) -> None:
    """A full fine-tune whose weights are float16, under fp16: torch's GradScaler cannot
    unscale float16 gradients, so Trainer (``fp16=True``) stops at its first step. Adapters
    are float32 (peft keeps them so), whatever the base."""
    if precision == "fp16" and not setup.lora_r and weights_dtype(config, setup) == torch.float16:
        raise ValueError(
            "a full fine-tune of float16 weights in fp16: torch's GradScaler cannot unscale "
            "float16 gradients (Trainer stops at its first step): plan with --dtype fp32 "
            "(float32 weights under fp16 autocast), or with --lora R"
        )


def _setup_notes(config: Any, setup: LMSetup, budget: str | int, precision: str) -> list[str]:
    """What the plan says of the card and the weights' dtype."""
    card = _card_for(budget, setup)
    return _bf16_notes(card, config, setup, precision) + _dtype_notes(config, setup)


def _bf16_notes(card: Card | None, config: Any, setup: LMSetup, precision: str) -> list[str]:
    """Where the card only emulates bfloat16 and the plan computes in it (autocast, the weights,
    or a quantized base's compute dtype, which follows the weights): how to train in fp16."""
    if card is None or not card.emulates_bf16:
        return []
    if precision != "bf16" and weights_dtype(config, setup) != torch.bfloat16:
        return []
    # GradScaler cannot unscale float16 gradients: a full fine-tune keeps float32 weights.
    weights = "--dtype fp16 for the frozen base" if setup.lora_r else "--dtype fp32 weights"
    return [
        card.bf16_note(f"plan and train in fp16: --precision fp16 (Trainer's fp16=True), {weights}")
    ]


def _dtype_notes(config: Any, setup: LMSetup) -> list[str]:
    """Where the config names no dtype and the plan takes the config's: the weights were
    planned in float32, twice a 16-bit checkpoint's bytes (transformers' default configs, and
    a config written by hand, often name none)."""
    if setup.dtype != "auto" or _config_dtype(config) is not None:
        return []
    return [
        "the config names no dtype: the weights are planned in float32 (as from_pretrained "
        "loads them without one); plan a 16-bit checkpoint with --dtype bf16 or --dtype fp16"
    ]


_FLASH_NOTE = "flash_attention_2 traced as SDPA's flash kernel (the same memory)"
# NCCL's communicators take device memory of their own, outside PyTorch's allocator: by the
# node's topology, hundreds of MiB a rank and more (NVIDIA/nccl#864, #964), which no trace on
# a CPU can see.
_NCCL_NOTE = (
    "NCCL's own buffers (outside PyTorch's allocator; hundreds of MiB a rank or more, by the "
    "node's topology) are not in the prediction: add them to --overhead"
)


def _does_not_fit(
    config: Any, setup: LMSetup, floor: Any, extra: int, limits: tuple[int, int, float, int]
) -> str:
    usable, budget_bytes, margin, overhead = limits
    return (
        f"{config.model_type} ({setup.describe()}) does not fit even at micro-batch 1: "
        f"predicted {format_bytes(floor.planning_bytes + extra)} a rank of "
        f"{format_bytes(usable)} usable (budget {format_bytes(budget_bytes)} less "
        f"{margin:.0%} margin and {format_bytes(overhead)} overhead; {floor.breakdown()}). Try "
        + _what_to_try(setup, weights_dtype(config, setup))
    )


def _beyond_the_trace(
    traced: bool,
    sizes: ModelSizes,
    parts: dict[str, int],
    setup: LMSetup,
    precision: str,
    optimizer: str,
    *,
    evaluation_trace: bool = False,
    evaluation_planned: bool = False,
) -> tuple[int, str]:
    """What a rank holds beyond the trace (with ``evaluation_trace``, an evaluation trace), and
    the note: nothing for a traced FSDP2 rank, else :func:`per_rank_bytes`'s composition, which
    names evaluation's composition only where evaluation is planned too."""
    if traced:
        return 0, _traced_note(setup, sizes, precision)
    extra, note = per_rank_bytes(
        sizes,
        parts,
        setup,
        mixed_precision=precision in ("bf16", "fp16"),
        state_copies=STATE_COPIES.get(optimizer, 2),
        evaluation=evaluation_trace,
    )
    if setup.sharded and evaluation_planned:
        note += "; evaluation's forward passes composed the same way, without gradients"
    return extra, note


def _composed_evaluation(
    sizes: ModelSizes,
    setup: LMSetup,
    precision: str,
    optimizer: str,
    training_extra: int,
    traced: bool,
) -> Callable[[MemoryPrediction], int] | None:
    """For composed FSDP2 ranks (not ``traced``): what a rank holds beyond an evaluation trace
    of one process (:func:`per_rank_bytes` without gradients), less ``training_extra``, which
    the plan's usable memory and :attr:`LMPlan.eval_peak_bytes` count already. None for one
    process, DDP's ranks (their buckets stay as in training) and a traced FSDP2 rank."""
    if traced or not setup.sharded:
        return None

    def beyond(prediction: MemoryPrediction) -> int:
        parts = prediction.parts()
        extra, _ = _beyond_the_trace(
            False, sizes, parts, setup, precision, optimizer, evaluation_trace=True
        )
        return extra - training_extra

    return beyond


def _traced_note(setup: LMSetup, sizes: ModelSizes, precision: str) -> str:
    how = (
        "prepared as accelerate prepares it for Trainer"
        if trainer_sharding()
        else "each decoder layer and the root under fully_shard (accelerate is not installed)"
    )
    whole = (
        f"; the quantized weights ({format_bytes(sizes.unsharded)}) whole on each rank, as "
        "accelerate leaves bitsandbytes' default uint8 storage out of the sharding"
        if sizes.unsharded
        else ""
    )
    masters = (
        f"; float32 masters of the weights that train, gathered in {precision} (accelerate's "
        "mixed precision)"
        if trainer_sharding()
        and precision in ("bf16", "fp16")
        and sizes.trainable_half
        and not setup.quant
        else ""
    )
    return (
        f"FSDP2 over {setup.world_size} ranks, traced as one rank on a fake process group, "
        f"{how}: its shards of the weights, gradients and optimizer state, each unit's "
        f"all-gather and reduce-scatter buffers while they live, on FSDP2's own CUDA streams"
        f"{whole}{masters}"
    )


def _sizes_and_paged_state(spec: StepSpec, setup: LMSetup) -> tuple[ModelSizes, int]:
    """The model's weights by kind, and a paged optimizer's state per rank (0 for others)."""
    model = build_on_meta(spec.model)
    sizes = model_sizes(model)
    paged = paged_state_bytes(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    return sizes, paged // setup.world_size if setup.fsdp else paged


def _what_to_try(setup: LMSetup, weights: torch.dtype) -> str:
    tries = []
    if not setup.gradient_checkpointing:
        tries.append("--gradient-checkpointing")
    if not setup.lora_r:
        tries.append("--lora 16")
    elif not setup.quant:
        if weights == torch.float32:  # a frozen base needs no float32 copy
            tries.append("--dtype bf16 or fp16 (the frozen base is float32 now)")
        tries.append("--qlora")
    tries.append(f"a shorter --seq-len than {setup.seq_len}")
    if not setup.fsdp:
        tries.append("--fsdp over more ranks")
    tries.append("a bigger card")
    return ", ".join(tries)


def plan_table(
    config: Any,
    setup: LMSetup,
    global_batch: int,
    budget: str | int,
    *,
    seq_lens: list[int],
    world_sizes: list[int],
    **kwargs: Any,
) -> list[LMPlan | str]:
    """One plan per sequence length and rank count (a ``str``, why, where none fits), for
    choosing one: their evaluation is left unplanned (plan the row chosen with
    :func:`plan_lm`)."""
    rows: list[LMPlan | str] = []
    setup = with_chosen_attention(config, setup)  # once, not a model build a row
    for length in seq_lens:
        for ranks in world_sizes:
            row = replace(setup, seq_len=length, world_size=ranks, fsdp=setup.fsdp and ranks > 1)
            if global_batch % ranks:
                rows.append(f"{length} tokens, {ranks} ranks: {global_batch} is no multiple")
                continue
            try:
                rows.append(plan_lm(config, row, global_batch, budget, evaluation=False, **kwargs))
            except DoesNotFitError as exc:
                rows.append(f"{length} tokens, {ranks} rank(s): {str(exc).split(' (budget')[0]}")
    return rows
