"""``bigbatch ensemble EXPERIMENTS.toml --out DIR``: train members, TTA, weighted average, submit."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigbatch.cli import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "experiments", type=Path, help="TOML with [common], [ensemble] and [[member]] tables"
    )
    p.add_argument("overrides", nargs="*", help="key=value applied to every member, e.g. epochs=1")
    p.add_argument("--out", type=Path, default=Path("runs/ensemble"))


def run(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.train.config import ConfigError
    from bigbatch.train.data import DataError
    from bigbatch.train.ensemble import run_ensemble

    try:
        result = run_ensemble(args.experiments, args.out, overrides=args.overrides)
    except (ConfigError, DataError) as exc:
        raise UserError(str(exc)) from exc
    print("\nvalidation accuracy")
    for row in result.scores:
        print(f"  {row['member']:<20} weight {row['weight']:<5g} accuracy {row['accuracy']:.4f}")
    print(f"\nscores: {args.out / 'scores.csv'}")
    if result.submission:
        print(f"submission: {result.submission}\nensemble probabilities: {result.predictions}")
    return 0
