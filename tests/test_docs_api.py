"""The API reference (docs/api.md) holds every name the guides tell a user to import, and each
of its entries has an example: run as a doctest (``>>>``), or a code block (``::``) where it
needs a GPU, a trained model or a framework's whole loop."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"


def reference() -> list[str]:
    return re.findall(r"^::: ([\w.]+)", API.read_text(), re.M)


def imported_in_guides() -> set[str]:
    """``from bigbatch... import a, b`` in the guides, the README and the examples."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.py")]
    names = set()
    for path in files:
        if path.name in ("api.md", "changelog.md"):
            continue
        for module, listed in re.findall(
            r"from (bigbatch[\w.]*) import ([\w, ]+)", path.read_text()
        ):
            names |= {f"{module}.{name.strip()}" for name in listed.split(",") if name.strip()}
    return names


def test_every_name_the_guides_import_is_in_the_reference() -> None:
    documented = {entry.rsplit(".", 1)[1] for entry in reference()}
    missing = []
    for full in sorted(imported_in_guides()):
        module, name = full.rsplit(".", 1)
        if name in documented or inspect.ismodule(getattr(importlib.import_module(module), name)):
            continue
        missing.append(full)
    assert not missing, f"add to docs/api.md (`::: {missing[0]}`): {missing}"


@pytest.mark.parametrize("entry", reference())
def test_each_entry_has_an_example(entry: str) -> None:
    module, name = entry.rsplit(".", 1)
    doc = inspect.getdoc(getattr(importlib.import_module(module), name)) or ""
    assert ">>>" in doc or "::\n" in doc, f"{entry}: its docstring has no example"
