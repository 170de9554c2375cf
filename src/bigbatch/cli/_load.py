"""Load the user's own objects named as ``module:attribute`` or ``path/to/file.py:attribute``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigbatch.cli import UserError


def load_object(spec: str, what: str) -> Any:
    """Import ``spec`` (``pkg.module:name`` or ``file.py:name``); errors say how to fix it."""
    if ":" not in spec:
        raise UserError(f"{what} must look like module:name or path/to/file.py:name, got {spec!r}")
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise UserError(f"{what}: no such file {path}")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            if mod_spec is None or mod_spec.loader is None:
                raise UserError(f"{what}: cannot import {path}")
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")  # let `module:name` find modules in the working directory
            module = importlib.import_module(module_name)
    except UserError:
        raise
    except Exception as exc:  # the user's module failed to import: say where, not a traceback
        raise UserError(
            f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise UserError(f"{what}: {module_name!r} has no {attr!r}; it has: {', '.join(names[:15])}")
    return getattr(module, attr)


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """:func:`load_object`, which must be callable (a factory)."""
    factory = load_object(spec, what)
    if not callable(factory):
        raise UserError(f"{what}: {spec!r} is not callable; name a function that builds it")
    return factory


def call_factory(spec: str, what: str) -> Any:
    """Load ``spec`` and call it with no arguments; a factory that raises becomes a UserError."""
    factory = load_callable(spec, what)
    try:
        return factory()
    except Exception as exc:
        raise UserError(f"{what}: {spec}() raised {type(exc).__name__}: {exc}") from exc
