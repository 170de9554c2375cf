"""``bigbatch demo``: the main job end to end on the bundled UCI digits."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


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


def run(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.cli import ensemble as ensemble_cli
    from bigbatch.train.demo import write_digits_competition

    t0 = time.perf_counter()
    if args.task == "brats":
        # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
        from bigbatch.train.demo import run_brats_demo

        dice = run_brats_demo(args.out, epochs=args.epochs or 10)
        print(
            "\nvalidation Dice per region (mean over cases): "
            + ", ".join(f"{k} {v:.3f}" for k, v in dice.items())
            + f"; run in {args.out / 'runs' / 'brats'}"
        )
        print(f"demo finished in {time.perf_counter() - t0:.0f} s")
        return 0
    if args.task == "clouds":
        # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
        from bigbatch.train.demo import run_clouds_demo

        dice = run_clouds_demo(args.out, epochs=args.epochs or 10)
        print(
            "\nvalidation Dice per class with the tuned rules (the competition's: empty vs "
            "empty scores 1): "
            + ", ".join(f"{k} {v:.3f}" for k, v in dice.items())
            + f"; run in {args.out / 'runs' / 'clouds'}"
        )
        print(f"demo finished in {time.perf_counter() - t0:.0f} s")
        return 0
    args.epochs = args.epochs or 4
    if args.task == "regression":
        # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
        from bigbatch.train.demo import run_regression_demo

        scores = run_regression_demo(args.out, epochs=args.epochs)
        print(
            "\nvalidation (mean over the two targets, in their units): "
            + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
            + f"; run in {args.out / 'runs' / 'regression'}"
        )
        print(f"demo finished in {time.perf_counter() - t0:.0f} s")
        return 0
    if args.task == "segmentation":
        # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
        from bigbatch.train.demo import run_segmentation_demo

        scores = run_segmentation_demo(args.out, epochs=args.epochs)
        print(
            "\nvalidation Dice: "
            + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
            + f"; runs in {args.out / 'runs'}/dynunet2d and dynunet3d (history.png: losses, Dice, Jaccard)"
        )
        print(f"demo finished in {time.perf_counter() - t0:.0f} s")
        return 0
    data = args.out / "data"
    print(
        f"writing the UCI digits as an image competition under {data}/ (train/, test/, sample_submission.csv)"
    )
    experiments = write_digits_competition(data, budget=args.budget, epochs=args.epochs)
    print(f"experiments: {experiments}\n")
    code = ensemble_cli.run(
        argparse.Namespace(experiments=experiments, out=args.out / "runs", overrides=[])
    )
    print(
        f"\nper-member runs (checkpoints, history.csv, history.png, plan.json): {args.out / 'runs'}/<member>/"
    )
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return code
