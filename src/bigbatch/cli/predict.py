"""``bigbatch predict RUN_DIR IMAGES --tta N``: class probabilities (.npz) and labels (.csv), or,
for a segmentation run, masks (PNG, .npy or NIfTI, as the inputs) in RUN/masks."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", type=Path, help="a run folder written by bigbatch train")
    p.add_argument("images", type=Path, help="a folder of images or volumes (searched recursively)")
    p.add_argument(
        "--tta",
        type=int,
        default=2,
        help="passes: 1 plain, 2 adds the flip, more add augmented crops (segmentation: flips "
        "along each spatial axis)",
    )
    p.add_argument("--checkpoint", default="best", choices=("best", "last"))
    p.add_argument(
        "--patch",
        type=int,
        default=0,
        help="segmentation volumes: the edge of the overlapping windows (a multiple of the "
        "network's stride); default: the training patch size",
    )
    p.add_argument(
        "--overlap",
        type=float,
        default=0.5,
        help="segmentation volumes: how much neighbouring windows overlap (0 to <1)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="output path without suffix (default: RUN/predictions); segmentation: a folder "
        "(default: RUN/masks)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")


def run(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.io import check_writable
    from bigbatch.train.config import ConfigError
    from bigbatch.train.data import DataError
    from bigbatch.train.tasks.classification.predict import predict_folder, save_predictions
    from bigbatch.train.tasks.segmentation.predict import is_segmentation_run, predict_masks

    try:
        segmentation = is_segmentation_run(args.run)
    except ConfigError as exc:
        raise UserError(str(exc)) from exc
    if segmentation:
        out = args.out or args.run / "masks"
        try:
            check_writable(out / "probe", "--out")
            masks = predict_masks(
                args.run,
                args.images,
                out,
                tta=args.tta,
                checkpoint=args.checkpoint,
                device=args.device,
                patch=args.patch,
                overlap=args.overlap,
            )
        except (ConfigError, DataError, ValueError, OSError) as exc:
            raise UserError(str(exc)) from exc
        print(f"{len(masks)} mask(s), {args.tta} TTA pass(es) (flips): {out}")
        return 0
    if args.patch:
        raise UserError("--patch is for segmentation runs; this run classifies images")
    if args.overlap != 0.5:
        raise UserError("--overlap is for segmentation runs; this run classifies images")
    try:
        check_writable((args.out or args.run / "predictions").with_suffix(".npz"), "--out")
        pred = predict_folder(
            args.run, args.images, tta=args.tta, checkpoint=args.checkpoint, device=args.device
        )
    except (ConfigError, DataError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc
    npz, csv_path = save_predictions(pred, args.out or args.run / "predictions")
    print(
        f"{len(pred.files)} images, {args.tta} TTA pass(es): probabilities in {npz}, labels in {csv_path}"
    )
    return 0
