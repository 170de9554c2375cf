"""bigbatch's two ways of feeding training images to a GPU, side by side: CPU loader workers
(PIL decoding and timm's train transform, ``decode=cpu``) against decoding and augmenting on the
GPU (``decode=gpu``: the workers read bytes and draw the crops, nvJPEG decodes, the crops and
flips run on the GPU). The same random resized crop and flip, drawn from the same seeds; images
per second delivered to the GPU as a normalised float batch, and the ratio.

    python benchmarks/gpu_decode.py --json                 # on an NVIDIA GPU
    python benchmarks/gpu_decode.py --side 512 --workers 4 --json
    python benchmarks/gpu_decode.py --dry-run --json       # no GPU: tiny, both paths on the CPU

``bigbatch train`` makes this choice itself with ``decode=auto``, from its own first epoch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bigbatch.device import synchronize
from bigbatch.train.data import make_loader
from bigbatch.train.tasks.device_images import DeviceAugment, EncodedImages, collate_encoded
from bigbatch.train.tasks.images import DEFAULT_DATA, ImageDataset, build_transforms


def write_jpegs(folder: Path, n: int, side: int) -> list[Path]:
    rng = np.random.default_rng(0)
    files = []
    for k in range(n):
        pixels = rng.integers(0, 255, (side // 8, side // 8, 3), dtype=np.uint8)
        files.append(folder / f"{k}.jpg")
        Image.fromarray(pixels).resize((side, side), Image.BILINEAR).save(files[-1], quality=90)
    return files


def rate(batches: Callable[[int], Iterable[Any]], device: torch.device, epochs: int, n: int) -> float:  # fmt: skip
    """Images/s over ``epochs`` epochs after one of warm-up (workers starting, nvJPEG's handles)."""
    for x, _ in batches(0):
        x.to(device, non_blocking=True)
    synchronize(device)
    t0 = time.perf_counter()
    for e in range(1, epochs + 1):
        for x, _ in batches(e):
            x.to(device, non_blocking=True)
    synchronize(device)
    return epochs * n / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--side", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    if args.dry_run:
        args.images, args.side, args.size, args.batch, args.workers, args.epochs = 16, 64, 32, 8, 0, 1  # fmt: skip
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: run on an NVIDIA GPU, or --dry-run", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bigbatch-decode-") as folder:
        files = write_jpegs(Path(folder), args.images, args.side)
        labels = [0] * len(files)
        transform = build_transforms(args.size, "squish", train=True, augment=True)
        on_cpu = ImageDataset(files, labels, transform)
        on_gpu = EncodedImages(files, labels)
        augment = DeviceAugment(args.size, 3, DEFAULT_DATA["interpolation"]).on(device)
        common = {"shuffle": True, "seed": 0, "num_workers": args.workers}
        cpu_loader = make_loader(on_cpu, args.batch, pin_memory=not args.dry_run, **common)
        gpu_loader = make_loader(on_gpu, args.batch, collate_fn=collate_encoded, **common)

        def cpu_batches(e: int) -> Iterable[Any]:
            cpu_loader.batch_sampler.set_epoch(e)  # type: ignore[attr-defined]
            return cpu_loader

        def gpu_batches(e: int) -> Iterable[Any]:
            gpu_loader.batch_sampler.set_epoch(e)  # type: ignore[attr-defined]
            return (augment(batch) for batch in gpu_loader)

        result: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0) if not args.dry_run else "cpu (dry run)",
            "workload": f"{args.images} JPEGs of {args.side} px, crop {args.size}, batch {args.batch}",
            "cpu_workers": args.workers,
            "images_per_s": {
                "cpu_workers": round(rate(cpu_batches, device, args.epochs, len(files)), 1),
                "gpu_decode": round(rate(gpu_batches, device, args.epochs, len(files)), 1),
            },
        }
        ips = result["images_per_s"]
        result["gpu_over_cpu"] = round(ips["gpu_decode"] / ips["cpu_workers"], 3)
        print(json.dumps(result, indent=1) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
