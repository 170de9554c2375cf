"""Every example and benchmark runs as a user would run it (small sizes where it has flags).
The GPU evidence's dry run (tests/test_gpu_evidence.py) runs the ones it is made of as a user
runs them: checkpoint_stall.py, train_throughput.py and the rest, each checked there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
@pytest.mark.slow
def test_example_runs(path: Path) -> None:
    out = _run(str(path))
    assert out.strip()
    if path.name == "05_resume.py":
        assert "bit-identical: True" in out


@pytest.mark.slow
def test_digits_demo_shows_equal_weights() -> None:
    out = _run("examples/demo_digits.py")
    assert "EQUAL (float64 round-off)" in out
    assert "DIFFERENT" in out  # the naive run, side by side


@pytest.mark.slow
def test_overhead_benchmark_json() -> None:
    result = json.loads(
        _run("benchmarks/overhead.py", "--samples", "512", "--rounds", "1", "--json")
    )
    assert result["ratio_vs_hand"] > 0


@pytest.mark.slow
def test_ddp_benchmark_json() -> None:
    out = _run("benchmarks/ddp.py", "--width", "256", "--accum", "4", "--rounds", "1", "--json")
    result = json.loads(out[out.index("{") :])
    counts = result["allreduces_per_window"]
    assert counts["bigbatch_sync_step"] < counts["ddp_every_micro_batch"]


@pytest.mark.slow
def test_integrations_benchmark_json() -> None:
    out = _run("benchmarks/integrations.py", "--batches", "8", "--rounds", "1", "--json")
    rows = json.loads(out[out.index("{") :])["rows"]
    assert set(rows) == {"lightning", "fastai", "keras", "keras-tensorflow", "keras-jax", "hf"}
    assert all(row["ratio"] > 0 for row in rows.values())


@pytest.mark.slow
def test_coupled_benchmark_json() -> None:
    # Activations (batch x width x depth) outweigh the weights and the 512 x 512 similarities.
    out = _run(
        "benchmarks/coupled.py", "--batch", "512", "--micro", "64", "--width", "512", "--depth",
        "6", "--dim", "128", "--rounds", "1", "--json",
    )  # fmt: skip
    result = json.loads(out)
    assert result["peak_bytes"]["cached"] < result["peak_bytes"]["big_batch"]
    assert result["time_ratio_vs_plain_accumulation"] > 0


@pytest.mark.slow
def test_memory_accuracy_benchmark_json() -> None:
    # The LSTM is the case fake tensors alone get most wrong (its oneDNN workspace).
    out = _run(
        "benchmarks/memory_accuracy.py", "--models", "mlp,lstm", "--batches", "1,16", "--json"
    )
    result = json.loads(out[out.index("{") :])
    assert len(result["rows"]) == 4
    assert result["worst_abs_err_pct"] <= 5 < result["uncalibrated_worst_abs_err_pct"]
    assert result["max_predict_seconds"] > 0


@pytest.mark.slow
def test_vs_fastai_benchmark_json() -> None:
    out = _run(
        "benchmarks/vs_fastai.py", "--per-class", "10", "--epochs", "1", "--rounds", "1", "--json"
    )
    result = json.loads(out[out.index("{") :])
    assert result["time_ratio_vs_fastai"] > 0 and 0 <= result["accuracy_fastai"] <= 1
    assert 0 <= result["accuracy_bigbatch"] <= 1


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_cpu_heap_benchmark_json() -> None:
    out = _run(
        "benchmarks/cpu_heap.py", "--models", "gpt", "--micro", "4", "--steps", "3", "--json"
    )
    (row,) = json.loads(out[out.index("[") :])
    assert row["model"] == "gpt" and row["speed_ratio_returned"] > 0
    assert row["hwm_mib_default"] > 0 and row["hwm_mib_returned"] > 0


@pytest.mark.slow
def test_plan_time_benchmark_json() -> None:
    out = _run("benchmarks/plan_time.py", "--models", "resnet10t:32", "--rounds", "1", "--json")
    result = json.loads(out[out.index("{") :])
    assert set(result) == {"imports", "resnet10t@32"}
    # Both are wall times of separate processes: under load either can be the longer one.
    assert result["resnet10t@32"]["seconds"] > 0 and result["imports"]["seconds"] > 0


@pytest.mark.slow
def test_fsdp_ranks_benchmark_json() -> None:
    out = _run("benchmarks/fsdp_ranks.py", "--layers", "2", "--hidden", "128", "--json")
    result = json.loads(out[out.index("{") :])
    assert len(result["gloo_per_rank_bytes"]) == 2
    assert abs(result["traced_over_fake_group"] - 1) <= 0.01, result


@pytest.mark.slow
def test_gpu_truth_benchmark_json() -> None:
    out = _run("benchmarks/gpu_truth.py", "--only", "resnet18-128-b8-fp16-adamw", "--json")
    (row,) = json.loads(out[out.index("{") :])["rows"]
    assert abs(row["reserved"]["error_pct"]) <= 5 and row["breakdown_mib"]["blas_workspaces"] == 64
