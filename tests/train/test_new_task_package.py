"""``bigbatch new-task NAME`` writes a plug-in package that installs (pip, as its author would:
a wheel built from its pyproject.toml, the entry point in its metadata) and passes its own test
as written; installed, its task goes through every command like a built-in one. The package is
the plug-in guide's example (docs/plugins.md shows these very files)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import bigbatch.train.registry as registry
from bigbatch.cli.main import main


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bigbatch new-task tags`` in a fresh folder, then pip-installed into ``site/`` beside
    it (not into the test environment: other tests must not see a ``tags`` task)."""
    where = tmp_path_factory.mktemp("author")
    assert main(["new-task", "tags", "--out", str(where)]) == 0
    folder = where / "bigbatch-tags"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip, "--target", str(where / "site"), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return folder


@pytest.fixture
def installed(package: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(package.parent / "site"))
    monkeypatch.setattr(registry, "_LOADED", {})
    registry._entry_points.cache_clear()
    yield package
    registry._entry_points.cache_clear()
    for name in [m for m in sys.modules if m.startswith("bigbatch_tags")]:
        del sys.modules[name]


@pytest.mark.slow
def test_the_written_package_passes_its_own_test_as_written(package: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(package.parent / "site")}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    done = subprocess.run(argv, cwd=package, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout


def _data(package: Path, where: Path) -> Path:
    """The generated test's own data writer (images tagged by their bright channels)."""
    spec = importlib.util.spec_from_file_location("tags_test", package / "tests" / "test_tags.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Path(module.write_data(where))


@pytest.mark.slow
def test_the_installed_task_goes_through_every_command(
    installed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv = _data(installed, tmp_path / "data")
    keys = [f"data={csv}", "arch=test_resnet", "size=32", "batch=8", "device=cpu"]
    train = [
        "train",
        "task=tags",
        *keys,
        "num_workers=0",
        "epochs=2",
        "monitor=f2",
        "--no-progress",
    ]
    assert main([*train, "--out", str(tmp_path / "a")]) == 0
    assert main([*train, "seed=1", "--out", str(tmp_path / "b")]) == 0
    info = json.loads((tmp_path / "a" / "task.json").read_text())
    assert info["task"] == "tags" and info["package"] == "bigbatch-tags"
    history = (tmp_path / "a" / "history.csv").read_text().splitlines()
    assert "f2" in history[0] and len(history) == 3
    capsys.readouterr()
    assert main(["plan", "task=tags", *keys, "budget=1GB", "overhead=0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["task"] == "tags"
    assert main(["predict", str(tmp_path / "a"), str(csv.parent)]) == 0
    rows = (tmp_path / "a" / "submission.csv").read_text().splitlines()
    assert rows[0] == "image,tags" and len(rows) == 1 + 24
    out = tmp_path / "ens"
    argv = ["ensemble", str(tmp_path / "a"), str(tmp_path / "b"), "--images", str(csv.parent)]
    assert main([*argv, "--out", str(out)]) == 0
    assert "2 runs averaged over 24 images" in capsys.readouterr().out
    assert (out / "submission.csv").is_file() and (out / "submission.npz").is_file()
    # Resumed after a kill past its last checkpoint, with a key: nothing redone.
    (tmp_path / "a" / "done.json").unlink()
    assert main(["train", "--resume", str(tmp_path / "a"), "num_workers=0"]) == 0
    assert len((tmp_path / "a" / "history.csv").read_text().splitlines()) == 3


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("regression", "task 'regression' exists here already"),
        ("Tags!", "'Tags!' is not a task name"),
        ("class", "'class' is not a task name"),
    ],
)
def test_new_task_refuses_a_name_it_cannot_use(
    name: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["new-task", name, "--out", str(tmp_path)]) == 2
    assert said in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_new_task_overwrites_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bigbatch-tags").mkdir()
    (tmp_path / "bigbatch-tags" / "mine.py").write_text("# the author's")
    assert main(["new-task", "tags", "--out", str(tmp_path)]) == 2
    assert "exists: choose another name" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "bigbatch-tags").iterdir()] == ["mine.py"]
