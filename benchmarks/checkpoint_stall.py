"""How long an epoch's checkpoints stop training: written on the training thread, or copied to
host memory there and written on the writer's thread (what `bigbatch train` does).

Both write the same files each round, atomically with fsync: ``best.safetensors`` and
``last.safetensors`` (the weights) and ``last.pt`` (the weights and AdamW's state). On the
training thread, safetensors and torch.save read the live tensors (the previous way); with the
writer, the training thread only takes ``host_copy`` and hands the writes over. Rounds
alternate; ``stall_ratio`` is the median of inline / background seconds the training thread was
held, ``written_seconds`` how long the background writes took to finish after the hand-over.

    python benchmarks/checkpoint_stall.py --json                     # resnet50, CPU
    python benchmarks/checkpoint_stall.py --device cuda --json       # the weights on the GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bigbatch.io import BackgroundWriter, atomic_path
from bigbatch.train.checkpoint import host_copy, save_state, write_weights


def inline(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: Path) -> None:
    """The files from the live tensors, on the training thread."""
    from safetensors.torch import save_model

    for name in ("best", "last"):
        with atomic_path(folder / f"{name}.safetensors") as tmp:
            save_model(model, str(tmp))
    save_state({"model": model.state_dict(), "optimizer": opt.state_dict()}, folder / "last.pt")


def handed_over(
    model: torch.nn.Module, opt: torch.optim.Optimizer, folder: Path, files: BackgroundWriter
) -> None:
    """A host copy on the training thread; the same files written on the writer's."""
    state = host_copy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for name in ("best", "last"):
        files.submit(write_weights, state["model"], folder / f"{name}.safetensors")
    files.submit(save_state, state, folder / "last.pt")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run on an NVIDIA GPU, or --device cpu", file=sys.stderr)
        return 2
    import timm

    model = timm.create_model(args.arch).to(args.device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3, 64, 64, device=args.device)).sum().backward()
    opt.step()  # AdamW's state exists, as at any epoch's end
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    stalls: dict[str, list[float]] = {"inline": [], "background": []}
    written: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, BackgroundWriter() as files:
        folder = Path(tmp)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            inline(model, opt, folder)
            stalls["inline"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            handed_over(model, opt, folder, files)
            stalls["background"].append(time.perf_counter() - t0)
            files.wait()  # the next round starts with no write in flight
            written.append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in stalls.items()}
    result: dict[str, Any] = {
        "workload": f"{args.arch} weights ({nbytes / 2**20:.0f} MiB) and AdamW state on "
        f"{args.device}: best and last .safetensors, last.pt, fsync'd",
        "rounds": args.rounds,
        "stall_seconds": {k: round(v, 4) for k, v in median.items()},
        "written_seconds": round(statistics.median(written), 4),
        "stall_ratio": round(median["inline"] / max(median["background"], 1e-9), 2),
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(
            f"{result['workload']}: the training thread held {median['inline']:.3f} s inline, "
            f"{median['background']:.3f} s handing over ({result['stall_ratio']}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
