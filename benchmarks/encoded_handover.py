"""How a window of JPEG bytes reaches the training process under ``decode=gpu``, side by side:
bigbatch's handover (``collate_encoded``: the window's payloads in one flat tensor) against one
tensor per sample (each a shared-memory segment of its own that the training process maps in).
The training process's CPU time per window is what the GPU path has to spare beside decoding
and launching the step; wall time per window is the loader's pace. On the CPU: no GPU needed.

    python benchmarks/encoded_handover.py --json
    python benchmarks/encoded_handover.py --workers 4 --images 2048 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_decode import write_jpegs  # beside this script

from bigbatch.train.data import make_loader
from bigbatch.train.tasks.device_images import EncodedImages, collate_encoded


def per_sample(samples: list[tuple[Any, ...]]) -> tuple[list[torch.Tensor], Any]:
    """The alternative: each sample's payload a tensor of its own in the window."""
    payloads, encoded, sizes, boxes, flips, targets = zip(*samples, strict=True)
    return list(payloads), (list(encoded), sizes, boxes, flips, targets)


def per_window(dataset: EncodedImages, collate: Callable[..., Any], args: Any) -> dict[str, float]:
    """Milliseconds per window, wall and the training process's CPU, over ``args.epochs``
    epochs after one of warm-up (the workers starting)."""
    loader = make_loader(
        dataset, args.batch, shuffle=True, seed=0, num_workers=args.workers, collate_fn=collate
    )
    for _ in loader:
        pass
    windows = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for epoch in range(1, args.epochs + 1):
        loader.batch_sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for _ in loader:
            windows += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_ms": round(1000 * wall / windows, 2), "process_cpu_ms": round(1000 * cpu / windows, 2)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--side", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bigbatch-handover-") as folder:
        files = write_jpegs(Path(folder), args.images, args.side)
        dataset = EncodedImages(files, [0] * len(files))
        # Alternated twice, so that neither runs only while the machine is warming up.
        runs: dict[str, list[dict[str, float]]] = {"one_tensor": [], "per_sample": []}
        for _ in range(2):
            runs["one_tensor"].append(per_window(dataset, collate_encoded, args))
            runs["per_sample"].append(per_window(dataset, per_sample, args))
    best = {k: {m: min(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    result = {
        "workload": f"{args.images} JPEGs of {args.side} px, batch {args.batch}, "
        f"{args.workers} workers",
        "per_window": best,
        "process_cpu_ratio": round(
            best["per_sample"]["process_cpu_ms"] / max(best["one_tensor"]["process_cpu_ms"], 0.01),
            2,
        ),
        "wall_ratio": round(
            best["per_sample"]["wall_ms"] / max(best["one_tensor"]["wall_ms"], 0.01), 2
        ),
    }
    print(json.dumps(result, indent=1) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
