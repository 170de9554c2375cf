"""Entry point: ``bigbatch <command> ...`` (also ``python -m bigbatch``)."""

from __future__ import annotations

import argparse
import errno
import gc
import importlib
import logging
import os
import sys
import types
from collections.abc import Sequence

from bigbatch import __version__
from bigbatch.cli import UserError, freeze_loaded
from bigbatch.user_code import UserCodeError

# Subcommand -> module; each module has add_arguments(parser) and run(args) -> int.
# Imported lazily so `bigbatch verify` does not pay for timm or matplotlib.
COMMANDS = {
    "verify": ("bigbatch.cli.verify", "prove accumulated training equals big-batch training"),
    "plan": (
        "bigbatch.cli.plan",
        "micro-batch x accumulation under a memory budget, predicted on the CPU",
    ),
    "train": ("bigbatch.cli.train", "train a timm model (or yours) on an image folder or CSV"),
    "predict": ("bigbatch.cli.predict", "class probabilities for a folder of images, with TTA"),
    "ensemble": ("bigbatch.cli.ensemble", "train members, TTA, weighted average, submission CSV"),
    "demo": ("bigbatch.cli.demo", "the whole job on the bundled digits (no download)"),
    "new-task": ("bigbatch.cli.new_task", "write a plug-in package for a task of your own"),
    "nnunet": (
        "bigbatch.cli.nnunet",
        "nnU-Net v2's training with exact micro-batches; its plans on a card",
    ),
}


def build_parser(load: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommands in ``load`` (default: all) get their arguments, since
    each one's module imports torch: ``bigbatch --help`` loads none of them."""
    parser = argparse.ArgumentParser(
        prog="bigbatch",
        description="Train with the batch size you want on the memory you have.",
    )
    parser.add_argument("--version", action="version", version=f"bigbatch {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="also log bigbatch's notes (logging INFO)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="log errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if load is None or name in load:
            importlib.import_module(module).add_arguments(p)
    return parser


# The optional libraries behind the commands, and the extra that installs each.
_EXTRAS = {
    "timm": "train",
    "PIL": "train",
    "safetensors": "train",
    "matplotlib": "plot",
    "rich": "train",
    "torchmetrics": "train",
    "nibabel": "seg",
    "monai": "seg",
    "einops": "seg",
    "scipy": "seg",
    "pydicom": "dicom",
    "nnunetv2": "nnunet",
}

# Subcommands whose settings are key=value pairs: they may follow the flags too
# (`bigbatch train cfg.toml --out runs/y epochs=1`).
_KEY_VALUE = ("train", "ensemble")


def one_style(
    words: list[str], command: str, options: dict[str, argparse.Action], keys: bool = False
) -> list[str]:
    """``key=value`` and ``--key value`` mean the same to every subcommand: a flag command
    (plan, predict, verify, demo) takes ``batch=256`` as ``--batch 256`` (``true``/``false`` for
    a switch), and a key command (train, ensemble) takes ``--epochs 3`` as ``epochs=3``.
    Underscores and dashes are the same in a name. ``keys``: this flag command's ``key=value``
    words are ``bigbatch train``'s keys (``bigbatch plan task=... data=...``), kept as they are.

    >>> one_style(["batch=8", "--out", "r"], "plan", {"--batch": None, "--out": None})
    ['--batch', '8', '--out', 'r']
    """
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if command in _KEY_VALUE or keys:
            flag, eq, value = word.partition("=")
            if word.startswith("--") and flag.replace("_", "-") not in options:
                if not eq and i < len(words) and not words[i].startswith("--"):
                    value, i = words[i], i + 1
                out.append(f"{flag[2:].replace('-', '_')}={value if eq or value else 'true'}")
                continue
        elif "=" in word and not word.startswith("-"):
            key, _, value = word.partition("=")
            flag = "--" + key.replace("_", "-")
            action = options.get(flag)
            if flag in options and action is not None and action.nargs == 0:
                if value.lower() in ("true", "1", "yes"):
                    out.append(flag)
                elif value.lower() not in ("false", "0", "no"):
                    raise UserError(
                        f"{key}={value}: {key} is a switch: give {key}=true or {key}=false"
                    )
                continue
            if flag in options:
                out += [flag, value]
                continue
        action = options.get(word)
        if action is not None and action.nargs is None and i < len(words):
            following = words[i]
            if following.startswith("-") and following not in options:
                # argparse takes a value such as '-5GB' for a flag and says only "expected one
                # argument": passed on as the flag's value, its own check says what is wrong.
                out.append(f"{word}={following}")
                i += 1
                continue
        out.append(word)
    return out


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


class _Prefixed(logging.Formatter):
    """``bigbatch: message``: the library's own lines already start so (for a script with no
    logging set up, where Python prints the bare message); the others get it."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("bigbatch:") else f"bigbatch: {text}"


def _set_up_logging(verbose: bool, quiet: bool) -> None:
    """bigbatch's log lines (logger ``bigbatch``) on stderr, each saying whose it is."""
    log = logging.getLogger("bigbatch")
    # One handler, however often main() runs in a process (a notebook, the tests). The root
    # logger has none unless the caller set one up, so nothing prints twice.
    for old in [h for h in log.handlers if isinstance(h.formatter, _Prefixed)]:
        log.removeHandler(old)
    handler = logging.StreamHandler()
    handler.setFormatter(_Prefixed("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING)


def _tensorboard_without_tensorflow() -> None:
    """TensorBoard's writer (torch's, which MONAI's transforms import too) on TensorBoard's own
    stand-in for TensorFlow, by its switch (a ``tensorboard.compat.notf`` module): where
    TensorFlow is installed (Kaggle's images), the writer imports it for a file-path helper,
    3.6 s and 545 MB of this process here, and TensorFlow prints its log lines. The event
    files are the same; TensorFlow's remote file systems, which run folders never are, are
    lost. The executable's process only: a Python caller's own process is theirs."""
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run one ``bigbatch`` command; ``own_process``: the process runs nothing else and exits
    after it (the ``bigbatch`` executable), so what it loads may be frozen for the collector."""
    if own_process:
        gc.disable()  # loading (the command's module first) makes long-lived objects, no garbage
        _tensorboard_without_tensorflow()
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if w in COMMANDS), None)
    parser = build_parser(load=[command] if command else [])
    if command:
        at = words.index(command) + 1
        try:
            options = _subparser(parser, command)._option_string_actions
            # `bigbatch plan task=... data=...` plans what `bigbatch train` would run.
            keys = command == "plan" and any(w.startswith(("task=", "data=")) for w in words)
            words[at:] = one_style(words[at:], command, options, keys)
        except UserError as exc:
            parser.error(str(exc))
    args, extra = parser.parse_known_args(words)
    _set_up_logging(args.verbose, args.quiet)
    if extra:
        if args.command not in _KEY_VALUE or not all(
            "=" in e and not e.startswith("-") for e in extra
        ):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    args.own_process = own_process
    try:
        module = importlib.import_module(COMMANDS[args.command][0])
    finally:
        if own_process:
            freeze_loaded()
    try:
        return int(module.run(args))
    except (UserError, UserCodeError) as exc:
        message = str(exc)
    except RuntimeError as exc:
        # Out of memory at the smallest micro-batch: its text says what to try. Looked up, not
        # imported, so that the CLI starts without torch.
        backoff = sys.modules.get("bigbatch.backoff")
        if backoff is None or not isinstance(exc, backoff.OutOfMemoryAtMinimumError):
            raise
        message = str(exc)
    except ModuleNotFoundError as exc:
        needed = _EXTRAS.get((exc.name or "").split(".")[0])
        if needed is None:
            raise
        message = (
            f"{exc.name} is not installed: bigbatch {args.command} needs the {needed!r} extra: "
            f"pip install 'bigbatch[{needed}]'"
        )
    except OSError as exc:
        # A full disk or a folder we may not write, found mid-run: one line, no traceback.
        # Files are written atomically, so what was saved before is whole.
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            message = (
                f"no space left on the device while writing {exc.filename or 'a file'}: free some "
                "space, then run the same command again (finished work is kept; bigbatch train "
                "continues with --resume)"
            )
        elif isinstance(exc, PermissionError) or exc.errno in (errno.EROFS, errno.EACCES):
            what = "read-only file system" if exc.errno == errno.EROFS else "permission denied"
            message = f"{what}: {exc.filename or exc}; choose a folder you can write (--out)"
        else:
            raise
    except KeyboardInterrupt:
        # Checkpoints and outputs are written atomically: what was saved is whole.
        message = "interrupted" + (
            "; finished work is kept: `bigbatch train --resume RUN_DIR` continues the run from "
            "its last checkpoint"
            if args.command in ("train", "ensemble", "demo")
            else ""
        )
        print(f"bigbatch {args.command}: {message}", file=sys.stderr)
        return 130
    print(f"bigbatch {args.command}: error: {message}", file=sys.stderr)
    return 2


def console() -> None:
    """The ``bigbatch`` command: :func:`main`, then exit with its code."""
    try:
        code = main(own_process=True)
    except BrokenPipeError:
        # The reader left early (`bigbatch plan --list-cards | head`): no traceback, and
        # nothing more written (the exit's flush would fail again on the closed pipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    if "torch" not in sys.modules:  # --help, a refused argument: nothing heavy to tear down
        sys.exit(code)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # under torchrun
        # On success, a barrier first, so no rank tears the group down while another still uses
        # it (a failed rank just exits: torchrun then stops the others). Then no interpreter
        # teardown: there torch 2.14's gloo aborts a finished rank now and then ("terminate
        # called without an active exception": 2 runs in 20 here without the destroy, still 2
        # in 100 with it), and torchrun reports the whole job failed. Files are closed by now.
        if code == 0:
            dist.barrier()
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _exit_without_teardown(code)


def _exit_without_teardown(code: int) -> None:
    """Exit as the interpreter would (other threads finished, a thread pool's included, atexit
    handlers run: logging's flush, loader workers' shutdown; output flushed), but without
    tearing down every module: with torch, timm and torch._dynamo loaded that took 0.8-0.9 s of
    `bigbatch plan`'s 7.4 s here. Files are closed by now: bigbatch writes each one whole, then
    renames it."""
    import atexit
    import contextlib
    import threading

    # CPython's own first two steps of an exit; elsewhere, the ordinary exit.
    finish_threads = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if finish_threads is None or run_exitfuncs is None:
        sys.exit(code)
    finish_threads()
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe (`bigbatch plan | head -1`): nothing left to keep.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
