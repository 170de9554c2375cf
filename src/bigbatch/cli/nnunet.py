"""``bigbatch nnunet train DATASET CONFIGURATION FOLD --budget B``: nnU-Net v2's own training of
its plan, each batch in exact micro-batches that fit ``B``; ``bigbatch nnunet plan DATASET
--budget B``: each configuration's predicted peak on that card and the micro-batch that fits,
from a CPU. nnU-Net's folders come from its environment variables (``nnUNet_raw``,
``nnUNet_preprocessed``, ``nnUNet_results``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bigbatch.cli import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="nnunet_command", metavar="{example,train,plan,predict}")
    example = sub.add_parser("example", help="a tiny generated dataset in nnU-Net's raw format")
    example.add_argument("dataset_id", type=int, nargs="?", default=987, help="its id (987)")
    example.add_argument("--cases", type=int, default=5, help="volumes (5 or more: five folds)")
    sub.required = True
    train = sub.add_parser("train", help="train a fold of a plan with exact micro-batches")
    _add_train_arguments(train)
    plan = sub.add_parser("plan", help="each configuration's predicted peak on a card, from a CPU")
    plan.add_argument("dataset", help="the dataset's name or id")
    plan.add_argument(
        "--budget", required=True, help="12GB, 16GiB or a card's name (t4, a100-40gb)"
    )
    plan.add_argument(
        "--device", default="cuda", help="the device planned for (cuda: from any machine)"
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    predict = sub.add_parser(
        "predict",
        help="predict images with trained folds, several patches a forward pass under a budget",
    )
    predict.add_argument("dataset", help="the dataset's name or id")
    predict.add_argument("configuration", help="the configuration the folds were trained in")
    predict.add_argument(
        "-i",
        dest="inputs",
        required=True,
        type=Path,
        help="a folder of images in nnU-Net's raw layout (CASE_0000.nii.gz ...)",
    )
    predict.add_argument("-o", dest="output", required=True, type=Path, help="the output folder")
    predict.add_argument("--folds", nargs="+", default=["0"], help="the folds to average (0)")
    predict.add_argument("--plans", default="nnUNetPlans", help="the plans' name")
    predict.add_argument("--checkpoint", default="checkpoint_final.pth", help="each fold's")
    predict.add_argument(
        "--budget", default="auto", help="memory: 12GB, a card (t4), or auto (free memory)"
    )
    predict.add_argument("--tiles", type=int, default=0, help="patches a forward pass (0: planned)")
    predict.add_argument("--device", default="cuda", help="cuda, cpu or mps")
    predict.add_argument(
        "--step-size", type=float, default=0.5, help="the windows' step, of the patch"
    )
    predict.add_argument("--disable-tta", action="store_true", help="no mirroring (nnU-Net's)")
    predict.add_argument("--save-probabilities", action="store_true", help="also the .npz")


def _add_train_arguments(train: argparse.ArgumentParser) -> None:
    """``bigbatch nnunet train``'s arguments: nnUNetv2_train's, the budget, the trackers."""
    train.add_argument("dataset", help="the dataset's name or id (Dataset004_Hippocampus, 4)")
    train.add_argument("configuration", help="2d, 3d_fullres, 3d_lowres, 3d_cascade_fullres")
    train.add_argument("fold", help="0 to 4, or all")
    train.add_argument(
        "--plans", default="nnUNetPlans", help="the plans' name (nnUNetResEncUNetLPlans)"
    )
    train.add_argument(
        "--budget", default="auto", help="memory: 12GB, 16GiB, a card (t4, a100), or auto"
    )
    train.add_argument("--micro-batch", type=int, default=0, help="fixed micro-batch (0: planned)")
    train.add_argument(
        "--device", default="cuda", help="cuda, cpu or mps (as nnUNetv2_train -device)"
    )
    train.add_argument(
        "--c",
        dest="continue_training",
        action="store_true",
        help="continue from the latest checkpoint",
    )
    train.add_argument(
        "--val",
        dest="validation_only",
        action="store_true",
        help="only run the validation (needs a finished training)",
    )
    train.add_argument(
        "--pretrained-weights",
        type=Path,
        help="a checkpoint's network weights to start from (read with weights_only=True)",
    )
    train.add_argument("--epochs", type=int, default=0, help="epochs (0: nnU-Net's 1000)")
    train.add_argument(
        "--log",
        default="none",
        help="experiment trackers: tensorboard, wandb, mlflow (comma-separated; offline, files "
        "in the fold's folder), or none",
    )
    train.add_argument(
        "--iterations-per-epoch",
        type=int,
        default=0,
        help="training iterations an epoch (0: nnU-Net's 250)",
    )


# The folders each command reads: nnU-Net reads them when first imported, and says each one
# missing in a paragraph of its own, so they are checked before it is.
NEEDS = {
    "example": ("nnUNet_raw",),
    "plan": ("nnUNet_preprocessed",),
    "train": ("nnUNet_preprocessed", "nnUNet_results"),
    "predict": ("nnUNet_results",),
}


def run(args: argparse.Namespace) -> int:
    import os

    if missing := [v for v in NEEDS.get(args.nnunet_command, ()) if not os.environ.get(v)]:
        raise UserError(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: export "
            "nnUNet_raw, nnUNet_preprocessed and nnUNet_results as nnU-Net's documentation "
            "says (setting_up_paths.md)"
        )
    _refuse_bad_flags(args)
    # Imported when the command runs: `bigbatch --help` must not load torch or nnU-Net.
    try:
        from bigbatch.integrations import nnunet
    except ImportError as exc:
        raise UserError(str(exc)) from exc
    try:
        if args.nnunet_command == "example":
            return _example(nnunet, args)
        if args.nnunet_command == "train":
            return _train(nnunet, args)
        if args.nnunet_command == "predict":
            return _predict(nnunet, args)
        return _plan(nnunet, args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise UserError(
            f"{type(exc).__name__}: {exc}" if isinstance(exc, RuntimeError) else str(exc)
        ) from exc


def _refuse_bad_flags(args: argparse.Namespace) -> None:
    """The flags' own mistakes, refused before nnU-Net and torch load (seconds)."""
    if args.nnunet_command == "predict":
        wrong = [f for f in args.folds if f != "all" and not f.isdigit()]
        if wrong:
            raise UserError(f"--folds takes fold numbers (0 1 2 3 4) or all, got {wrong[0]!r}")
    if args.nnunet_command != "train":
        return
    if args.continue_training and args.pretrained_weights:
        raise UserError("--c continues a training; --pretrained-weights starts one: choose one")
    training_only = [
        flag
        for flag, given in (
            ("--c", args.continue_training),
            ("--pretrained-weights", args.pretrained_weights),
            ("--micro-batch", args.micro_batch),
            ("--epochs", args.epochs),
            ("--iterations-per-epoch", args.iterations_per_epoch),
        )
        if given
    ]
    if args.validation_only and training_only:
        raise UserError(
            f"{', '.join(training_only)}: for training, and --val only validates the fold's "
            "final checkpoint: drop them, or drop --val"
        )
    if args.micro_batch < 0:
        raise UserError(
            f"--micro-batch is a number of samples >= 1 (0: planned), got {args.micro_batch}"
        )
    for flag, value in (
        ("--epochs", args.epochs),
        ("--iterations-per-epoch", args.iterations_per_epoch),
    ):
        if value < 0:
            raise UserError(f"{flag} must be >= 1 (0: nnU-Net's default), got {value}")


def _example(nnunet: Any, args: argparse.Namespace) -> int:
    import os

    raw = os.environ["nnUNet_raw"]  # noqa: SIM112 - nnU-Net's own name, checked by run()
    folder = nnunet.write_example_dataset(raw, args.dataset_id, cases=args.cases)
    print(
        f"{folder}: {args.cases} cases; next: nnUNetv2_plan_and_preprocess -d {args.dataset_id} "
        f"-c 3d_fullres, then bigbatch nnunet train {args.dataset_id} 3d_fullres 0 --device cpu "
        "--epochs 1 --iterations-per-epoch 5"
    )
    return 0


def _train(nnunet: Any, args: argparse.Namespace) -> int:
    import torch

    from bigbatch.trackers import check_trackers, parse_trackers

    check_trackers(parse_trackers(args.log))  # a missing library: said before any work
    trainer = nnunet.trainer_for(
        args.dataset,
        args.configuration,
        args.fold,
        plans_identifier=args.plans,
        continue_training=args.continue_training,
        device=torch.device(args.device),
    )
    trainer.budget, trainer.micro_batch, trainer.log_to = args.budget, args.micro_batch, args.log
    if args.epochs:
        trainer.num_epochs = args.epochs
    if args.iterations_per_epoch:
        trainer.num_iterations_per_epoch = args.iterations_per_epoch
    if args.pretrained_weights:
        nnunet.load_pretrained(trainer, args.pretrained_weights)
    elif args.continue_training or args.validation_only:
        nnunet.load_own_checkpoint(trainer, validation_only=args.validation_only)
    if not args.validation_only:
        trainer.run_training()
    trainer.perform_actual_validation(False)
    return 0


def _predict(nnunet: Any, args: argparse.Namespace) -> int:
    folds = tuple(f if f == "all" else int(f) for f in args.folds)
    out = nnunet.predict_folds(
        args.dataset,
        args.configuration,
        args.inputs,
        args.output,
        folds=folds,
        plans_identifier=args.plans,
        checkpoint=args.checkpoint,
        budget=args.budget,
        device=args.device,
        tiles=args.tiles,
        step_size=args.step_size,
        mirroring=not args.disable_tta,
        save_probabilities=args.save_probabilities,
        log=lambda line: print(line, file=sys.stderr),
    )
    print(f"predicted {len(list(out.glob('*.nii.gz')))} case(s) into {out}")
    return 0


def _plan(nnunet: Any, args: argparse.Namespace) -> int:
    rows = nnunet.plan_dataset(args.dataset, args.budget, device=args.device)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{'plans':<28} {'configuration':<20} {'patch':<16} {'batch':>5} {'micro':>5}  predicted peak"
    )
    for r in rows:
        patch = "x".join(map(str, r["patch_size"]))
        peak = (
            r["predicted_peak"] if r["fits"] else f"{r['predicted_peak']} (does not fit even at 1)"
        )
        print(
            f"{r['plans']:<28} {r['configuration']:<20} {patch:<16} {r['batch_size']:>5} {r['micro_batch']:>5}  {peak}"
        )
    print(
        f"budget {args.budget} on {args.device}; micro: the micro-batch bigbatch trains with",
        file=sys.stderr,
    )
    return 0
