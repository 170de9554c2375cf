"""The ``bigbatch`` command line: one module per subcommand, assembled by :mod:`.main`. It
parses and prints; the work is the library's, and nothing in the library imports this package.

Subcommand modules import the heavy parts of the library (timm, PIL, matplotlib, the planner)
inside ``run()``, not at module top, on purpose: ``bigbatch --help`` and ``bigbatch verify``
then start without them.
"""

import argparse
import gc
from typing import Any


class UserError(Exception):
    """Bad input from the command line: printed as one clear line, without a traceback."""


def flags_typed(args: argparse.Namespace, defaults: dict[str, Any]) -> list[str]:
    """The flags among ``defaults``' names that were typed, at any value: their parser's
    default is None (False for a switch), the value that stands for "not given" until
    :func:`fill_defaults` replaces it.

    >>> flags_typed(argparse.Namespace(size="224", packing=False), {"size": "224", "packing": 0})
    ['--size']
    """
    return [
        "--" + dest.replace("_", "-")
        for dest in defaults
        if (value := getattr(args, dest, None)) is not None and value is not False  # 0 is typed
    ]


def fill_defaults(args: argparse.Namespace, *defaults: dict[str, Any]) -> None:
    """Each flag left untyped (None) set to its default, once :func:`flags_typed` has checked
    the flags.

    >>> args = argparse.Namespace(size=None, margin=0.2)
    >>> fill_defaults(args, {"size": "224", "margin": 0.1})
    >>> args.size, args.margin
    ('224', 0.2)
    """
    for table in defaults:
        for dest, default in table.items():
            if getattr(args, dest, None) is None:
                setattr(args, dest, default)


def positive_ints(text: str, flag: str) -> list[int]:
    """A flag's comma-separated positive integers (``--size 128,224``), or a UserError.

    >>> positive_ints("512, 1024", "--seq-len")
    [512, 1024]
    """
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag} takes positive integers, got {text!r}")
    return values


def say_device(name: str) -> None:
    """The device ``--device`` picks (``auto``: a GPU where there is one), on stderr, where the
    command's own line on stdout stays what it wrote."""
    import sys

    from bigbatch.device import describe_device
    from bigbatch.train.runtime import resolve_device

    device = resolve_device(name, "--device")
    print(f"device: {describe_device(device, auto=name == 'auto')}", file=sys.stderr)


def freeze_loaded() -> None:
    """In a process that runs one command: what it has loaded by now (torch, sympy, the
    command's libraries: some 300k objects) lives to the end, so the collector need not scan it
    again, and it may wait for more new objects before it runs. Before this, `bigbatch plan`
    spent 1.1 s of its 6.5 in 1,046 collections (0.94 s in 9 full ones)."""
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)  # from (700, 10, 10): most of those collections found nothing
    gc.enable()


def add_task_options(p: argparse.ArgumentParser) -> None:
    """Each registered task's own prediction options (``predict_options`` in its registry
    entry), as flags: ``--patch`` for a segmentation run, say. Their default is None here, so
    that only what the user set reaches the task, which refuses what it does not take."""
    from dataclasses import fields

    from bigbatch.train.registry import task_entry, task_names

    seen: dict[str, list[str]] = {}
    for name in task_names():
        try:
            kind = task_entry(name).predict_options_class()
        except (KeyError, ValueError):
            continue  # a plug-in that does not load: said when its run is predicted
        for f in fields(kind) if kind is not None else ():
            seen.setdefault(f.name, [])
            if not seen[f.name]:
                p.add_argument(
                    "--" + f.name.replace("_", "-"),
                    dest=f"task_option_{f.name}",
                    metavar=f.name.upper(),
                    type=type(f.default),
                    default=None,
                    help=task_help(name, f.metadata["help"]),
                )
            seen[f.name].append(name)


def task_help(task: str, text: str) -> str:
    """An option's help said to be ``task``'s, once (a plug-in's own help may name it already).

    >>> task_help("tags", "tags: the threshold")
    'tags: the threshold'
    """
    return text if text.startswith(f"{task}:") else f"{task}: {text}"


def task_options(args: argparse.Namespace) -> dict[str, Any]:
    """The task options (:func:`add_task_options`) the user set, by name."""
    prefix = "task_option_"
    return {
        k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None
    }
