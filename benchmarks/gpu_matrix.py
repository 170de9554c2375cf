"""The CUDA memory matrix: the training steps whose peaks `make gpu-evidence` records on a GPU
(benchmarks/record_trace.py, one process each) and whose recorded traces test the CUDA model
from a CPU (tests/memory/test_gpu_truth.py).

A row is plain data (JSON in the trace it produces), so a trace recorded today can be turned
back into the same :class:`~bigbatch.memory.step.StepSpec` by any later checkout
(:func:`spec_of`). Its keys: ``kind`` (timm, smp, unet3d, llama), ``arch``, ``size`` (image
side, volume side or tokens), ``batch``, ``precision``, ``optimizer``, and per kind:
``classes`` (timm, default 10), ``encoder`` (smp), ``widths`` (unet3d), ``layers``,
``hidden``, ``vocab`` (llama, default 8, 1024, 32000), ``model``, ``lora``, ``quant``,
``ckpt`` (llama, hf; timm: its library's switch; unet3d: torch's checkpoint_wrapper; smp: a
timm ``tu-`` encoder's switch and the wrapper around the decoder's blocks), ``packing``,
``ranks`` (hf: FSDP2's ranks, one of them recorded and predicted on a fake process group:
:func:`ranks_of`), ``cudnn_benchmark`` (default off).

    python benchmarks/gpu_matrix.py          # the rows, one name a line
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.memory.step import StepSpec


def _timm(arch: str, ckpt: bool = False, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        from bigbatch.models import enable_grad_checkpointing

        model = timm.create_model(arch, **kwargs)
        return enable_grad_checkpointing(model) if ckpt else model  # grad_checkpointing=true

    build.__name__ = arch
    return build


def _unet3d(widths: tuple[int, ...], ckpt: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from monai.networks.nets import UNet

        from bigbatch.models import enable_grad_checkpointing

        strides = (2,) * (len(widths) - 1)
        model = UNet(3, 4, 4, channels=widths, strides=strides, num_res_units=2)
        return enable_grad_checkpointing(model) if ckpt else model  # torch's checkpoint_wrapper

    return build


def _smp(arch: str, encoder: str, classes: int, ckpt: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import segmentation_models_pytorch as smp

        from bigbatch.models import enable_grad_checkpointing

        name = f"tu-{encoder}" if ckpt else encoder  # timm's encoder has the switch
        model = smp.create_model(arch, encoder_name=name, encoder_weights=None, classes=classes)
        return enable_grad_checkpointing(model) if ckpt else model  # as bigbatch train's

    return build


def _llama(layers: int, hidden: int, vocab: int, *, frozen: bool = True, ckpt: bool = True):  # type: ignore[no-untyped-def]
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        from bigbatch.memory.lm_model import enable_checkpointing

        config = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
            num_key_value_heads=max(1, hidden // 64), max_position_embeddings=4096,
            use_cache=False, attn_implementation="sdpa",
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        if frozen:  # the frozen base; the head trains (what LoRA's memory looks like)
            model.model.requires_grad_(False)
            model.lm_head.requires_grad_(True)
        if ckpt:  # transformers' own, non-reentrant, by its name since 5.0
            enable_checkpointing(model)
        return model

    return build


def lm_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def seg_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.float(), (x[:, 0] > 0).long())


def nnunet_arch(stages: int) -> dict[str, Any]:
    """nnU-Net's default 3d_fullres network for a cubic patch, as its planner writes it into a
    plans file: a PlainConvUNet of ``stages`` stages, 32 features doubling to at most 320,
    3x3x3 convolutions, strides of 2 after the first stage, InstanceNorm, LeakyReLU."""
    return {
        "network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
        "arch_kwargs": {
            "n_stages": stages,
            "features_per_stage": [min(32 * 2**i, 320) for i in range(stages)],
            "conv_op": "torch.nn.modules.conv.Conv3d",
            "kernel_sizes": [[3, 3, 3]] * stages,
            "strides": [[1, 1, 1]] + [[2, 2, 2]] * (stages - 1),
            "n_conv_per_stage": [2] * stages,
            "n_conv_per_stage_decoder": [2] * (stages - 1),
            "conv_bias": True,
            "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
            "norm_op_kwargs": {"eps": 1e-05, "affine": True},
            "dropout_op": None,
            "dropout_op_kwargs": None,
            "nonlin": "torch.nn.LeakyReLU",
            "nonlin_kwargs": {"inplace": True},
        },
        "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"],
    }


def _nnunet_spec(row: dict[str, Any], device: str) -> StepSpec:
    """nnU-Net's training step (its network, deep supervision, DC+CE, SGD with momentum) for a
    one-channel volume and three labels, as ``bigbatch.integrations.nnunet`` plans it."""
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    from bigbatch.integrations.nnunet_step import plan_step_spec

    arch = nnunet_arch(row.get("stages", 6))

    def build() -> nn.Module:
        return get_network_from_plans(
            arch["network_class_name"], arch["arch_kwargs"], arch["_kw_requires_import"],
            1, 3, allow_init=False, deep_supervision=True,
        )  # fmt: skip

    patch = (row["size"],) * 3
    spec = plan_step_spec(
        build, patch, 1, 3, arch["arch_kwargs"], precision=row["precision"], device=device
    )
    return spec.with_batch(row["batch"])


# Public models' shapes (random weights: the config alone), for the ``hf`` rows.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
                     "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "tie_word_embeddings": True,
                     "dtype": "bfloat16"},
    "llama3.2-1b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
                    "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8,
                    "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "dtype": "bfloat16"},
    # Planned from a CPU only (tests/memory/test_lm.py, benchmarks/plan_lm_time.py).
    "llama3-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0,
                  "tie_word_embeddings": False, "dtype": "bfloat16"},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                   "tie_word_embeddings": False, "dtype": "bfloat16"},
    "mistral-7b": {"model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                   "sliding_window": None, "tie_word_embeddings": False, "dtype": "bfloat16"},
    # Planned from the CPU only (benchmarks/plan_lm_time.py --large): no GPU row trains it.
    "llama3-70b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
                   "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0,
                   "tie_word_embeddings": False, "dtype": "bfloat16"},
    "tiny": {"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "max_position_embeddings": 256, "dtype": "float32"},
}  # fmt: skip


def _hf_spec(row: dict[str, Any], device: str, real: bool) -> StepSpec:
    """A language model from its config as ``bigbatch plan --hf`` plans it
    (:mod:`bigbatch.memory.lm`): ``model`` (a :data:`HF_CONFIGS` key), ``lora`` (rank, 0 for a
    full fine-tune), ``quant`` (4 or 8 bits), ``prep`` (``qlora_prep``: peft, or trl),
    ``loss`` (model, or trl: SFTTrainer's fused LM head), ``ckpt``, ``packing``; ``size`` is the
    sequence
    length. ``real``: bitsandbytes' own layers, for the step recorded on a GPU."""
    from transformers import AutoConfig

    from bigbatch.memory.lm import LMSetup, lm_spec_at

    values = dict(HF_CONFIGS[row["model"]])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    ranks = row.get("ranks", 1)
    setup = LMSetup(
        seq_len=row["size"], lora_r=row.get("lora", 0), gradient_checkpointing=row.get("ckpt", False),
        packing=row.get("packing", False), quant=row.get("quant", 0), world_size=ranks,
        fsdp=ranks > 1, qlora_prep=row.get("prep", "peft"), loss=row.get("loss", "model"),
    )  # fmt: skip
    spec_at = lm_spec_at(
        config, setup, device=device, precision=row["precision"], optimizer=row["optimizer"],
        real_bitsandbytes=real, sharded=ranks > 1,
    )  # fmt: skip
    return spec_at(row["batch"])


def ranks_of(row: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """The fake process group an FSDP2 row (``ranks``: N) is traced and run in: one rank of N,
    its collectives moving no data, its memory (and on a GPU its streams) real."""
    from bigbatch.memory.fsdp import fake_ranks

    return fake_ranks(row["ranks"]) if row.get("ranks", 1) > 1 else contextlib.nullcontext()


def spec_of(row: dict[str, Any], device: str = "cuda", *, real: bool = False) -> StepSpec:
    """The row's training step as a StepSpec on ``device``; ``real``: for a real step (on the
    GPU that records it), with the libraries' own modules where the planner has stand-ins."""
    common: dict[str, Any] = {
        "optimizer": row["optimizer"],
        "precision": row["precision"],
        "device": device,
        "cudnn_benchmark": bool(row.get("cudnn_benchmark", False)),
        "memory_limit": row["cap_mib"] * 2**20 if row.get("cap_mib") else None,
    }
    size, batch, kind = row["size"], row["batch"], row["kind"]
    if kind == "timm":
        model = _timm(row["arch"], num_classes=row.get("classes", 10), ckpt=row.get("ckpt", False))
        return StepSpec(model, (3, size, size), batch, **common)
    if kind == "smp":
        model = _smp(row["arch"], row["encoder"], row.get("classes", 4), row.get("ckpt", False))
        return StepSpec(model, (3, size, size), batch, step=seg_step, **common)
    if kind == "unet3d":
        model = _unet3d(tuple(row.get("widths", (32, 64, 128, 256))), row.get("ckpt", False))
        return StepSpec(model, (4, size, size, size), batch, step=seg_step, **common)
    if kind == "llama":
        vocab = row.get("vocab", 32000)
        model = _llama(
            row.get("layers", 8), row.get("hidden", 1024), vocab,
            frozen=row.get("frozen", True), ckpt=row.get("ckpt", True),
        )  # fmt: skip
        return StepSpec(
            model, (size,), batch, input_dtype=torch.long, vocab=vocab, step=lm_step, **common
        )
    if kind == "nnunet":
        return _nnunet_spec(row, device)
    if kind == "hf":
        return _hf_spec(row, device, real)
    raise ValueError(f"row kind {kind!r}: not one of timm, smp, unet3d, llama, nnunet, hf")


def row_name(row: dict[str, Any]) -> str:
    """A file name that says what the row is: arch-size-bBATCH-precision-optimizer[-extras]."""
    arch = row["arch"] if row["kind"] != "smp" else f"smp_{row['arch']}_{row['encoder']}"
    if row["kind"] == "llama":
        arch = f"llama{row.get('layers', 8)}L-{row.get('hidden', 1024)}"
    if row["kind"] == "nnunet":
        arch = f"nnunet3d{row.get('stages', 6)}s"
    if row["kind"] == "hf":
        arch = row["model"] + (f"-lora{row['lora']}" if row.get("lora") else "-full")
        arch += f"-q{row['quant']}bit" if row.get("quant") else ""
        arch += f"-{row['prep']}" if row.get("prep", "peft") != "peft" else ""
        arch += "-trlhead" if row.get("loss", "model") == "trl" else ""
        arch += "-packed" if row.get("packing") else ""
        arch += "-ckpt" if row.get("ckpt") else ""
        arch += f"-fsdp{row['ranks']}" if row.get("ranks", 1) > 1 else ""
    size = str(row["size"])
    if row["kind"] == "llama" and row["size"] % 1024 == 0:
        size = f"{row['size'] // 1024}k"  # tokens
    parts = [arch, size, f"b{row['batch']}", row["precision"], row["optimizer"]]
    if row["kind"] == "llama":
        parts += [p for p, on in (("ckpt", row.get("ckpt", True)),) if on]
        parts += ["frozen" if row.get("frozen", True) else "full"]
    if row["kind"] in ("timm", "unet3d", "smp") and row.get("ckpt"):
        parts.append("ckpt")
    if row.get("cudnn_benchmark"):
        parts.append("bench")
    if row.get("cap_mib"):
        parts.append(f"cap{row['cap_mib']}M")
    if row.get("compile"):
        parts.append("compile")
    return "-".join(parts)


def _timm_row(arch: str, size: int, batch: int, precision: str, opt: str) -> dict[str, Any]:
    return {"kind": "timm", "arch": arch, "size": size, "batch": batch, "precision": precision,
            "optimizer": opt}  # fmt: skip


def matrix(dry_run: bool = False) -> list[dict[str, Any]]:
    """The rows, those the CUDA model missed most first (a time box cuts the last ones)."""
    if dry_run:  # tiny, on the CPU: the harness's code paths in seconds (every kind's spec
        # is tested against the recorded traces in tests/memory/test_gpu_truth.py)
        return [
            _timm_row("resnet10t", 32, 2, "fp32", "adamw"),
            {"kind": "unet3d", "arch": "unet3d", "widths": [8, 16], "size": 16, "batch": 1,
             "precision": "fp32", "optimizer": "adamw", "ckpt": True},
            {"kind": "nnunet", "arch": "nnunet3d", "stages": 3, "size": 16, "batch": 2,
             "precision": "fp32", "optimizer": "sgd_momentum"},
            {"kind": "hf", "arch": "hf", "model": "tiny", "lora": 4, "ckpt": True, "size": 32,
             "batch": 2, "precision": "fp32", "optimizer": "adamw"},
            {"kind": "hf", "arch": "hf", "model": "tiny", "ranks": 2, "size": 32, "batch": 2,
             "precision": "fp32", "optimizer": "adamw"},
        ]  # fmt: skip
    return [
        # First the rows the CUDA model missed most on the H200 (a short box records them):
        # the batch sweep of one CNN, 32 to 256 (the large-batch fragmentation), bf16 with SGD,
        # a plain CNN at a large batch in fp32, a ViT at a larger batch, 3D volumes.
        _timm_row("resnet50", 224, 32, "fp16", "adamw"),
        _timm_row("resnet50", 224, 64, "fp16", "adamw"),
        _timm_row("resnet50", 224, 128, "fp16", "adamw"),
        _timm_row("resnet50", 224, 256, "fp16", "adamw"),
        _timm_row("resnet50", 224, 64, "bf16", "sgd"),
        _timm_row("resnet18", 224, 256, "fp32", "sgd"),
        _timm_row("vit_base_patch16_224", 224, 64, "bf16", "adamw"),
        # The same with timm's activation checkpointing (bigbatch train grad_checkpointing=true).
        {**_timm_row("vit_base_patch16_224", 224, 64, "bf16", "adamw"), "ckpt": True},
        {"kind": "unet3d", "arch": "unet3d", "size": 96, "batch": 2, "precision": "fp16",
         "optimizer": "adamw"},
        # The same with MONAI's blocks in torch's checkpoint_wrapper (grad_checkpointing=true).
        {"kind": "unet3d", "arch": "unet3d", "size": 96, "batch": 2, "precision": "fp16",
         "optimizer": "adamw", "ckpt": True},
        _timm_row("efficientnet_b0", 224, 64, "fp16", "adamw"),
        _timm_row("convnext_small", 128, 32, "fp16", "adam"),
        _timm_row("vit_small_patch16_224", 224, 128, "fp16", "adam"),
        _timm_row("resnet50", 224, 32, "fp32", "adam"),
        # The recorded H100 rows again (another card, the same stack).
        _timm_row("resnet18", 128, 8, "fp16", "adamw"),
        _timm_row("resnet18", 128, 32, "fp16", "adamw"),
        _timm_row("convnext_small", 128, 64, "fp16", "adam"),
        # Transformers.
        _timm_row("vit_base_patch16_224", 224, 32, "bf16", "adamw"),
        _timm_row("vit_base_patch16_224", 224, 64, "fp32", "adamw"),
        {"kind": "unet3d", "arch": "unet3d", "size": 128, "batch": 1, "precision": "bf16",
         "optimizer": "adamw"},
        # 2D segmentation at a high resolution.
        {"kind": "smp", "arch": "unet", "encoder": "resnet34", "size": 1024, "batch": 2,
         "precision": "fp16", "optimizer": "adamw"},
        {"kind": "smp", "arch": "unet", "encoder": "resnet34", "size": 1024, "batch": 2,
         "precision": "fp16", "optimizer": "adamw", "ckpt": True},
        {"kind": "smp", "arch": "unet", "encoder": "resnet34", "size": 512, "batch": 8,
         "precision": "bf16", "optimizer": "adamw"},
        # Language models: a frozen base with checkpointing (LoRA's memory), a full fine-tune.
        {"kind": "llama", "arch": "llama", "size": 2048, "batch": 1, "precision": "bf16",
         "optimizer": "adamw"},
        {"kind": "llama", "arch": "llama", "size": 2048, "batch": 4, "precision": "bf16",
         "optimizer": "adamw"},
        {"kind": "llama", "arch": "llama", "layers": 4, "hidden": 512, "size": 1024, "batch": 4,
         "precision": "bf16", "optimizer": "adamw", "frozen": False, "ckpt": False},
        # Language models from their configs (bigbatch plan --hf): a bf16 full fine-tune, LoRA
        # r=16 with checkpointing, padded and packed, 512 to 4096 tokens; QLoRA 4-bit, recorded
        # with bitsandbytes' own layers and optimizers, predicted with the planner's stand-ins.
        {"kind": "hf", "arch": "hf", "model": "qwen2.5-0.5b", "size": 1024, "batch": 4,
         "precision": "bf16", "optimizer": "adamw"},
        # Where the optimizer step is the peak, torch's multi-tensor AdamW and its fused one
        # (Trainer's default from torch 2.8: step counts on the card, no update temporaries).
        {"kind": "hf", "arch": "hf", "model": "qwen2.5-0.5b", "size": 256, "batch": 2,
         "precision": "bf16", "optimizer": "adamw"},
        {"kind": "hf", "arch": "hf", "model": "qwen2.5-0.5b", "size": 256, "batch": 2,
         "precision": "bf16", "optimizer": "adamw_fused"},
        {"kind": "hf", "arch": "hf", "model": "qwen2.5-0.5b", "lora": 16, "ckpt": True,
         "size": 4096, "batch": 2, "precision": "bf16", "optimizer": "adamw"},
        {"kind": "hf", "arch": "hf", "model": "llama3.2-1b", "lora": 16, "ckpt": True,
         "size": 2048, "batch": 4, "precision": "bf16", "optimizer": "adamw"},
        {"kind": "hf", "arch": "hf", "model": "llama3.2-1b", "lora": 16, "ckpt": True,
         "packing": True, "size": 512, "batch": 8, "precision": "bf16", "optimizer": "adamw"},
        # The LoRA step at 2048 tokens two rows up, as TRL's SFTTrainer runs it: its fused LM
        # head (Triton on the card, tiles of the logits), which the CPU's trace stands in for
        # (the card's image needs TRL, with accelerate and datasets, for this row).
        {"kind": "hf", "arch": "hf", "model": "llama3.2-1b", "lora": 16, "ckpt": True,
         "loss": "trl", "size": 2048, "batch": 4, "precision": "bf16", "optimizer": "adamw"},
        {"kind": "hf", "arch": "hf", "model": "llama3.2-1b", "lora": 16, "quant": 4, "ckpt": True,
         "size": 2048, "batch": 2, "precision": "bf16", "optimizer": "adamw"},
        # The same, readied as TRL's SFTTrainer readies it from peft_config= (bf16 adapters).
        {"kind": "hf", "arch": "hf", "model": "llama3.2-1b", "lora": 16, "quant": 4, "ckpt": True,
         "prep": "trl", "size": 2048, "batch": 2, "precision": "bf16", "optimizer": "adamw"},
        {"kind": "hf", "arch": "hf", "model": "qwen2.5-0.5b", "lora": 16, "quant": 4, "ckpt": True,
         "size": 1024, "batch": 4, "precision": "bf16", "optimizer": "paged_adamw_8bit"},
        # One FSDP2 rank of 4 (bigbatch plan --hf --fsdp traces one): run on a fake process
        # group, so one GPU records a rank's memory with FSDP2's own communication streams.
        {"kind": "hf", "arch": "hf", "model": "qwen2.5-0.5b", "ranks": 4, "size": 1024,
         "batch": 4, "precision": "bf16", "optimizer": "adamw"},
        {"kind": "hf", "arch": "hf", "model": "llama3.2-1b", "lora": 16, "ckpt": True, "ranks": 4,
         "size": 2048, "batch": 4, "precision": "bf16", "optimizer": "adamw"},
        # QLoRA under FSDP2: the 4-bit weights packed in bf16 (the plan's default there), which
        # FSDP2 shards as any weight; bitsandbytes' Linear4bit must survive its gathers.
        {"kind": "hf", "arch": "hf", "model": "llama3.2-1b", "lora": 16, "quant": 4, "ckpt": True,
         "ranks": 4, "size": 2048, "batch": 2, "precision": "bf16", "optimizer": "adamw"},
        # cuDNN's benchmark mode (trials whose workspaces depend on the free memory): the seed
        # workload at b16 / b32 / b64 (its b16 recorded before skipped its first optimizer
        # step), and under allocator caps of several sizes (``cap_mib``: set_per_process_
        # memory_fraction), where the trials halve and the cache is released to fit.
        {**_timm_row("resnet50", 224, 64, "fp16", "adamw"), "cudnn_benchmark": True},
        *(
            {**_timm_row("convnext_small", 128, b, "fp16", "adam"), "cudnn_benchmark": True}
            for b in (16, 32, 64)
        ),
        *(
            {**_timm_row("convnext_small", 128, b, "fp16", "adam"), "cudnn_benchmark": True,
             "cap_mib": cap}
            for b, cap in ((32, 2048), (64, 3200), (64, 2900))
        ),
        # nnU-Net's 3d_fullres step (128^3 patch, 6 stages, deep supervision, DC+CE, SGD): its
        # batch of 2 whole, and the micro-batch of 1 bigbatch's trainer splits it into.
        {"kind": "nnunet", "arch": "nnunet3d", "stages": 6, "size": 128, "batch": 2,
         "precision": "fp16", "optimizer": "sgd_momentum"},
        {"kind": "nnunet", "arch": "nnunet3d", "stages": 6, "size": 128, "batch": 1,
         "precision": "fp16", "optimizer": "sgd_momentum"},
        # The same micro-batch with torch.compile, which nnU-Net's trainer turns on for CUDA
        # (nnUNet_compile): recorded compiled, predicted as the eager step (the planner does
        # not model inductor's fusions), so the row says what compiling changes. Last: its
        # compilation takes most of a minute.
        {"kind": "nnunet", "arch": "nnunet3d", "stages": 6, "size": 128, "batch": 1,
         "precision": "fp16", "optimizer": "sgd_momentum", "compile": True},
    ]  # fmt: skip


if __name__ == "__main__":
    for r in matrix():
        print(row_name(r))
