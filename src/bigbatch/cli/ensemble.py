"""``bigbatch ensemble EXPERIMENTS.toml --out DIR``: train members, TTA, weighted average, submit;
``bigbatch ensemble RUN RUN ... --images DIR``: the submission of runs trained on a Kaggle RLE
CSV, their probabilities averaged before the per-class thresholds."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli import (
    UserError,
    add_task_options,
    fill_defaults,
    flags_typed,
    say_device,
    task_options,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "experiments",
        type=Path,
        help="TOML with [common], [ensemble] and [[member]] tables; or the first of several "
        "run folders trained on a Kaggle RLE CSV (with --images)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="key=value applied to every member, e.g. epochs=1; or the other run folders",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/ensemble"),
        help="the folder the members' runs and the ensemble's predictions go to (run folders: "
        "where submission.csv and its postprocess.json go)",
    )
    p.add_argument(
        "--images", type=Path, help="run folders: the test images to write the submission for"
    )
    add_task_options(p)  # run folders: each task's own (a Kaggle run's --mask-size)
    p.add_argument(
        "--tta",
        type=int,
        help="run folders: test-time passes per image, each a distinct flip: 1 none, 2 + "
        "horizontal (the default), 3 + vertical, 4 + both",
    )
    p.add_argument(
        "--device",
        help="run folders: auto (a GPU where there is one, else the CPU), cpu, cuda, cuda:N or "
        "mps; an experiments TOML's members predict on their device=",
    )
    p.add_argument(
        "--unfinished",
        action="store_true",
        help="run folders: use runs that have not finished (their best epoch so far); by "
        "default such a run is refused",
    )
    p.add_argument(
        "--budget",
        help="memory for the forward passes (8GB, a card's name, auto): the batch planned under "
        "it; default: the batch the run planned for its validation (an OOM halves it either way)",
    )


def run(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.io import DamagedFileError, FolderBusyError, lock_folder
    from bigbatch.train.config import ConfigError
    from bigbatch.train.data import DataError

    if args.experiments.is_dir():
        return _run_folders(args)
    _refuse_folder_flags(args)
    from bigbatch.train.ensemble import run_ensemble

    try:
        # Two ensembles into one folder would interleave their files: the second is refused.
        with lock_folder(args.out, "--out"):
            result = run_ensemble(args.experiments, args.out, overrides=args.overrides)
    except (ConfigError, DataError, DamagedFileError, FolderBusyError, NotADirectoryError) as exc:
        raise UserError(str(exc)) from exc
    print("\n" + result.summary(args.out))
    return 0


# The flags of run folders and their defaults, filled in once checked: an experiments TOML
# sets these in the file, and refuses them typed (even at these values).
_FOLDER_FLAGS = {"images": None, "tta": 2, "device": "auto", "unfinished": False, "budget": ""}


def _refuse_folder_flags(args: argparse.Namespace) -> None:
    """An experiments TOML with the flags of run folders: refused (they would be ignored)."""
    given = flags_typed(args, _FOLDER_FLAGS)  # the demo's own namespace has none of them
    given += [f"--{k.replace('_', '-')}" for k in task_options(args)]
    if given:
        raise UserError(
            f"{', '.join(given)}: for run folders; an experiments TOML says it in the file "
            "(tta = 4 and test = in [ensemble], device= in [common] or as key=value): drop "
            f"{'them' if len(given) > 1 else 'it'}"
        )


def _run_folders(args: argparse.Namespace) -> int:
    """Finished runs of one task, averaged as their task averages (probabilities, values, or
    a Kaggle submission's probabilities before its rules)."""
    from bigbatch.io import DamagedFileError, FolderBusyError, check_writable, lock_folder
    from bigbatch.train.config import ConfigError
    from bigbatch.train.data import DataError
    from bigbatch.train.tasks import EnsembleRequest, check_finished, run_task_entry

    runs = [args.experiments, *map(Path, args.overrides)]
    not_runs = [r for r in runs if not (r / "task.json").is_file()]
    if not_runs:
        raise UserError(
            f"{not_runs[0]} is not a run folder (no task.json): give the folders bigbatch train "
            "wrote, or an experiments TOML"
        )
    fill_defaults(args, _FOLDER_FLAGS)
    if args.images is None:
        raise UserError("run folders need --images DIR: the images to predict and average")
    options = task_options(args)
    try:
        entries = [run_task_entry(r) for r in runs]
        names = [e.name for e in entries]
        if len(set(names)) > 1:
            raise ValueError(
                f"the runs are of different tasks ({', '.join(sorted(set(names)))}): an ensemble "
                "averages runs of one task"
            )
        notes = [n for r in runs if (n := check_finished(r, unfinished=args.unfinished))]
        ensemble = entries[0].ensembler()
        if ensemble is None:
            raise ValueError(f"task={names[0]} registered no ensemble: average its runs by hand")
        check_writable(args.out / "probe", "--out")  # the folder, made, or why it cannot be
        request = EnsembleRequest(
            runs=tuple(runs),
            images=args.images,
            out=args.out,
            tta=args.tta,
            device=args.device,
            options=options,
            budget=args.budget,
        )
        say_device(args.device)
        # Two ensembles into one folder would race on its files: the second is refused.
        with lock_folder(args.out, "--out"):
            print(ensemble(request))
    except (ConfigError, DataError, DamagedFileError, FolderBusyError, ValueError, OSError) as exc:
        # A task's own bug (a KeyError, say) is not the user's input: its traceback shows.
        raise UserError(str(exc)) from exc
    for note in notes:
        print(note)
    return 0
