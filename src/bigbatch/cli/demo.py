"""``bigbatch demo``: the main job end to end on the bundled UCI digits."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bigbatch.cli import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", type=Path, default=Path("demo_output"), help="the folder the demo writes"
    )
    p.add_argument(
        "--task",
        default="classification",
        choices=("classification", "segmentation", "regression", "brats", "clouds"),
        help="classification: the digits competition and an ensemble; segmentation: 2D shapes "
        "and 3D blobs (generated), MONAI's DynUNet, Dice/Jaccard, predicted masks; brats: "
        "four-modality NIfTI volumes with nested regions, MONAI's SegResNet at micro-batch 1, "
        "per-region Dice; regression: two numbers per digit image (ink share, value) from a CSV, "
        "MAE/RMSE/R2 and predictions in the CSV's layout; clouds: a Kaggle RLE CSV with overlapping classes, an smp U-Net at "
        "full resolution, tuned thresholds and a submission",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=0,
        help="default: 4 (classification, segmentation), 10 (brats, clouds)",
    )
    p.add_argument(
        "--budget",
        default="auto",
        help="memory for each member's training step; auto: half the batch fits, not all of it",
    )


# Each generated-data demo: its runner in bigbatch.train.demo, its default epochs, and how its
# scores are said.
_GENERATED = {
    "brats": (
        "run_brats_demo",
        10,
        "validation Dice per region (mean over cases)",
        "brats",
    ),
    "clouds": (
        "run_clouds_demo",
        10,
        "validation Dice per class with the tuned rules (the competition's: empty vs empty "
        "scores 1)",
        "clouds",
    ),
    "regression": (
        "run_regression_demo",
        4,
        "validation (mean over the two targets, in their units)",
        "regression",
    ),
    "segmentation": (
        "run_segmentation_demo",
        4,
        "validation Dice",
        "dynunet2d and dynunet3d (history.png: losses, Dice, Jaccard)",
    ),
}


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    code = _run_generated(args) if args.task in _GENERATED else _run_digits(args)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return code


def _run_generated(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.io import FolderBusyError, lock_folder
    from bigbatch.train import demo
    from bigbatch.train.config import ConfigError

    runner, epochs, said, runs = _GENERATED[args.task]
    try:
        # Two demos into one folder would interleave their files: the second is refused.
        with lock_folder(args.out, "--out"):
            scores = getattr(demo, runner)(args.out, epochs=args.epochs or epochs)
    except (ConfigError, FolderBusyError, NotADirectoryError) as exc:
        raise UserError(str(exc)) from exc
    print(
        f"\n{said}: "
        + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
        + f"; run(s) in {args.out / 'runs'}/{runs}"
    )
    return 0


def _run_digits(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.cli import ensemble as ensemble_cli
    from bigbatch.train.demo import write_digits_competition

    data = args.out / "data"
    print(
        f"writing the UCI digits as an image competition under {data}/ (train/, test/, "
        "sample_submission.csv)"
    )
    experiments = write_digits_competition(data, budget=args.budget, epochs=args.epochs or 4)
    print(f"experiments: {experiments}\n")
    code = ensemble_cli.run(
        argparse.Namespace(experiments=experiments, out=args.out / "runs", overrides=[])
    )
    print(
        "\nper-member runs (checkpoints, history.csv, history.png, plan.json): "
        f"{args.out / 'runs'}/<member>/"
    )
    return int(code)
