"""A framework that is not installed gives an ImportError naming the extra to install."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize(
    ("adapter", "framework", "extra"),
    [
        ("lightning", "lightning", "lightning"),
        ("fastai", "fastai", "fastai"),
        ("keras", "keras", "keras"),
        ("hf", "transformers", "hf"),
    ],
)
def test_missing_framework_names_the_extra(
    adapter: str, framework: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes `import framework` raise ImportError, as if not installed.
    for name in list(sys.modules):
        if name == framework or name.startswith(framework + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)
    monkeypatch.delitem(sys.modules, f"bigbatch.integrations.{adapter}", raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'bigbatch\[{extra}\]'"):
        importlib.import_module(f"bigbatch.integrations.{adapter}")
