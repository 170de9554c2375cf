"""A language model's fine-tune as a user describes it (:class:`LMSetup`: full, LoRA, QLoRA;
checkpointing, attention, packing; one card, DDP or FSDP2), its ``config.json`` (a file, a
folder or the Hugging Face cache), the dtypes it trains in, and the checks that refuse, in one
line with the fix, a fine-tune that cannot run. Imported from :mod:`bigbatch.memory.lm`.

>>> LMSetup(seq_len=1024, quant=4, lora_r=16).describe()
'QLoRA 4-bit r=16 (all-linear), 1024 tokens, padded'
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ATTENTIONS",
    "LOSSES",
    "QLORA_PREPS",
    "QUANT_STORAGES",
    "LMSetup",
    "dtype_flag",
    "load_lm_config",
    "quant_compute_dtype",
    "quant_storage_dtype",
    "quant_storage_for",
    "with_chosen_attention",
]

ATTENTIONS = ("auto", "sdpa", "eager", "flash_attention_2")
LOSSES = ("model", "trl")
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
