"""JPEG decoding and augmentation on the GPU against CPU loader workers, the same augmentations
(a random resized crop to 224 px and a horizontal flip), images per second delivered to the GPU
as a float batch.

    python benchmarks/gpu_decode.py --json            # on an NVIDIA GPU
    python benchmarks/gpu_decode.py --dry-run --json  # no GPU: tiny, both paths on the CPU

CPU path: a DataLoader with ``--workers`` persistent, pinned workers decoding with PIL and
transforming with torchvision's v2 transforms. GPU path: torchvision's ``decode_jpeg`` on the
device (nvJPEG) over a batch of encoded files read in the main process, then the same
transforms on the device, image by image.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from typing import Any

import numpy as np
import torch
from PIL import Image


def make_jpegs(n: int, side: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        pixels = rng.integers(0, 255, (side // 8, side // 8, 3), dtype=np.uint8)
        img = Image.fromarray(pixels).resize((side, side), Image.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def augment(size: int) -> Any:
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])


class Files(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, blobs: list[bytes], size: int) -> None:
        from torchvision.transforms import v2

        self.blobs, self.aug = blobs, augment(size)
        self.to_tensor = v2.Compose([v2.PILToTensor()])

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> torch.Tensor:
        img = Image.open(io.BytesIO(self.blobs[i])).convert("RGB")
        return self.aug(self.to_tensor(img))


def cpu_workers(blobs: list[bytes], size: int, batch: int, workers: int, device: str, epochs: int) -> float:  # fmt: skip
    loader = torch.utils.data.DataLoader(
        Files(blobs, size), batch_size=batch, shuffle=True, num_workers=workers,
        pin_memory=device == "cuda", persistent_workers=workers > 0,
    )  # fmt: skip
    for x in loader:  # warm-up: the workers start
        x.to(device, non_blocking=True).float()
    t0 = time.perf_counter()
    for _ in range(epochs):
        for x in loader:
            x.to(device, non_blocking=True).float().div_(255)
    if device == "cuda":
        torch.cuda.synchronize()
    return epochs * len(blobs) / (time.perf_counter() - t0)


def gpu_decode(blobs: list[bytes], size: int, batch: int, device: str, epochs: int) -> float:
    from torchvision.io import decode_jpeg

    aug = augment(size)
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]

    def epoch() -> None:
        order = torch.randperm(len(data)).tolist()
        for i in range(0, len(order), batch):
            images = decode_jpeg([data[j] for j in order[i : i + batch]], device=device)
            torch.stack([aug(img) for img in images]).float().div_(255)

    epoch()  # warm-up: nvJPEG's handles
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(epochs):
        epoch()
    if device == "cuda":
        torch.cuda.synchronize()
    return epochs * len(blobs) / (time.perf_counter() - t0)


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
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run on an NVIDIA GPU, or --dry-run", file=sys.stderr)
        return 2
    blobs = make_jpegs(args.images, args.side)
    shape = (blobs, args.size, args.batch)
    result = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
        "workload": f"{args.images} JPEGs of {args.side} px, crop {args.size}, batch {args.batch}",
        "cpu_workers": args.workers,
        "images_per_s": {
            "cpu_workers": round(cpu_workers(*shape, args.workers, device, args.epochs), 1),
            "gpu_decode": round(gpu_decode(*shape, device, args.epochs), 1),
        },
    }
    ips = result["images_per_s"]
    result["gpu_over_cpu"] = round(ips["gpu_decode"] / ips["cpu_workers"], 3)  # type: ignore[index]
    print(json.dumps(result, indent=1) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
