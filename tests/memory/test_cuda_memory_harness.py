"""benchmarks/cuda_memory.py runs on a GPU; CI has none, so its dry run keeps it working: tiny
workloads, a CUDA target predicted, the CPU step measured, the JSON written atomically."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "cuda_memory.py"


def run(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """The benchmark's main() with these arguments, in this process (no second torch import)."""
    spec = importlib.util.spec_from_file_location("cuda_memory", SCRIPT)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "cuda_memory", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    return int(module.main())


@pytest.mark.slow
def test_the_cuda_memory_benchmark_dry_run_writes_its_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(monkeypatch, "--dry-run", "--only", "resnet10t-32", "--out", str(tmp_path)) == 0
    out = capsys.readouterr().out
    (result,) = tmp_path.glob("*.json")
    report = json.loads(result.read_text())
    assert report["dry_run"] is True
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    for r in rows:
        assert r["predicted_reserved_mib"] > 0 and r["measured_reserved_mib"] > 0
        assert r["predicted_reserved_mib"] >= r["predicted_allocated_mib"]
    assert "resnet10t-32" in report["slopes_mib_per_sample"]
    assert "| resnet10t-32 | 2 | fp32 |" in out


def test_without_a_gpu_the_benchmark_says_how_to_run_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert run(monkeypatch) == 2
    err = capsys.readouterr().err
    assert "--dry-run" in err and len(err.strip().splitlines()) == 1


def test_an_unknown_workload_names_the_choices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(monkeypatch, "--dry-run", "--only", "resnet99", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "resnet10t-32" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.json"))
