"""`make gpu-evidence DRY=1`: every part of the GPU evidence run, on the CPU with tiny
workloads, so that the one command a GPU session runs never rots (benchmarks/gpu_evidence.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1000)  # five parts, each its own processes: about a minute alone
def test_the_dry_run_runs_every_part_and_writes_the_summary(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_evidence.py"), "--dry-run",
         "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    logs = {p.name: p.read_text()[-1500:] for p in (tmp_path / "logs").glob("*.log")}
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], logs)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["parts"]) == {
        "gpu_tests", "cudnn_workspaces", "decode", "memory_matrix", "speed",
    }  # fmt: skip
    assert all(p["state"] == "passed" for p in summary["parts"].values()), summary["parts"]
    matrix = json.loads((tmp_path / "memory_matrix.json").read_text())
    assert matrix["rows_measured"] == matrix["rows_total"] == 2
    for row in matrix["rows"]:  # each row predicted (from the CPU) and measured
        assert row["predicted"]["reserved_mib"] > 0 and row["measured"]["reserved_mib"] > 0
        assert (tmp_path / "traces" / f"{row['name']}.json.gz").exists()
    speed = json.loads((tmp_path / "speed.json").read_text())
    assert {"loaderless", "budget_train", "resnet50_fp16"} <= set(speed)
    assert "ratio_vs_hand_loop" in speed["resnet50_fp16"]
    assert (tmp_path / "tests-gpu.xml").exists() and (tmp_path / "summary.md").exists()
