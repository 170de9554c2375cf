"""``bigbatch plan``: the micro-batch and accumulation that fit a budget, and the memory table."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigbatch.cli import (
    UserError,
    fill_defaults,
    flags_typed,
    freeze_loaded,
    plan_hf,
    positive_ints,
)
from bigbatch.device import device_kind, torch_threads, total_bytes
from bigbatch.distributed import ddp_bucket_bytes, rank_share, share_line
from bigbatch.memory.budget import format_bytes, parse_bytes
from bigbatch.memory.cards import CARDS, Card, card_hint, find_card
from bigbatch.memory.meta import build_on_meta
from bigbatch.memory.plan import (
    RETURN_FREED_NOTE,
    DoesNotFitError,
    fastest,
    overhead_bytes,
    plan_under_budget,
    resolve_budget,
    usable_bytes,
)
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import OPTIMIZERS, PRECISIONS, StepSpec
from bigbatch.segmentation.networks import MONAI_ARCHS, build_network, size_multiple
from bigbatch.user_code import load_callable


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
    _add_plan_arguments(p)
    p.add_argument(
        "train_keys",
        nargs="*",
        metavar="KEY=VALUE",
        help="plan what bigbatch train would run instead: its keys (task=regression "
        "data=train.csv arch=resnet50 size=224 batch=64 budget=t4 ...), the task's own step and "
        "its validation, its data scanned for the shapes; with --config, that TOML first",
    )
    p.add_argument("--config", type=Path, help="a bigbatch train TOML to plan (see KEY=VALUE)")
    plan_hf.add_arguments(p)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What to plan: the model, its input and its step."""
    src = p.add_mutually_exclusive_group()  # one is needed unless --list-cards: _check_args
    src.add_argument(
        "--arch",
        help="timm architecture(s), comma-separated: resnet18,convnext_tiny; or one of MONAI's "
        "segmentation networks (unet, segresnet, dynunet, swinunetr, unetr) with --input-shape "
        "C,D,H,W (3D) or C,H,W (2D); with --encoder, smp's decoder (unet, unetplusplus, fpn, "
        "deeplabv3plus) on that timm encoder, --input-shape C,H,W",
    )
    src.add_argument(
        "--model", help="module:factory returning your nn.Module (built on the meta device)"
    )
    src.add_argument(
        "--hf",
        metavar="NAME_OR_PATH",
        help="a Hugging Face causal LM from its config.json alone (a file, its folder, or a hub "
        "name from the cache; online, the config only): with --seq-len, --lora, --qlora ...",
    )
    p.add_argument(
        "--size", help="input size(s) for --arch, comma-separated: 128,224 (default 224)"
    )
    p.add_argument(
        "--input-shape",
        help="one sample's shape for --model or a MONAI --arch, e.g. 3,224,224, 512 or 4,128,128,128",
    )
    p.add_argument("--widths", help="a MONAI --arch's channels per level, e.g. 16,32,64,128")
    p.add_argument(
        "--encoder",
        help="a timm encoder under --arch's segmentation_models_pytorch decoder, e.g. "
        "efficientnet_b0 (as bigbatch train task=segmentation encoder=...)",
    )
    p.add_argument(
        "--step",
        help="module:fn(model, batch) -> loss: your forward pass and loss for each micro-batch "
        "(a Hugging Face model with labels=, a wrapper, frozen weights, checkpointing); default "
        "cross-entropy of [B, C] outputs, else a mean square",
    )
    p.add_argument(
        "--input-dtype",
        choices=sorted(INPUT_DTYPES),
        help="the inputs' dtype for --model: long for token ids (default float32)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        help="with --input-dtype long: token ids are drawn from [0, vocab) (the embedding's "
        "size; default 2)",
    )
    p.add_argument("--num-classes", type=int, help="the head's outputs (--arch; default 1000)")


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The budget, the training settings the plan is for, and the outputs."""
    p.add_argument(
        "--batch",
        type=int,
        help="target batch (samples per optimizer step; required); with --hf, sequences a step "
        "over all ranks",
    )
    p.add_argument(
        "--budget",
        help="memory budget: 8GB, 16GiB, 512MiB, auto, or a GPU's name (t4, p100, l4, a10g, "
        "rtx4090, a100-80gb, h100, ...: that card's memory, its CUDA context kept out; "
        "--list-cards)",
    )
    p.add_argument(
        "--list-cards",
        action="store_true",
        help="the GPUs --budget takes by name, their memory and CUDA context, and the sources",
    )
    p.add_argument(
        "--device",
        help="the device to plan for: cpu or cuda (no GPU needed); default cpu, cuda with --hf "
        "or where --budget names a card",
    )
    precision = "autocast's dtype; default fp32 (bf16 with --hf); for a card named by --budget, "
    precision += "bigbatch train's precision=auto there (bf16, or fp16 before Ampere)"
    p.add_argument("--precision", choices=PRECISIONS, help=precision)
    optimizer = "the optimizer whose state the step holds (adamw_fused: torch's fused AdamW, "
    optimizer += "Trainer's default from torch 2.8; 8-bit and paged: bitsandbytes'); default adamw"
    p.add_argument("--optimizer", choices=OPTIMIZERS, help=optimizer)
    p.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="plan a CUDA step in cuDNN's benchmark mode (torch.backends.cudnn.benchmark, as "
        "timm's train.py and fastai set): the algorithms' workspaces and first-step trials",
    )
    p.add_argument(
        "--margin", type=float, help="safety margin, a fraction of the budget (default 0.1)"
    )
    p.add_argument(
        "--overhead",
        help="memory outside the step's tensors (default: this process on cpu; on cuda the "
        "context, measured on the GPU, else 703MiB as on an H100 with CUDA 13)",
    )
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip the CPU workspace calibration (small real steps at micro-batch 1, 2 and 4)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch's CPU threads while calibrating and timing (default: what bigbatch train "
        "takes on this machine; CPU workspaces grow with the threads)",
    )
    p.add_argument(
        "--fastest",
        action="store_true",
        help="time the plan's micro-batch and up to 3 smaller ones that fit (a few real steps "
        "each on the device) and choose the fastest; reports samples/s per candidate",
    )
    p.add_argument(
        "--confirm", action="store_true", help="run one real step at the plan on the device"
    )
    p.add_argument(
        "--json", action="store_true", help="print JSON (an object, or a list for a table)"
    )
    p.add_argument(
        "--cache-dim",
        type=int,
        help="plan for gradient caching (bigbatch.coupled): the representation size; the cache "
        "(representations, their gradients, a pairwise loss's batch x batch similarities) is "
        "held besides each micro-batch's step",
    )
    p.add_argument(
        "--cache-towers", type=int, help="representations per sample (two views: 2, the default)"
    )
    p.add_argument("--csv", type=Path, help="also write the table as CSV to this file")
    p.add_argument("--plot", type=Path, help="also write a PNG plot of peak vs micro-batch")


Row = tuple[str, int | None, Callable[[], nn.Module], tuple[int, ...]]

# Flags every plan reads, with their defaults, filled in once the flags typed are checked (a
# plan of a training run takes bigbatch train's keys instead, and refuses them typed).
SHARED_DEFAULTS: dict[str, Any] = {"margin": 0.10, "optimizer": "adamw"}
# The other flags a model's step is planned with, in bigbatch train's keys for a training run.
_TRAINING_KEYS = dict.fromkeys(
    ("arch", "model", "batch", "budget", "device", "precision", "overhead")
)


# The model flags each kind of model reads; set for another kind, they are refused.
_MODEL_FLAGS = ("size", "input_shape", "widths", "encoder", "input_dtype", "vocab", "num_classes")
_READ_BY = {
    "timm": ("size", "num_classes"),
    "monai": ("input_shape", "widths", "num_classes"),
    "smp": ("input_shape", "encoder", "num_classes"),
    "model": ("input_shape", "input_dtype", "vocab"),
}
_KIND_NAMES = {
    "timm": "a timm --arch (its input: 3 x --size x --size)",
    "monai": "a MONAI --arch (its input: --input-shape)",
    "smp": "smp's decoder on --encoder (its input: --input-shape)",
    "model": "--model (your factory builds it; its input: --input-shape)",
}


def _archs(args: argparse.Namespace) -> list[str]:
    """The architectures ``--arch`` names (comma-separated), none without it."""
    return [a.strip() for a in (args.arch or "").split(",") if a.strip()]


def _model_kind(args: argparse.Namespace) -> str:
    """Which model the flags plan: ``model``, ``smp``, ``monai`` or ``timm``; the flags that
    kind does not read are refused (set, they would be ignored)."""
    archs = _archs(args)
    kind = "timm"
    if args.model:
        kind = "model"
    elif args.encoder:
        kind = "smp"
    elif args.input_shape and all(a in MONAI_ARCHS for a in archs):
        kind = "monai"
    if kind == "model" and not args.input_shape:
        raise UserError("--model needs --input-shape, one sample's shape, e.g. 3,224,224")
    unread = flags_typed(args, {k: None for k in _MODEL_FLAGS if k not in _READ_BY[kind]})
    if kind == "model" and args.vocab is not None and args.input_dtype not in ("long", "int"):
        unread.append("--vocab (token ids: with --input-dtype long)")
    if unread:
        raise UserError(
            f"{', '.join(unread)}: not read for {_KIND_NAMES[kind]}: drop "
            f"{'them' if len(unread) > 1 else 'it'}"
        )
    return kind


def _targets(args: argparse.Namespace, kind: str) -> list[Row]:
    """(name, size, factory, per-sample input shape) for every row to plan, a ``kind`` of
    model (:func:`_model_kind`)."""
    if kind == "model":
        factory = load_callable(args.model, "--model")
        return [
            (args.model, None, factory, tuple(positive_ints(args.input_shape, "--input-shape")))
        ]
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.models import UnknownArchitectureError, timm_factory

    archs = _archs(args)
    rows: list[Row] = []
    if kind == "smp":
        return [_smp_row(a, args) for a in archs]
    if kind == "monai":
        return [_monai_row(a, args) for a in archs]
    for arch in archs:
        for size in positive_ints(args.size, "--size"):
            try:
                factory = timm_factory(arch, num_classes=args.num_classes, img_size=size)
            except UnknownArchitectureError as exc:
                raise UserError(str(exc)) from exc
            rows.append((arch, size, factory, (3, size, size)))
    return rows


def _monai_row(arch: str, args: argparse.Namespace) -> Row:
    """A MONAI segmentation network as ``bigbatch train task=segmentation`` builds it."""
    shape = tuple(positive_ints(args.input_shape, "--input-shape"))
    widths = tuple(positive_ints(args.widths, "--widths")) if args.widths else ()
    if len(shape) not in (3, 4):
        raise UserError(f"--arch {arch} takes --input-shape C,H,W or C,D,H,W, got {shape}")
    multiple = size_multiple(arch, widths)
    if any(n % multiple for n in shape[1:]):
        raise UserError(
            f"--input-shape {args.input_shape}: {arch} needs sizes divisible by {multiple}"
        )
    factory = functools.partial(
        build_network,
        arch,
        shape[0],
        args.num_classes,
        dims=len(shape) - 1,
        size=shape[1],
        widths=widths,
    )
    return (arch, None, factory, shape)


def _smp_row(arch: str, args: argparse.Namespace) -> Row:
    """segmentation_models_pytorch's ``arch`` decoder on ``--encoder``, as ``bigbatch train
    task=segmentation encoder=...`` builds it (its decoders halve the input 5 times)."""
    from bigbatch.segmentation.decoders import smp_factory

    if not args.input_shape:
        raise UserError(f"--encoder needs --input-shape C,H,W, e.g. 3,1408,2112 for {arch}")
    shape = tuple(positive_ints(args.input_shape, "--input-shape"))
    if len(shape) != 3 or any(n % 32 for n in shape[1:]):
        fit = "x".join(str(-(-n // 32) * 32) for n in shape[1:])
        raise UserError(
            f"--input-shape {args.input_shape}: smp's decoders take C,H,W with H and W "
            f"multiples of 32 (pad the image: {fit})"
        )
    try:
        factory = smp_factory(
            arch, args.encoder, in_channels=shape[0], num_classes=args.num_classes
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return (f"{arch}:{args.encoder}", None, factory, shape)


INPUT_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "long": torch.long,
    "int": torch.int32,
}


def _spec_maker(
    args: argparse.Namespace, factory: Callable[[], nn.Module], shape: tuple[int, ...], name: str
) -> Callable[[int], StepSpec]:
    step = load_callable(args.step, "--step") if args.step else None

    def spec_at(b: int) -> StepSpec:
        return StepSpec(
            factory,
            shape,
            b,
            args.optimizer,
            args.precision,
            args.device,
            input_dtype=INPUT_DTYPES[args.input_dtype],
            name=name,
            vocab=args.vocab,
            step=step,
            cudnn_benchmark=args.cudnn_benchmark,
        )

    return spec_at


def _world_size(args: argparse.Namespace, what: str) -> int:
    """``--world-size``: one number of ranks (1 where not given); DDP's, under torchrun."""
    worlds = positive_ints(args.world_size or "1", "--world-size")
    if len(worlds) > 1:
        raise UserError(
            f"--world-size {args.world_size}: {what} is for one number of ranks "
            "(torchrun --nproc-per-node N); plan each apart"
        )
    return worlds[0]


def _plan_training_run(args: argparse.Namespace) -> int:
    """``bigbatch plan task=... data=...``: the plan ``bigbatch train`` would make for these
    keys (the task's own step on its data's shapes, then its validation), without training.
    The step's flags are refused: the keys say all of it."""
    flags = flags_typed(args, {**SHARED_DEFAULTS, **plan_hf.IMAGE_ONLY, **_TRAINING_KEYS})
    flags = [f for f in flags if f != "--config"]
    if flags:
        raise UserError(
            f"{', '.join(flags)}: a plan of bigbatch train's run reads its keys, not these flags: "
            "give them as keys (batch=64 budget=t4 size=224 device=cuda ...; bigbatch train "
            "--help lists them), or drop the keys to plan a model's step with the flags"
        )
    from bigbatch.train.config import ConfigError, check_device, load_config
    from bigbatch.train.data import DataError
    from bigbatch.train.planning import model_factory_for, plan_for, plan_validation
    from bigbatch.train.runtime import resolve_device, resolve_precision
    from bigbatch.train.tasks import prepare_data, task_for

    world = _world_size(args, "a training run's plan")
    keys = [k for k in args.train_keys if "=" in k]
    if len(keys) != len(args.train_keys):
        raise UserError(f"{args.train_keys[0]!r}: give bigbatch train's keys as key=value")
    # A plan for a GPU needs none: the device is checked by name only, after the config.
    wanted = next((k.partition("=")[2] for k in reversed(keys) if k.startswith("device=")), "")
    try:
        cfg = load_config(args.config, [k for k in keys if not k.startswith("device=")])
        name = wanted or cfg.device
        check_device(name, "device", here=False)
        card = find_card(cfg.budget)
        if card is not None:  # as train runs on that card
            name, cfg.precision, filled = _for_card(card, name, cfg.precision)
            if "precision" in filled:
                print(
                    f"planned as bigbatch train runs on the {card.short_name}: device={name} "
                    f"precision={cfg.precision} (precision=auto's there)",
                    file=sys.stderr,
                )
        device = torch.device(name) if name != "auto" else resolve_device(name)
        cfg.device = str(device)
        if cfg.precision == "auto" and device.type != resolve_device("auto").type:
            raise ConfigError(
                f"precision=auto on a {device.type} this machine does not have: give "
                "precision=fp16 (T4, P100, V100) or bf16 (A100, L4, H100), or fp32"
            )
        precision = resolve_precision(cfg.precision, device)
        task = task_for(cfg)
        _, valid_items = prepare_data(task, lambda line: print(line, file=sys.stderr))
        factory = model_factory_for(task, cfg)
        choice = plan_for(cfg, factory, device, precision, print, task=task, world=world)
        choice = plan_validation(cfg, factory, device, precision, choice, task, valid_items, print)
    except (ConfigError, DataError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if args.json:
        facts = {"task": cfg.task, "target_batch": cfg.batch, "world_size": world}
        facts["rank_batch"] = rank_share(cfg.batch, world)
        print(json.dumps(choice._asdict() | facts))
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Everything about the arguments that can be refused before any planning."""
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.io import check_writable
    from bigbatch.train.config import ConfigError, check_device

    if args.arch is None and args.model is None:
        raise UserError("give the model to plan: --arch NAME (timm) or --model module:factory")
    if args.batch is None:
        raise UserError("--batch is needed: the target batch, samples per optimizer step")
    if args.budget is None:
        raise UserError(
            "--budget is needed: 8GB, 16GiB, auto, or a GPU's name such as t4 (--list-cards)"
        )
    if args.batch < 1:
        raise UserError(f"--batch must be a positive number of samples, got {args.batch}")
    if args.arch is not None and not args.arch.replace(",", "").strip():
        raise UserError(
            f"--arch {args.arch!r} names no architecture: give timm names, e.g. --arch resnet18"
        )
    if args.num_classes < 1:
        raise UserError(f"--num-classes must be >= 1, got {args.num_classes}")
    if args.vocab < 1:
        raise UserError(
            f"--vocab must be >= 1 (the embedding's number of tokens), got {args.vocab}"
        )
    if args.threads < 0:
        raise UserError(
            f"--threads must be >= 1 (or 0: what bigbatch train takes), got {args.threads}"
        )
    if args.cache_dim < 0 or args.cache_towers < 1:
        raise UserError("--cache-dim must be >= 0 and --cache-towers >= 1")
    if args.cudnn_benchmark and not args.device.startswith("cuda"):
        raise UserError(
            f"--cudnn-benchmark is cuDNN's, on CUDA: add --device cuda (not {args.device})"
        )
    try:
        # Planning for a GPU needs none; measuring on one (--confirm) does.
        check_device(args.device, "--device", here=args.confirm or args.fastest)
        for path, what in ((args.csv, "--csv"), (args.plot, "--plot")):
            if path is not None:
                check_writable(path, what)
    except (ConfigError, OSError) as exc:
        raise UserError(str(exc)) from exc


def _check_any_plan(args: argparse.Namespace) -> None:
    """What every plan refuses first, of a model's step, a language model or a training run."""
    if args.margin is not None and not 0 <= args.margin < 1:
        raise UserError(
            f"--margin is the fraction of the budget kept back, in [0, 1), got {args.margin}: "
            "e.g. --margin 0.1 (the default) plans for 90% of the budget"
        )
    if args.budget is not None and (unknown := card_hint(args.budget)):
        raise UserError(f"--budget {unknown}")
    if args.cudnn_benchmark and (args.hf is not None or args.config or args.train_keys):
        raise UserError(
            "--cudnn-benchmark plans a model's step (--arch, --model); a training run "
            "takes bigbatch train's key: cudnn_benchmark=true (on CUDA by default)"
        )


def run(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.coupled import cache_bytes

    if args.list_cards:
        _print_cards()
        return 0
    _check_any_plan(args)
    if args.hf is not None:
        fill_defaults(args, SHARED_DEFAULTS)
        return plan_hf.run(args)
    training = args.config or any(k.startswith(("task=", "data=")) for k in args.train_keys)
    if training and args.gradient_checkpointing:
        raise UserError(
            "--gradient-checkpointing: a training run's plan takes bigbatch train's key, "
            "grad_checkpointing=true"
        )
    plan_hf.refuse_language_flags(args, keep=("--world-size", "--gradient-checkpointing"))
    if training:
        return _plan_training_run(args)
    if args.train_keys:
        raise UserError(
            f"unrecognized arguments: {' '.join(args.train_keys)} (bigbatch plan takes --flags; "
            "bigbatch train's key=value plan a training run with data= or task=, or --config)"
        )
    kind = _model_kind(args)  # before the defaults: a flag typed for another model is refused
    fill_defaults(args, SHARED_DEFAULTS, plan_hf.IMAGE_ONLY)
    card_line = _card_defaults(args)
    _check_args(args)
    world = _world_size(args, "a model's step plan")
    # Every rank holds its share of each window (DDP): the union over ranks is the target batch.
    rank_batch = rank_share(args.batch, world)
    targets = _targets(args, kind)  # an unknown model or size refused before anything is said
    if args.gradient_checkpointing:  # as bigbatch train grad_checkpointing=true trains them
        from bigbatch.models import grad_checkpointed

        said = "--gradient-checkpointing"
        targets = [
            (n, size, grad_checkpointed(f, refused=UserError, said=said), shape)
            for n, size, f, shape in targets
        ]
    budget, overhead, card = _budget(args)
    _say(card_line)
    if world > 1:
        _say(share_line(args.batch, world))
    if card is not None:
        _say(
            f"card: {card.name}, {format_bytes(card.total_bytes)} ({card.source}), "
            f"{card.context_note}"
        )
    cache = (
        cache_bytes(rank_batch, args.cache_dim, towers=args.cache_towers) if args.cache_dim else 0
    )
    if cache:
        _say(f"gradient cache for batch {rank_batch}: {format_bytes(cache)} held besides each step")
    notes = _machine_notes(args, budget, card)
    threads = _threads(args)
    if args.own_process:  # reading the overhead loaded torch._dynamo and sympy
        freeze_loaded()
    with torch_threads(threads):
        plans, curves = _plan_rows(args, targets, budget, overhead, cache, notes, world, rank_batch)
    for p in plans:  # what it was planned for, with the defaults (a card's) resolved
        p |= {"threads": threads, "device": args.device, "precision": args.precision}
        p |= {"optimizer": args.optimizer, "world_size": world, "target_batch": args.batch}
        p["rank_batch"] = rank_batch
    if any(p.get("return_freed_memory") for p in plans):
        notes.append(RETURN_FREED_NOTE)
    if args.csv:
        _write_csv(args.csv, plans)
    if args.plot:
        _plot(args.plot, curves, budget)
    if args.json:
        for p in plans:  # the prediction's own notes, then the command's
            p["notes"] = [*(p.get("notes") or []), *notes]
        print(json.dumps(plans[0] if len(plans) == 1 else plans, indent=1))
    else:
        _print(plans, args, budget, rank_batch)
        for note in notes:
            print(f"note: {note}")
    return 0


def _budget(args: argparse.Namespace) -> tuple[int, int | None, Card | None]:
    """The budget in bytes, the overhead (None: read after calibration) and the card
    ``--budget`` names; a budget too small is refused before any model is built."""
    try:
        budget = resolve_budget(args.budget, args.device)
        overhead = parse_bytes(args.overhead, allow_zero=True) if args.overhead else None
        card = find_card(args.budget)
        if card is not None:
            overhead = card.context_bytes if overhead is None else overhead
        # Refuses a budget too small before any model is built; without --overhead each plan
        # reads it again after its calibration (what those real steps leave, training has too).
        usable_bytes(
            budget,
            overhead_bytes(args.device) if overhead is None else overhead,
            args.device,
            args.margin,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return budget, overhead, card


def _say(line: str) -> None:
    """A line about what the plan is for, on stderr: stdout stays the plan (JSON with --json)."""
    if line:
        print(line, file=sys.stderr)


def _card_defaults(args: argparse.Namespace) -> str:
    """``--device`` and ``--precision`` where not given: for a card named by ``--budget``,
    CUDA in the precision ``bigbatch train``'s ``precision=auto`` takes on it (bf16, or fp16
    where the card only emulates bf16), and the line that says so; else the CPU in fp32."""
    card = find_card(args.budget) if args.budget else None
    filled: list[str] = []
    if card is not None:
        args.device, args.precision, filled = _for_card(card, args.device, args.precision)
    args.device, args.precision = args.device or "cpu", args.precision or "fp32"
    said = [f"--device {args.device}"] if "device" in filled else []
    if "precision" in filled:
        said.append(f"--precision {args.precision} (precision=auto's there; give another)")
    if said and card is not None:
        return f"planned for the {card.short_name}: {' '.join(said)}"
    return ""


def _for_card(card: Card, device: str | None, precision: str | None) -> tuple[str, str, list[str]]:
    """The device and precision ``bigbatch train`` takes on ``card`` where they are left unset
    (None, '' or ``auto``): CUDA, and ``precision=auto``'s there (a precision only for a card's
    device: on a CPU, which refuses the card, it stays unset); with the names of those filled.

    >>> _for_card(find_card("t4"), "auto", "auto")
    ('cuda', 'fp16', ['device', 'precision'])
    """
    filled = []
    if device in (None, "", "auto"):
        device, filled = "cuda", ["device"]
    if precision in (None, "", "auto") and device_kind(device).dedicated_memory:
        precision = card.auto_precision
        filled.append("precision")
    return str(device), str(precision or ""), filled


def _machine_notes(args: argparse.Namespace, budget: int, card: Card | None) -> list[str]:
    """What the plan says of the machine it is for: a card that only emulates bf16, a budget
    past this machine's memory."""
    notes = []
    if card is not None and card.emulates_bf16 and args.precision == "bf16":
        notes.append(card.bf16_note("plan and train with --precision fp16"))
    total = total_bytes(args.device)
    if total is not None and budget > total:
        notes.append(
            f"the budget {format_bytes(budget)} is more than this machine's {args.device} memory "
            f"({format_bytes(total)}): fine for planning another machine, not for training here"
        )
    return notes


def _threads(args: argparse.Namespace) -> int | None:
    """The CPU threads to plan with: ``--threads``, else those `bigbatch train` would take here
    (every core on a small machine, whatever OMP_NUM_THREADS says), so a plan made in a shell
    with OMP_NUM_THREADS=1 holds for the training run. None for a GPU: nothing measured on the
    CPU then."""
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.train.runtime import training_threads

    if torch.device(args.device).type != "cpu":
        return args.threads or None
    return args.threads or training_threads()


def _plan_rows(
    args: argparse.Namespace,
    rows: list[Row],
    budget: int,
    overhead: int | None,
    cache: int,
    notes: list[str],
    world: int,
    rank_batch: int,
) -> tuple[list[dict[str, Any]], list[tuple[str, list[tuple[int, int]], int]]]:
    """Each row's plan for a window of ``rank_batch`` (or why it does not fit, when several rows
    are planned), and its curve. Over ``world`` > 1 ranks each row's DDP buckets are held beside
    its steps too."""
    plans: list[dict[str, Any]] = []
    curves: list[tuple[str, list[tuple[int, int]], int]] = []
    for name, size, factory, shape in rows:
        spec_at = _spec_maker(args, factory, shape, name)

        label = name if size is None else f"{name} @ {size}"
        buckets = 0
        try:
            if world > 1:
                buckets = ddp_bucket_bytes(build_on_meta(factory))
                _say(f"{label}: DDP's gradient buckets hold {format_bytes(buckets)} on each rank")
            plan = plan_under_budget(
                spec_at,
                rank_batch,
                budget,
                device=args.device,
                overhead=overhead,
                margin=args.margin,
                calibrate=not args.no_calibrate,
                extra_bytes=cache + buckets,
            )
            if plan.calibration_note:
                notes.append(f"{label}: {plan.calibration_note}")
        except DoesNotFitError as exc:
            if len(rows) == 1:
                raise UserError("; ".join([str(exc), *notes])) from exc
            plans.append(
                {
                    "arch": name,
                    "size": size,
                    "fits": False,
                    "floor_bytes": exc.floor.planning_bytes,
                    "error": str(exc),
                }
            )
            continue
        except (UserError, ModuleNotFoundError):
            raise  # already one line; a missing extra is named by bigbatch.cli.main
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        except Exception as exc:  # the model or its forward failed: say which, without a traceback
            raise UserError(
                f"{label}: building or running the model failed: {type(exc).__name__}: {exc}"
            ) from exc
        plan.arch, plan.size = name, size
        _confirm_and_curve(args, plan, spec_at, rank_batch)
        row = plan.to_dict() | {"fits": True}
        row["held_bytes"] = cache + buckets  # beside each step: off usable_bytes
        plans.append(row)
        curves.append((label, plan.curve, plan.usable_bytes))

    return plans, curves


def _confirm_and_curve(args: argparse.Namespace, plan: Any, spec_at: Any, rank_batch: int) -> None:
    """--confirm: the chosen micro-batch measured; --plot: a smooth curve (the powers of two the
    search did not visit, predicted the same way, each in a window of ``rank_batch``)."""
    if args.fastest:
        fastest(plan, spec_at)
    if args.confirm:
        # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
        from bigbatch.memory.measure import measure_step_peak

        plan.confirmed_peak_bytes = measure_step_peak(spec_at(plan.micro_batch))
    if args.plot:
        seen = {b for b, _ in plan.curve}
        smallest = min(seen)  # 2 where BatchNorm cannot train on one sample
        extra = [
            2**k for k in range(rank_batch.bit_length()) if 2**k not in seen and 2**k > smallest
        ]
        plan.curve = sorted(
            plan.curve
            + [
                (
                    b,
                    predict_peak(
                        spec_at(b).in_window(rank_batch), calibration=plan.calibration
                    ).planning_bytes,
                )
                for b in extra
            ]
        )


COLUMNS = [
    "arch",
    "size",
    "fits",
    "floor_bytes",
    "max_micro_batch",
    "micro_batch",
    "micro_batches",
    "predicted_peak_bytes",
    "budget_bytes",
    "confirmed_peak_bytes",
    # Under torchrun (--world-size): micro_batch x micro_batches make a rank's share.
    "target_batch",
    "world_size",
    "rank_batch",
    "held_bytes",
]


def _write_csv(path: Path, plans: list[dict[str, Any]]) -> None:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.io import atomic_write_csv

    atomic_write_csv(path, COLUMNS, plans)


def _plot(path: Path, curves: list[tuple[str, list[tuple[int, int]], int]], budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.io import atomic_write_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve, _ in curves:
        xs, ys = zip(*curve, strict=True)
        ax.plot(xs, [y / 2**30 for y in ys], marker="o", label=label)
    ax.axhline(budget / 2**30, color="red", linestyle="--", label=f"budget {format_bytes(budget)}")
    if curves:
        ax.axhline(
            curves[0][2] / 2**30,
            color="orange",
            linestyle=":",
            label="usable (less margin, overhead)",
        )
    ax.set_xlabel("micro-batch (samples)")
    ax.set_ylabel("predicted peak (GiB)")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Predicted peak memory of one training step")
    fig.tight_layout()
    atomic_write_figure(fig, path, dpi=110)


def _print_cards() -> None:
    print(
        f"{'card':<31} {'memory':>10} {'CUDA context':>13} {'16-bit':>6}  --budget (any of these)"
    )
    for c in CARDS:
        names = ", ".join((c.key, *c.aliases))
        context = f"{c.context_bytes / 2**20:.0f} MiB" + ("" if c.context_measured else "*")
        half = c.auto_precision
        print(f"{c.name:<31} {format_bytes(c.total_bytes):>10} {context:>13} {half:>6}  {names}")
    print(
        "* estimated: the H100's measured context (CUDA 13); on the card, overhead= sets what "
        "nvidia-smi shows a CUDA process holding before it allocates\n"
        "16-bit: the precision to train in (before Ampere, compute capability 8, bf16 is "
        "emulated: several times slower)\n\n"
        "the memory is what the driver reports (nvidia-smi's memory.total), from:"
    )
    for c in CARDS:
        print(f"  {c.key}: {c.source}")


def _print(
    plans: list[dict[str, Any]], args: argparse.Namespace, budget: int, rank_batch: int
) -> None:
    print(
        f"budget {format_bytes(budget)} on {args.device}, target batch {args.batch}"
        + (f" ({rank_batch} a rank)" if rank_batch != args.batch else "")
        + ", "
        f"{args.precision}, {args.optimizer}, margin {args.margin:.0%}"
        + (f", {plans[0]['threads']} CPU thread(s)" if plans and plans[0].get("threads") else ""),
    )
    header = f"{'model':<28} {'size':>5} {'floor (mb 1)':>13} {'max mb':>7} {'mb x accum':>12} {'predicted peak':>15}"
    print(header)
    print("-" * len(header))
    for p in plans:
        size = "" if p["size"] is None else str(p["size"])
        if not p["fits"]:
            print(
                f"{p['arch'][:28]:<28} {size:>5} {format_bytes(p['floor_bytes']):>13} {'does not fit even micro-batch 1':>36}",
            )
            continue
        split = f"{p['micro_batch']} x {p['micro_batches']}"  # micro-batch x accumulation
        line = (
            f"{p['arch'][:28]:<28} {size:>5} {format_bytes(p['floor_bytes']):>13} {p['max_micro_batch']:>7} "
            f"{split:>12} {format_bytes(p['predicted_peak_bytes']):>15}"
        )
        if p.get("confirmed_peak_bytes"):
            line += f"   measured {format_bytes(p['confirmed_peak_bytes'])}"
        print(line)
        if p.get("samples_per_s"):
            rates = ", ".join(f"{b}: {v:.1f}" for b, v in p["samples_per_s"].items())
            print(f"{'':<28} samples/s by micro-batch: {rates} (fastest chosen)")
        for note in p.get("notes") or []:  # the prediction's (the command's follow the table)
            print(f"{'':<28} note: {note}")
    if any(not p["fits"] for p in plans):
        print("\nrows that do not fit:")
        for p in plans:
            if not p["fits"]:
                print(f"  {p['arch']} @ {p['size']}: {p['error']}")
