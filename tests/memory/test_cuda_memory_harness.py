"""benchmarks/cuda_memory.py runs on a GPU; CI has none, so its dry run keeps it working: tiny
workloads, a CUDA target predicted, the CPU step measured, the JSON written atomically."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "cuda_memory.py"


@pytest.mark.slow
def test_the_cuda_memory_benchmark_dry_run_writes_its_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--only", "resnet10t-32", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = tmp_path.glob("*.json")
    report = json.loads(result.read_text())
    assert report["dry_run"] is True
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    for r in rows:
        assert r["predicted_reserved_mib"] > 0 and r["measured_reserved_mib"] > 0
        assert r["predicted_reserved_mib"] >= r["predicted_allocated_mib"]
    assert "resnet10t-32" in report["slopes_mib_per_sample"]
    assert "| resnet10t-32 | 2 | fp32 |" in done.stdout


def test_without_a_gpu_the_benchmark_says_how_to_run_it() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "--dry-run" in done.stderr and len(done.stderr.strip().splitlines()) == 1
