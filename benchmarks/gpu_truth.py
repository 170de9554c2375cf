"""bigbatch's CUDA predictions, made on this machine (no GPU), against the real allocator traces
recorded on an H100 (tests/memory/data/gpu_truth): allocated, reserved and process peaks.

    python benchmarks/gpu_truth.py            # the table
    python benchmarks/gpu_truth.py --json

Process memory is the plan's need (reserved, and the handles outside the allocator) plus the
default context (bigbatch.memory.cuda_runtime.CUDA_CONTEXT_BYTES); the measured one is the
device's used memory after the two recorded steps.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_matrix import ranks_of
from gpu_matrix import spec_of as matrix_spec

from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec

DATA = Path(__file__).parents[1] / "tests" / "memory" / "data" / "gpu_truth"
MiB = 2**20


def load(name: str) -> dict[str, Any]:
    """A trace by its name: its path under the data folder, without ``.json.gz``."""
    with gzip.open(DATA / f"{name}.json.gz") as f:
        return json.load(f)


def names() -> list[str]:
    """Every recorded trace (the H100's at the top, later cards' in a folder each)."""
    return sorted(
        str(p.relative_to(DATA)).removesuffix(".json.gz") for p in DATA.rglob("*.json.gz")
    )


def spec_of(truth: dict[str, Any]) -> StepSpec:
    """The recorded workload as a StepSpec for a CUDA target (benchmarks/gpu_matrix.py)."""
    return matrix_spec(truth, "cuda")


def row(name: str) -> dict[str, Any]:
    truth = load(name)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ranks_of(truth):
            p = predict_peak(spec_of(truth))
    process = truth["process_used_mib_by_stage"]["after_two_steps"] * MiB
    predicted_process = p.planning_bytes + CUDA_CONTEXT_BYTES

    def pair(predicted: int, measured: float) -> dict[str, float]:
        return {
            "predicted_mib": round(predicted / MiB, 1),
            "measured_mib": round(measured / MiB, 1),
            "error_pct": round(100 * (predicted - measured) / measured, 1),
        }

    return {
        "workload": name,
        "allocated": pair(p.allocated_bytes, truth["max_allocated_bytes"]),
        "reserved": pair(p.reserved_bytes, truth["max_reserved_bytes"]),
        "process": pair(predicted_process, process),
        "breakdown_mib": {k: round(v / MiB, 1) for k, v in p.parts().items()},
        "predict_seconds": round(time.perf_counter() - t0, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", default="", help="workload names, comma-separated")
    args = p.parse_args()
    all_names = names()
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(all_names))
        if unknown:
            p.error(
                f"--only {','.join(unknown)}: no such trace; choose from {', '.join(all_names)}"
            )
        all_names = [n for n in all_names if n in args.only.split(",")]
    rows = [row(n) for n in all_names]
    if args.json:
        print(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
        return
    print("| workload | allocated | reserved | process |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        cells = [
            f"{r[k]['predicted_mib']:,.0f} / {r[k]['measured_mib']:,.0f} ({r[k]['error_pct']:+.1f} %)"
            for k in ("allocated", "reserved", "process")
        ]
        print(f"| {r['workload']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
