"""Load the user's own objects named as ``module:attribute`` or ``path/to/file.py:attribute``
(``model=``, ``--model``, ``--data``, ``--loss``): the library and the command line share it."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["UserCodeError", "call_factory", "load_callable", "load_object"]


class UserCodeError(ValueError):
    """The user's ``module:attribute`` could not be loaded or called; the message has the fix."""


def load_object(spec: str, what: str) -> Any:
    """Import ``spec`` (``pkg.module:name`` or ``file.py:name``); errors say how to fix it.

    >>> load_object("math:pi", "--loss") > 3
    True
    """
    if ":" not in spec:
        raise UserCodeError(
            f"{what} must look like module:name or path/to/file.py:name, got {spec!r}"
        )
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise UserCodeError(f"{what}: no such file {path}")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            if mod_spec is None or mod_spec.loader is None:
                raise UserCodeError(f"{what}: cannot import {path}")
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")  # let `module:name` find modules in the working directory
            module = importlib.import_module(module_name)
    except UserCodeError:
        raise
    except Exception as exc:  # the user's module failed to import: say where, not a traceback
        raise UserCodeError(
            f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise UserCodeError(
            f"{what}: {module_name!r} has no {attr!r}; it has: {', '.join(names[:15])}"
        )
    return getattr(module, attr)


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """:func:`load_object`, which must be callable (a factory)."""
    factory = load_object(spec, what)
    if not callable(factory):
        raise UserCodeError(f"{what}: {spec!r} is not callable; name a function that builds it")
    return factory


def call_factory(spec: str, what: str) -> Any:
    """Load ``spec`` and call it with no arguments; a factory that raises becomes a UserCodeError."""
    factory = load_callable(spec, what)
    try:
        return factory()
    except Exception as exc:
        raise UserCodeError(f"{what}: {spec}() raised {type(exc).__name__}: {exc}") from exc
