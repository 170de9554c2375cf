"""The ``bigbatch`` command line: one module per subcommand, assembled by :mod:`.main`. It
parses and prints; the work is the library's, and nothing in the library imports this package.

Subcommand modules import the heavy parts of the library (timm, PIL, matplotlib, the planner)
inside ``run()``, not at module top, on purpose: ``bigbatch --help`` and ``bigbatch verify``
then start without them.
"""

import gc


class UserError(Exception):
    """Bad input from the command line: printed as one clear line, without a traceback."""


def freeze_loaded() -> None:
    """In a process that runs one command: what it has loaded by now (torch, sympy, the
    command's libraries: some 300k objects) lives to the end, so the collector need not scan it
    again, and it may wait for more new objects before it runs. Before this, `bigbatch plan`
    spent 1.1 s of its 6.5 in 1,046 collections (0.94 s in 9 full ones)."""
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)  # from (700, 10, 10): most of those collections found nothing
    gc.enable()
