"""``bigbatch plan --hf NAME_OR_PATH``: a language model's fine-tune planned from its config
(the work is :mod:`bigbatch.memory.lm`'s; this parses and prints)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bigbatch.cli import UserError, fill_defaults, flags_typed, positive_ints

# The language-model flags and their defaults, filled in once the flags typed are checked:
# typed without --hf (even at these values) they are refused, and the image flags with --hf
# (IMAGE_ONLY), not ignored.
LM_DEFAULTS: dict[str, Any] = {
    "seq_len": "",
    "tokens": None,
    "lora": 0,
    "lora_targets": "all-linear",
    "lora_dropout": 0.0,
    "qlora": 0,
    "no_double_quant": False,
    "quant_storage": "auto",
    "qlora_prep": "peft",
    "loss": "model",
    "label_smoothing": 0.0,
    "gradient_checkpointing": False,
    "attn": "auto",
    "packing": False,
    "dtype": "auto",
    "world_size": "1",
    "fsdp": False,
    "save": None,
    "trust_remote_code": False,
}
IMAGE_ONLY: dict[str, Any] = {
    "size": "224",
    "input_shape": None,
    "widths": "",
    "encoder": "",
    "step": None,
    "input_dtype": "float32",
    "vocab": 2,
    "num_classes": 1000,
    "cache_dim": 0,
    "cache_towers": 2,
    "threads": 0,
    "no_calibrate": False,
    "csv": None,
    "plot": None,
    "fastest": False,
    "confirm": False,
    "config": None,
}


def refuse_language_flags(args: argparse.Namespace, keep: tuple[str, ...] = ()) -> None:
    """A plan without ``--hf`` refuses the language-model flags (typed, they would be ignored)
    but those in ``keep``."""
    language_flags = [f for f in flags_typed(args, LM_DEFAULTS) if f not in keep]
    if language_flags:
        raise UserError(
            f"{', '.join(language_flags)}: for a language model's plan; add --hf NAME_OR_PATH "
            "(a Hugging Face model's config)"
        )


# One flat list of options in the order --help shows them: split, it would only scatter them.
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The language-model options of ``bigbatch plan`` (with ``--hf``)."""
    g = p.add_argument_group("language models (with --hf)")
    g.add_argument(
        "--seq-len",
        help="tokens a sequence (comma-separated for a table: 512,1024,2048,4096)",
    )
    g.add_argument(
        "--tokens",
        type=int,
        help="tokens a step, all ranks together, instead of --batch (a multiple of --seq-len)",
    )
    g.add_argument(
        "--lora",
        type=int,
        metavar="R",
        help="LoRA adapters of rank R (peft)",
    )
    g.add_argument(
        "--lora-targets",
        help="the layers LoRA adapts, peft's target_modules: all-linear or q_proj,v_proj,...",
    )
    g.add_argument(
        "--lora-dropout",
        type=float,
        help="peft's lora_dropout",
    )
    g.add_argument(
        "--qlora",
        type=int,
        nargs="?",
        const=4,
        metavar="BITS",
        help="the base in bitsandbytes' 4-bit NF4 (default) or 8-bit; needs --lora",
    )
    g.add_argument(
        "--no-double-quant",
        action="store_true",
        help="4-bit without double quantization (bnb_4bit_use_double_quant=False)",
    )
    g.add_argument(
        "--quant-storage",
        choices=("auto", "uint8", "bf16", "fp16", "fp32"),
        help="the dtype 4-bit values are packed in (bnb_4bit_quant_storage; auto: uint8, and "
        "with --fsdp the precision's 16-bit dtype, which FSDP2 shards)",
    )
    g.add_argument(
        "--qlora-prep",
        choices=("peft", "trl"),
        help="how the quantized base is readied for its adapters: peft (default: "
        "prepare_model_for_kbit_training, then get_peft_model; the other weights and the "
        "adapters in float32) or trl (TRL's SFTTrainer given peft_config=: the other weights "
        "as loaded, the adapters in bf16)",
    )
    g.add_argument(
        "--loss",
        choices=("model", "trl"),
        help="what makes the loss: model (default: the model's own, over the whole logits, as "
        "Trainer runs it) or trl (TRL's SFTTrainer: its fused LM head, log-probabilities from "
        "tiles of the logits, never the whole of them)",
    )
    g.add_argument(
        "--label-smoothing",
        type=float,
        metavar="EPS",
        help="Trainer's label_smoothing_factor (0.1, say; default 0): its LabelSmoother over "
        "the whole logits, in float32 under mixed precision (with --loss trl, SFTTrainer's "
        "smoothing: those logits, then its fused head without gradients for its metrics)",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="activation checkpointing: transformers' (--hf, non-reentrant), or as bigbatch "
        "train's grad_checkpointing=true (--arch: timm's models and encoders, MONAI's networks, "
        "smp's decoders)",
    )
    g.add_argument(
        "--attn",
        help="attention: auto (as from_pretrained chooses: sdpa where the model has it, else "
        "eager), sdpa, eager or flash_attention_2",
    )
    g.add_argument(
        "--packing",
        action="store_true",
        help="sequences packed into one row (TRL's padding_free) instead of padded to --seq-len",
    )
    g.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp16", "fp32"),
        help="the weights' dtype (auto: the config's, as from_pretrained loads them; where "
        "a card before Ampere plans in fp16, its bf16 in fp16 under LoRA, else fp32)",
    )
    g.add_argument(
        "--world-size",
        help="ranks (processes, one GPU each), comma-separated for a table: 1,2,4,8; for a "
        "model's step (--arch, --model) or bigbatch train's keys (data=...), one: the run "
        "under torchrun, DDP on each rank",
    )
    g.add_argument("--fsdp", action="store_true", help="FSDP2 over the ranks (else DDP)")
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model's own code that its config names (auto_map), as transformers' "
        "trust_remote_code=True: only for a source you trust",
    )
    g.add_argument(
        "--save",
        type=Path,
        metavar="PATH",
        help="write the plan to PATH (JSON) for LMPlan.load in the training job (one plan: "
        "one --seq-len and one --world-size)",
    )


def run(args: argparse.Namespace) -> int:
    """Plan the fine-tune ``args`` describe; print the plan or the table (``--json``)."""
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    _quiet_libraries()
    from bigbatch.integrations.hf import trainer_arguments
    from bigbatch.memory.budget import format_bytes, parse_bytes
    from bigbatch.memory.cards import find_card
    from bigbatch.memory.lm import LMPlan, load_lm_config, plan_lm, plan_table
    from bigbatch.memory.plan import DoesNotFitError

    # A GPU unless said: what a fine-tuner plans for (bf16 where the card computes it).
    args.device = args.device or "cuda"
    ignored = flags_typed(args, IMAGE_ONLY) + (["KEY=VALUE"] if args.train_keys else [])
    if ignored:
        raise UserError(
            f"{', '.join(ignored)}: not for a language model's plan (--hf); drop "
            f"{'them' if len(ignored) > 1 else 'it'}, or plan --arch or --model without --hf"
        )
    fill_defaults(args, LM_DEFAULTS)
    if not args.seq_len:
        raise UserError("--hf needs --seq-len, the tokens a sequence (e.g. 2048)")
    seq_lens = positive_ints(args.seq_len, "--seq-len")
    world_sizes = positive_ints(args.world_size, "--world-size")
    _check_save(args.save, len(seq_lens) * len(world_sizes))
    if args.budget is None:
        raise UserError("--budget is needed: a card's name (l4, rtx4090, a100-80gb) or 24GB")
    args.batch = _global_batch(args.batch, args.tokens, seq_lens)
    setup = _setup(args, seq_lens[0], world_sizes[0])
    card = find_card(args.budget)
    try:
        overhead = parse_bytes(args.overhead, allow_zero=True) if args.overhead else None
        if card is not None and overhead is None:
            overhead = card.context_bytes
        config = load_lm_config(args.hf, trust_remote_code=args.trust_remote_code)
        if said := _precision_for_card(args, card, config, setup):
            setup = _setup(args, seq_lens[0], world_sizes[0])
        options: dict[str, Any] = {
            "device": args.device,
            "precision": args.precision,
            "optimizer": args.optimizer,
            "margin": args.margin,
            "overhead": overhead,
        }
        if len(seq_lens) == 1 and len(world_sizes) == 1:  # one plan: why it fails, in full
            rows: list[Any] = [plan_lm(config, setup, args.batch, args.budget, **options)]
        else:
            rows = plan_table(
                config,
                setup,
                args.batch,
                args.budget,
                seq_lens=seq_lens,
                world_sizes=world_sizes,
                **options,
            )
    except DoesNotFitError as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:
        raise UserError(str(exc)) from None
    # Said once planned: a refused plan prints its error alone. stdout stays the plan.
    if said:
        print(said, file=sys.stderr)
    if card is not None:
        print(f"card: {card.name}, {format_bytes(card.total_bytes)}", file=sys.stderr)
    _save(rows[0], args.save)
    if args.json:
        out: list[dict[str, Any]] = [
            r.to_dict() | {"fits": True, "trainer": trainer_arguments(r), "model": _model_fields(r)}
            if isinstance(r, LMPlan)
            else {"fits": False, "why": r}
            for r in rows
        ]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
        return 0
    _print(args, rows)
    return 0


def _precision_for_card(args: argparse.Namespace, card: Any, config: Any, setup: Any) -> str:
    """``--precision`` where not given: bf16, or on a card without bfloat16 units (a T4,
    where torch emulates it several times slower) fp16, with the config's 16-bit weights
    (``--dtype auto``) in fp16 under adapters and in float32 for a full fine-tune (GradScaler
    cannot unscale fp16 gradients). Returns what was filled in for that card, to be said."""
    from bigbatch.device import device_kind
    from bigbatch.memory.lm import dtype_flag, weights_dtype

    # A card's plan on a CPU is refused after this: nothing to fill in for it.
    emulated = card is not None and card.emulates_bf16 and device_kind(args.device).dedicated_memory
    filled = []
    if args.precision is None:
        args.precision = "fp16" if emulated else "bf16"
        filled += [f"--precision {args.precision}"] if emulated else []
    held = dtype_flag(weights_dtype(config, setup)) if args.dtype == "auto" else ""
    half = held if held in ("bf16", "fp16") else None
    if emulated and args.precision == "fp16" and half:
        # GradScaler unscales no float16 gradient: a full fine-tune keeps float32 weights.
        dtype = "fp16" if setup.lora_r else "fp32"
        if dtype != half:
            args.dtype = dtype
            filled.append(f"--dtype {args.dtype}")
    if not filled:
        return ""
    keep = "--precision bf16" if filled[0].startswith("--precision") else "--dtype bf16"
    return (
        f"planned for the {card.short_name}: {' '.join(filled)} (it has no bfloat16 units: "
        f"torch would emulate bf16 there, several times slower; {keep} plans that anyway)"
    )


def _global_batch(batch: int | None, tokens: int | None, seq_lens: list[int]) -> int:
    """Sequences an optimizer step, all ranks together, from ``--batch`` or ``--tokens``."""
    if batch is not None and tokens is not None:
        raise UserError("--batch and --tokens both give the global batch: give one of them")
    if tokens is not None:
        if len(seq_lens) > 1 or tokens % seq_lens[0]:
            raise UserError(
                f"--tokens {tokens} is no whole number of {seq_lens[0]}-token sequences: "
                "give a multiple of --seq-len (one --seq-len), or --batch"
            )
        batch = tokens // seq_lens[0]
    if batch is None:
        raise UserError("give the global batch: --batch (sequences a step, all ranks) or --tokens")
    if batch < 1:
        raise UserError(f"--batch must be a positive number of sequences, got {batch}")
    return batch


def _check_save(path: Path | None, plans: int) -> None:
    """``--save``'s refusals, before the planning starts: a table, or no folder to write to."""
    if path is None:
        return
    if plans > 1:
        raise UserError(
            "--save writes one plan: give one --seq-len and one --world-size (a table is for "
            "choosing; save the row you train)"
        )
    if path.is_dir() or not path.parent.is_dir():
        raise UserError(f"--save {path}: give a file in an existing folder (e.g. --save plan.json)")


def _save(plan: Any, path: Path | None) -> None:
    """``--save``: the one plan, for ``LMPlan.load`` where the model trains."""
    if path is None:
        return
    saved = plan.save(path)
    print(f"plan saved to {saved}: LMPlan.load({str(saved)!r}) where it trains", file=sys.stderr)


def _quiet_libraries() -> None:
    """What libraries say on the way that is no news to a planner: bitsandbytes' CPU kernels
    (never run here). (peft's use of transformers' renamed checkpointing property is quieted
    where the planner wraps its model, for Python users too: bigbatch.memory.lm.)"""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _setup(args: argparse.Namespace, seq_len: int, world_size: int) -> Any:
    """The fine-tune the flags describe (:class:`bigbatch.memory.lm.LMSetup`)."""
    from bigbatch.memory.lm import LMSetup

    return LMSetup(
        seq_len=seq_len,
        lora_r=args.lora,
        lora_targets=args.lora_targets,
        lora_dropout=args.lora_dropout,
        quant=args.qlora,
        double_quant=not args.no_double_quant,
        quant_storage=args.quant_storage,
        qlora_prep=args.qlora_prep,
        loss=args.loss,
        label_smoothing=args.label_smoothing,
        gradient_checkpointing=args.gradient_checkpointing,
        attn=args.attn,
        packing=args.packing,
        dtype=args.dtype,
        world_size=world_size,
        fsdp=args.fsdp,
    )


def _print(args: argparse.Namespace, rows: list[Any]) -> None:
    from bigbatch.integrations.hf import trainer_arguments
    from bigbatch.memory.budget import format_bytes
    from bigbatch.memory.lm import LMPlan

    first = next((r for r in rows if isinstance(r, LMPlan)), None)
    if len(rows) == 1 and first is not None:
        sizes = first.sizes
        print(
            f"{args.hf}: {first.model_type}, {_count(sizes.parameter_count)} parameters, "
            f"{_count(sizes.trainable_count)} trained; {first.setup.describe()}"
        )
        print(first.summary())
        said = trainer_arguments(first).items()  # None: not planned (evaluation=False)
        fields = ", ".join(f"{k}={v!r}" for k, v in said if v is not None)
        said_by = (
            "with_plan sets the sizes and checkpointing, refuses another precision, optimizer, loss "
            "or sharding"
        )
        runs = "TRL's SFTTrainer" if first.setup.loss == "trl" else "Trainer or TRL"
        print(f"{runs} ({said_by}): {fields}")
        logits = first.logits_a_fused_head_frees()
        if logits:
            print(
                f"For TRL's SFTTrainer, plan with --loss trl: its fused LM head (TRL versions "
                f"with add_fused_lm_head) makes none of the {format_bytes(logits)} of logits "
                "this plan holds, and may take a larger micro-batch"
            )
        model = _model_fields(first)
        attn = model.pop("attn_implementation")
        fields = f"dtype=torch.{model.pop('dtype')}, attn_implementation={attn!r}"
        fields += "".join(f", {k}={v}" for k, v in model.items())
        print(f"The model (from_pretrained(..., **model_arguments(plan)) loads it so): {fields}")
        if first.setup.quant:
            print(f"Its adapters, as planned: {_adapters_said(first.setup)}")
        return
    # A planned row names the attention chosen for the model, where the flags may say auto.
    described = _setup(args, 1, 1)
    if first is not None:
        described = replace(described, attn=first.setup.attn)
    setup = f"{described.describe(table=True)}, precision {args.precision}"
    print(f"{args.hf}: {setup}; global batch {args.batch} sequences, budget {args.budget} per rank")
    header = f"{'tokens':>7} {'ranks':>5} {'micro x accum':>15} {'peak / rank':>12}  parts"
    print(header)
    print("-" * len(header))
    for r in rows:
        if not isinstance(r, LMPlan):
            print(f"  {r}")
            continue
        parts = r.parts()
        top = ", ".join(
            f"{k} {format_bytes(v)}"
            for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3]
            if v > 0
        )
        print(
            f"{r.setup.seq_len:>7} {r.setup.world_size:>5} {_split(r):>15} "
            f"{format_bytes(r.peak_bytes):>12}  {top}"
        )


def _split(plan: Any) -> str:
    """A table's micro-batch x accumulation, with the last micro-batch where it is smaller
    (8 sequences a rank at micro-batch 3: "3 x 3, last 2", not 9)."""
    last = plan.plan.last_micro_batch
    split = f"{plan.micro_batch} x {plan.accumulation}"
    return split + (f", last {last}" if last != plan.micro_batch else "")


def _adapters_said(setup: Any) -> str:
    """How the plan's quantized base is readied for its adapters, as code (``--qlora-prep``)."""
    if setup.qlora_prep == "trl":
        return "SFTTrainer(model, ..., peft_config=lora_config(plan.setup)) (TRL 1.x)"
    return (
        "get_peft_model(prepare_model_for_kbit_training(model), lora_config(plan.setup)); "
        "TRL's SFTTrainer given peft_config= instead readies a lighter model: plan it with "
        "--qlora-prep trl"
    )


def _model_fields(plan: Any) -> dict[str, str]:
    """``model_arguments(plan)`` as text: what a script that loads the model from its command
    line (TRL's ``--dtype``, ``--load_in_4bit``) is to be given. Without building
    ``BitsAndBytesConfig``, which some transformers releases refuse where bitsandbytes is not
    installed (a Mac planning for a card)."""
    from bigbatch.integrations.hf import quantization_arguments

    # A plan made here records its weights' dtype (--dtype, or the config's it resolved).
    fields = {"dtype": plan.weights_dtype, "attn_implementation": plan.setup.attn}
    if quant := quantization_arguments(plan):
        said = ", ".join(
            f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in quant.items()
        )
        fields["quantization_config"] = f"BitsAndBytesConfig({said})"
    return fields


def _count(n: int) -> str:
    """A parameter count as people say it: 8.03B, 41.9M, 5.1K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
