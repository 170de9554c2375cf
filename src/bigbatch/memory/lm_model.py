"""A fine-tune's model and step as the planner traces them, on the meta device: transformers
builds the model (``AutoModelForCausalLM.from_config``), peft its adapters,
:mod:`bigbatch.memory.bnb`'s stand-ins its quantized base; the step is the causal-LM loss (or
TRL's fused head, or a smoothed one) over padded or packed sequences; FSDP2 shards it on a fake
process group. Also the model's sizes, and a rank's memory composed from one process's trace
(:func:`per_rank_bytes`). Imported from :mod:`bigbatch.memory.lm`.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bigbatch.memory.bnb import QuantizedLinear, is_packed, paged_state_bytes, quantize_linears
from bigbatch.memory.budget import format_bytes
from bigbatch.memory.fake_branches import known_values
from bigbatch.memory.fsdp import (
    shard_as_trainer,
    shard_decoder_layers,
    trainer_sharding,
)
from bigbatch.memory.lm_attention import traced_flash_attention
from bigbatch.memory.lm_setup import (
    LMSetup,
    _check_loss,
    _fused_lm_head,
    _model_name,
    _remote,
    _storage_named,
    _text_config,
    quant_compute_dtype,
    quant_storage_dtype,
    weights_dtype,
)
from bigbatch.memory.meta import build_on_meta
from bigbatch.memory.stack import LayerStack
from bigbatch.memory.step import StepSpec

__all__ = [
    "ModelSizes",
    "lm_factory",
    "lm_spec_at",
    "lora_config",
    "model_sizes",
    "per_rank_bytes",
]


def _add_sft_trainers_head(model: nn.Module) -> None:
    """TRL's fused LM head as SFTTrainer puts it on the model it trains (under peft's wrapper),
    with the outputs its metrics read."""
    add_fused_lm_head = _fused_lm_head()
    if add_fused_lm_head is not None:
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))


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
        # flash_attention_2 needs its package and a GPU: the trace runs transformers' wrapper
        # around SDPA's flash kernel, whose memory is flash-attn's (lm_attention.py).
        attn = {"auto": None}.get(setup.attn, setup.attn)
        if attn == "flash_attention_2":
            attn = traced_flash_attention()
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
            _mark_quantized(model)
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


def _mark_quantized(model: nn.Module) -> None:
    """What transformers' quantizer marks on a model it has loaded quantized: model code reads
    it where a real run picks a dtype (flash_attention_2's wrapper casts float32 inputs to the
    config's dtype, falcon's and jamba's layers theirs)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.config._is_quantized = True


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
    transformers then builds the attention mask, and SDPA takes it); packed ones one row of
    ``b * seq_len`` tokens whose ``position_ids`` restart at each sequence (SDPA and eager
    attention then take a mask over the row; flash_attention_2 none).

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
            return _packed_row(b, length, vocab, where)
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


def _packed_row(b: int, length: int, vocab: int, where: Any) -> dict[str, torch.Tensor]:
    """``b`` sequences of ``length`` tokens in one row, whose ``position_ids`` restart at each
    (SDPA and eager attention then take a block-diagonal mask; flash_attention_2 reads the
    sequences' bounds from them and takes none: lm_attention.py)."""
    ids = torch.randint(0, vocab, (1, b * length), device=where)

    def restarts(device: Any = None) -> torch.Tensor:
        return torch.arange(length, device=device).repeat(b).unsqueeze(0)

    positions = known_values(restarts(where), restarts)
    return {"input_ids": ids, "labels": ids, "position_ids": positions}


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


def _sizes_and_paged_state(spec: StepSpec, setup: LMSetup) -> tuple[ModelSizes, int]:
    """The model's weights by kind, and a paged optimizer's state per rank (0 for others)."""
    model = build_on_meta(spec.model)
    sizes = model_sizes(model)
    paged = paged_state_bytes(spec.optimizer, [p for p in model.parameters() if p.requires_grad])
    return sizes, paged // setup.world_size if setup.fsdp else paged
