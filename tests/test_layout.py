"""The house rules of the source tree, checked: the library never imports the command line,
module-top imports form no cycle and never reach up a layer (a lazy import inside a function
says why), a task never reaches into the loop, the formatter is never switched off, and the
loop, the Accumulator and every function stay a readable size."""

from __future__ import annotations

import ast
import re
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
    return _named(tree.body if top_only else list(ast.walk(tree)), modules)


def _named(nodes: list[ast.AST], modules: dict[str, Path]) -> set[str]:
    """The bigbatch modules the import statements among ``nodes`` name."""
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


def _runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every bigbatch module ``path`` imports when it runs, at its top or inside a function
    (not under ``if TYPE_CHECKING:``), with the packages above each: Python imports those first.
    """
    tree = ast.parse(path.read_text())
    hidden = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = _named([n for n in ast.walk(tree) if id(n) not in hidden], modules)
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return (found | parents) & set(modules)


def test_imports_anywhere_have_no_cycle() -> None:
    """Imports inside functions too: a lazy import hides a cycle from the module-top check, and
    runs it later (the task registry once imported the tasks, whose modules import the config
    that imports the registry)."""
    modules = _modules()
    graph = {name: _runtime_imports(path, modules) for name, path in modules.items()}
    graph = {name: deps - {name} for name, deps in graph.items()}
    cycles: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                at = path.index(dep) if dep in path else len(path)
                cycles.append(" -> ".join([*path[at:], name, dep]))
            elif dep not in state:
                visit(dep, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles[:10])


def _layer(module: str) -> int:
    """0: the library (accumulation, memory, verify, integrations, segmentation's parts);
    1: the training command's library (bigbatch.train); 2: the command line."""
    if module.startswith("bigbatch.cli") or module == "bigbatch.__main__":
        return 2
    return 1 if module.startswith("bigbatch.train") else 0


def test_module_top_imports_never_reach_up_a_layer() -> None:
    modules = _modules()
    upward = sorted(
        f"{name} -> {dep}"
        for name, path in modules.items()
        for dep in _imports(path, modules, top_only=True)
        if _layer(dep) > _layer(name)
    )
    assert not upward, f"module-top imports of a higher layer: {upward}"


# The loop's own modules: a task fills in the Task base class and never reaches into these.
LOOP_MODULES = ("loop", "state", "planning", "run_dir", "progress")


def test_tasks_never_import_the_loop() -> None:
    modules = _modules()
    loop = {f"bigbatch.train.{m}" for m in LOOP_MODULES}
    offenders = sorted(
        f"{name} -> {dep}"
        for name, path in modules.items()
        if name.startswith("bigbatch.train.tasks")
        for dep in _imports(path, modules, top_only=False) & loop
    )
    assert not offenders, f"tasks importing the loop's modules: {offenders}"


def test_the_formatter_is_never_switched_off() -> None:
    """Sizes are met by structure, not by ``fmt: off`` blocks that hide the formatted length."""
    marks = ("fmt: off", "fmt: skip", "fmt: on")
    found = [
        f"{path.relative_to(SRC)}:{i}"
        for path in (SRC / "bigbatch").rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if any(f"# {mark}" in line for mark in marks)
    ]
    assert not found, f"formatter switched off at {found}"


# Where a device's kind may be compared by name: device.py (the policy, DeviceKind) and the
# CUDA memory model, whose branches are what differs on CUDA.
DEVICE_NAMED_IN = {"device.py", "memory/predict.py", "memory/measure.py"}


def test_device_kinds_are_asked_of_device_py() -> None:
    """``device.type == "cuda"`` elsewhere is a policy decision made outside the one place that
    knows devices: it asks ``bigbatch.device.device_kind(device)`` instead."""
    compared = re.compile(r'[!=]= "(cuda|mps)"')
    found = [
        f"{path.relative_to(SRC / 'bigbatch')}:{i}"
        for path in (SRC / "bigbatch").rglob("*.py")
        if str(path.relative_to(SRC / "bigbatch")) not in DEVICE_NAMED_IN
        and not path.name.startswith("cuda_")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if compared.search(line)
    ]
    assert not found, f"device kinds compared by name outside bigbatch.device: {found}"


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
