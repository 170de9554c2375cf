"""``bigbatch predict RUN_DIR IMAGES --tta N``: class probabilities (.npz) and labels (.csv), or,
for a segmentation run, masks (PNG, .npy or NIfTI, as the inputs) in RUN/masks, or the
submission CSV of a run trained on a Kaggle RLE CSV."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli import UserError, add_task_options, say_device, task_options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", type=Path, help="a run folder written by bigbatch train")
    p.add_argument("images", type=Path, help="a folder of images or volumes (searched recursively)")
    p.add_argument(
        "--tta",
        type=int,
        default=2,
        help="test-time augmentation passes, averaged. Classification: 1 plain, 2 adds the "
        "horizontal flip, 3 and more add augmented crops. Segmentation, every pass a distinct "
        "flip: 1 none, 2 + horizontal, 3 + vertical, 4 + both (3D volumes: up to 8, the depth "
        "axis and the combinations)",
    )
    p.add_argument(
        "--checkpoint",
        default="best",
        choices=("best", "last"),
        help="the run's weights to predict with: best (by its monitor) or last (its last epoch)",
    )
    p.add_argument(
        "--unfinished",
        action="store_true",
        help="predict from a run that has not finished (its best epoch so far, without its "
        "task's last step, such as tuned thresholds); by default such a run is refused",
    )
    add_task_options(p)
    p.add_argument(
        "--out",
        type=Path,
        help="output path without suffix (default: RUN/predictions); segmentation: a folder "
        "(default: RUN/masks), or the submission CSV of an RLE run (default: RUN/submission.csv)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (a GPU where there is one: cuda, then mps; else the CPU), cpu, cuda, cuda:N "
        "or mps",
    )
    p.add_argument(
        "--budget",
        default="",
        help="memory for the forward passes (8GB, a card's name, auto): the batch planned under "
        "it; default: the batch the run planned for its validation (an OOM halves it either way)",
    )


def run(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.train.config import ConfigError
    from bigbatch.train.data import DataError
    from bigbatch.train.tasks import PredictRequest, check_finished, run_task_entry
    from bigbatch.train.trained_run import check_run_folder

    # A task's own options, passed only when set: a task refuses those it does not take.
    options = task_options(args)
    request = PredictRequest(
        run_dir=args.run,
        inputs=args.images,
        out=args.out,
        tta=args.tta,
        checkpoint=args.checkpoint,
        device=args.device,
        options=options,
        budget=args.budget,
    )
    try:
        entry = run_task_entry(args.run)
        predict = entry.predictor()
        if predict is None:
            raise ValueError(
                f"task={entry.name} registered no prediction: bigbatch predict cannot run it"
            )
        check_run_folder(args.run)  # before --out's folder is made in it
        note = check_finished(args.run, unfinished=args.unfinished)
        say_device(args.device)
        print(predict(request))
    except (ConfigError, DataError, ValueError, OSError) as exc:
        # A task's own bug (a KeyError, say) is not the user's input: its traceback shows.
        raise UserError(str(exc)) from exc
    if note:
        print(note)
    return 0
