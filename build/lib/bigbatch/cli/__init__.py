"""The ``bigbatch`` command line: one module per subcommand, assembled by :mod:`.main`. It
parses and prints; the work is the library's, and nothing in the library imports this package.

Subcommand modules import the heavy parts of the library (timm, PIL, matplotlib, the planner)
inside ``run()``, not at module top, on purpose: ``bigbatch --help`` and ``bigbatch verify``
then start without them.
"""


class UserError(Exception):
    """Bad input from the command line: printed as one clear line, without a traceback."""
