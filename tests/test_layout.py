"""The house rules of the source tree, checked: the library never imports the command line, the
imports made at module top form no cycle (a lazy import inside a function says why), and the
loop, the Accumulator and every function stay a readable size."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "bigbatch").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path], top_only: bool) -> set[str]:
    """The bigbatch modules ``path`` imports (``from pkg import submodule`` counts as the
    submodule)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("bigbatch")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bigbatch"):
            base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return found & set(modules)


def test_the_library_never_imports_the_command_line() -> None:
    modules = _modules()
    offenders = {
        name: sorted(
            i for i in _imports(path, modules, top_only=False) if i.startswith("bigbatch.cli")
        )
        for name, path in modules.items()
        if not name.startswith("bigbatch.cli") and name != "bigbatch.__main__"
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_module_top_imports_have_no_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules, top_only=True) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, name, dep]))
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def _comment_above(lines: list[str], lineno: int) -> bool:
    """A comment on one of the (up to 3) lines above a definition (its decorators aside)."""
    above = [line.strip() for line in lines[max(0, lineno - 4) : lineno - 1]]
    return any(line.startswith("#") for line in above)


def test_sizes_stay_readable() -> None:
    """The loop fits a reader's sitting (< 350 lines), the Accumulator a page (< 300), and no
    function runs over 80 lines without a comment above it saying why."""
    assert len((SRC / "bigbatch/train/loop.py").read_text().splitlines()) < 350
    long = []
    for path in (SRC / "bigbatch").rglob("*.py"):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef) and node.name == "Accumulator":
                assert size < 300, f"Accumulator is {size} lines"
            function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if function and size > 80 and not _comment_above(lines, node.lineno):
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({size})")
    assert not long, f"functions over 80 lines with no comment saying why: {long}"
