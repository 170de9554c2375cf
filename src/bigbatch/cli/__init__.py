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
    again. Before this, `bigbatch plan` made 9 full collections that took 0.94 s of its 6.5."""
    gc.freeze()
    gc.enable()
