"""The ``bigbatch`` command line: one module per subcommand, assembled by :mod:`.main`."""


class UserError(Exception):
    """Bad input from the command line: printed as one clear line, without a traceback."""
