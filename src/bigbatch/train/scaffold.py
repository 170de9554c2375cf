"""``bigbatch new-task NAME``: a plug-in package to start a task from, written in a folder.

The package is a complete small task (multi-label image tagging from a CSV of ``image,tags``)
with its ``pyproject.toml`` entry point in the group ``bigbatch.tasks``, its task subclass with
the hooks a task fills in, and a test that trains it for one epoch: it installs and passes that
test as written, and its author changes it to their data. The files are templates shipped in
``bigbatch/data/task_template`` (``*.tmpl``), the task's name put in where they say
``@@name@@``, its class name for ``@@Class@@``, its import package for ``@@package@@`` and its
distribution for ``@@dist@@``.
"""

from __future__ import annotations

import keyword
import re
from importlib import resources
from pathlib import Path

from bigbatch.io import atomic_write_text

__all__ = ["TaskPackage", "task_package", "write_task_package"]

_NAME = re.compile(r"[a-z][a-z0-9_]*")


class TaskPackage:
    """The names a new task's package uses, from the task's name.

    >>> p = TaskPackage("tags")
    >>> (p.name, p.class_name, p.package, p.dist)
    ('tags', 'TagsTask', 'bigbatch_tags', 'bigbatch-tags')
    """

    def __init__(self, name: str) -> None:
        if not _NAME.fullmatch(name) or keyword.iskeyword(name):
            raise ValueError(
                f"{name!r} is not a task name: use lower-case letters, digits and _, starting "
                "with a letter (it is the task= users type and part of a Python package's name)"
            )
        self.name = name
        self.class_name = "".join(part.capitalize() for part in name.split("_")) + "Task"
        self.package = f"bigbatch_{name}"
        self.dist = f"bigbatch-{name.replace('_', '-')}"

    def fill(self, text: str) -> str:
        """A template's text with this package's names put in."""
        for token, value in (
            ("@@name@@", self.name),
            ("@@Class@@", self.class_name),
            ("@@package@@", self.package),
            ("@@dist@@", self.dist),
        ):
            text = text.replace(token, value)
        return text


def task_package(name: str) -> dict[str, str]:
    """The new package's files, by their path inside its folder, as ``new-task`` writes them.

    >>> files = task_package("tags")
    >>> sorted(files)[:3]
    ['README.md', 'pyproject.toml', 'src/bigbatch_tags/__init__.py']
    >>> 'tags = "bigbatch_tags:ENTRY"' in files["pyproject.toml"]
    True
    """
    package = TaskPackage(name)
    root = resources.files("bigbatch") / "data" / "task_template"
    files: dict[str, str] = {}

    def walk(folder: object, prefix: str) -> None:
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):  # type: ignore[attr-defined]
            path = f"{prefix}{package.fill(entry.name)}"
            if entry.is_dir():
                walk(entry, f"{path}/")
            elif entry.name.endswith(".tmpl"):
                files[path.removesuffix(".tmpl")] = package.fill(entry.read_text())

    walk(root, "")
    return files


def write_task_package(name: str, where: str | Path = ".") -> Path:
    """Write the package of task ``name`` as the folder ``where/bigbatch-NAME`` (refused where
    that folder exists: nothing of the author's is overwritten); returns the folder.

    >>> import tempfile
    >>> folder = write_task_package("tags", tempfile.mkdtemp())
    >>> (folder.name, (folder / "src" / "bigbatch_tags" / "task.py").is_file())
    ('bigbatch-tags', True)
    """
    from bigbatch.train.registry import task_names

    package = TaskPackage(name)
    if name in task_names():
        raise ValueError(
            f"task {name!r} exists here already (a built-in task or an installed plug-in): "
            "choose another name; a plug-in may not share a task's name"
        )
    folder = Path(where) / package.dist
    if folder.exists():
        raise FileExistsError(
            f"{folder} exists: choose another name, or another folder with --out (nothing "
            "there is overwritten)"
        )
    for path, text in task_package(name).items():
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, text)
    return folder
