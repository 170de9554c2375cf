"""``bigbatch train CONFIG.toml key=value ...``: train one model into a run folder."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bigbatch.cli import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.train.config import keys_help

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = keys_help()
    p.add_argument("config", nargs="?", help="a TOML file of training keys (optional)")
    p.add_argument(
        "overrides", nargs="*", help="key=value pairs that override the file, e.g. epochs=3"
    )
    p.add_argument("--out", type=Path, help="the run folder (default: runs/<arch>-<size>)")
    p.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue this run after a crash or kill"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


RUN_FILES = (
    "best.safetensors",
    "last.safetensors",
    "last.pt",
    "history.csv",
    "history.png",
    "plan.json",
    "config.json",
    "split.json",
    "train.log",
)
# The run's bookkeeping, not named in the closing line.
QUIET_FILES = ("config.toml", "classes.json", "task.json", "best.json", "done.json")


def run(args: argparse.Namespace) -> int:
    # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
    from bigbatch.io import DamagedFileError
    from bigbatch.train.config import ConfigError, config_from_json, load_config
    from bigbatch.train.data import DataError
    from bigbatch.train.loop import train

    overrides = list(args.overrides)
    config = args.config
    if args.resume and args.out and args.out.resolve() != args.resume.resolve():
        raise UserError(
            f"--resume {args.resume} continues that run in its own folder, but --out {args.out} "
            f"names another: drop --out (or copy {args.resume} to {args.out} and resume that)"
        )
    if config and Path(config).is_dir():
        raise UserError(
            f"{config} is a folder, but the first argument is a TOML config file: give the data "
            f"as a key, `bigbatch train data={config} ...` (an image folder, one sub-folder per "
            "class, or a CSV)"
        )
    if config and "=" in config and not config.endswith(".toml"):
        overrides.insert(0, config)  # only overrides were given
        config = None
    run_dir: Path | None = args.resume or args.out
    try:
        if args.resume and not config:
            # The run's own config with the keys given on top (not the defaults' task and data).
            saved = args.resume / "config.json"
            if not saved.is_file():
                raise ConfigError(f"--resume {args.resume}: no run there (config.json is missing)")
            cfg = config_from_json(saved.read_text(), str(saved))
            if overrides:
                cfg = load_config(None, overrides, base=cfg)
        else:
            cfg = load_config(config, overrides)
        run_dir = (
            args.resume
            or args.out
            or Path("runs") / f"{Path(cfg.model_name).name.replace(':', '-')}-{cfg.size}"
        )
        result = train(
            cfg,
            run_dir,
            resume=args.resume is not None,
            progress=False if args.no_progress else None,
        )
    except (ConfigError, DataError, DamagedFileError) as exc:
        raise UserError(str(exc)) from exc
    except KeyboardInterrupt:
        # Checkpoints are written atomically: the last one is whole.
        where = run_dir or "RUN_DIR"
        print(
            f"bigbatch train: interrupted; finished work is kept: `bigbatch train --resume "
            f"{where}` continues from its last checkpoint",
            file=sys.stderr,
        )
        return 130
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 alone reports
        print(f"\nrun folder: {result.run_dir}  (best {result.monitor} {result.best_metric:.4f})")
        ooms = [e for e in result.backoff_events if e.reason == "oom"]
        if ooms:
            first = ooms[0]
            print(
                f"  out of memory {len(ooms)} time(s): the back-off shrank the micro-batch "
                f"({first.old} -> {first.new} first, at optimizer step {first.optimizer_step}) "
                "with the same updates; the plan was too large for this device: lower budget= "
                "(or set overhead=) next time"
            )
        # Only what is there (history.png needs matplotlib), then what the task wrote of its
        # own (a Kaggle segmentation run's postprocess.json).
        written = [name for name in RUN_FILES if (result.run_dir / name).is_file()]
        written += sorted(
            p.name
            for p in result.run_dir.iterdir()
            if p.is_file()
            and p.name not in (*RUN_FILES, *QUIET_FILES)
            and not p.name.startswith(".")
        )
        print("  " + ", ".join(f"{n} (resume)" if n == "last.pt" else n for n in written))
    return 0
