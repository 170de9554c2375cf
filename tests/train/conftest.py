"""The image-folder and tiny-model fixtures of the training tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tiny_runs import TINY_MODEL, write_images


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    write_images(tmp_path / "train")
    return tmp_path / "train"


@pytest.fixture
def tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "tinymodel.py").write_text(TINY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tinymodel", None)
    return "tinymodel:tiny"
