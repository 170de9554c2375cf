"""Adapters that bring exact accumulation into the training loops of other frameworks.

Each module imports its framework only when it is imported itself, and says which extra to
install when the framework is missing:

- :mod:`bigbatch.integrations.lightning`: ``pip install 'bigbatch[lightning]'``
- :mod:`bigbatch.integrations.fastai`: ``pip install 'bigbatch[fastai]'``
- :mod:`bigbatch.integrations.keras`: ``pip install 'bigbatch[keras]'`` (torch backend),
  ``'bigbatch[keras-tensorflow-cpu]'``, ``'bigbatch[keras-tensorflow]'`` or ``'bigbatch[keras-jax]'``
- :mod:`bigbatch.integrations.hf`: ``pip install 'bigbatch[hf]'``
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that names the extra to install.

    >>> require("torch", "core").__name__
    'torch'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"bigbatch.integrations.{extra} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'bigbatch[{extra}]'"
        ) from exc
