"""``bigbatch new-task NAME``: write a plug-in package for a task of your own, to start from."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the task's name, as users will type task=NAME (e.g. tags)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        help="the folder to write the package's folder (bigbatch-NAME) in; default: here",
    )


def run(args: argparse.Namespace) -> int:
    from bigbatch.train.scaffold import TaskPackage, write_task_package

    try:
        folder = write_task_package(args.name, args.out)
    except (ValueError, FileExistsError) as exc:
        raise UserError(str(exc)) from exc
    package = TaskPackage(args.name)
    print(f"wrote {folder}: task={args.name}, multi-label image tagging to start from")
    print(f"  src/{package.package}/task.py   the task: data, model, loss, metrics, prediction")
    print(f"  src/{package.package}/__init__.py   ENTRY, what the entry point names")
    print(f"  tests/test_{args.name}.py   trains it for one epoch")
    print("next:")
    print(f"  cd {folder} && pip install -e . && pytest tests")
    print(f"  bigbatch train task={args.name} data=YOUR.csv batch=64 epochs=5 --out runs/a")
    return 0
