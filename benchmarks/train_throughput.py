"""Throughput of `bigbatch train` against a hand-written timm training loop.

Both train the same timm model on the same generated image folder, with the same transforms
(bigbatch's own), micro-batch, accumulation, optimizer, schedule, threads and data loading
(in-process), and evaluate on the same validation images after every epoch. bigbatch also
plans (one fake-tensor step for a fixed micro-batch), scans the images, writes checkpoints,
history.csv and the plot: that is its overhead. Runs are paired and alternated in one process;
`ratio_vs_hand_loop` is the median of hand / bigbatch seconds per epoch (training and
validation: the loop; 1.0 is as fast, the target >= 0.97) and `whole_run_ratio` the same for
whole runs, bigbatch's fixed costs included.

    python benchmarks/train_throughput.py            # resnet10t at 32 px, 768 images, 2 epochs
    python benchmarks/train_throughput.py --json     # {"ratio_vs_hand_loop": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from bigbatch.train.config import load_config
from bigbatch.train.data import split_items
from bigbatch.train.loop import train
from bigbatch.train.tasks.classification.data import ImageDataset, build_transforms, load_items


def write_images(root: Path, per_class: int, size: int) -> None:
    rng = np.random.default_rng(0)
    for c, name in enumerate(("red", "green", "blue")):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 80, (size, size, 3))
            pixels[..., c] += 150
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i}.png")


def hand_loop(
    data: Path, arch: str, size: int, batch: int, micro: int, epochs: int
) -> tuple[float, list[float]]:
    """The loop a practitioner writes: timm model, AdamW, OneCycle, `loss / N` accumulation."""
    import timm

    t0 = time.perf_counter()
    items = load_items(str(data))  # the same files, the same seeded split
    train_items, valid_items = split_items(items, 0.2, 42)
    torch.manual_seed(42)
    model = timm.create_model(arch, num_classes=len(items.classes))
    train_ds = ImageDataset(
        train_items.files,
        train_items.labels,
        build_transforms(size, "squish", train=True, augment=True),
    )
    valid_ds = ImageDataset(
        valid_items.files,
        valid_items.labels,
        build_transforms(size, "squish", train=False, augment=False),
    )
    steps = epochs * -(-len(train_ds) // batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps)
    accum = -(-batch // micro)
    epoch_s = []
    for epoch in range(epochs):
        e0 = time.perf_counter()
        model.train()
        loader = torch.utils.data.DataLoader(
            train_ds, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(epoch)
        )
        for x, y in loader:
            for xm, ym in zip(x.split(micro), y.split(micro), strict=True):
                (F.cross_entropy(model(xm), ym) / accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        model.eval()
        with torch.no_grad():
            for x, y in torch.utils.data.DataLoader(valid_ds, batch_size=2 * micro):
                F.cross_entropy(model(x), y)
        epoch_s.append(time.perf_counter() - e0)
    return time.perf_counter() - t0, epoch_s


def bigbatch_run(
    data: Path, out: Path, arch: str, size: int, batch: int, micro: int, epochs: int
) -> tuple[float, list[float]]:
    cfg = load_config(
        overrides=[
            f"data={data}",
            f"arch={arch}",
            f"size={size}",
            f"batch={batch}",
            f"micro_batch={micro}",
            f"epochs={epochs}",
            "mode=fit",
            "device=cpu",
            "num_workers=0",
            f"threads={torch.get_num_threads()}",
            "log_every=0",
        ]
    )
    t0 = time.perf_counter()
    result = train(cfg, out, log=lambda _: None, progress=False)
    # Each epoch's seconds in history.csv: training and validation, as the hand loop's.
    return time.perf_counter() - t0, [float(row["seconds"]) for row in result.history]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", default="resnet10t")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--per-class", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "images"
        write_images(data, args.per_class, args.size)
        shape = (args.arch, args.size, args.batch, args.micro, args.epochs)
        hand_loop(data, *shape)  # warm-up: imports, kernel choices, file cache
        ratios, epoch_ratios, hand_s, ours_s = [], [], [], []
        for r in range(args.rounds):
            h, h_epochs = hand_loop(data, *shape)
            b, b_epochs = bigbatch_run(data, Path(tmp) / f"run{r}", *shape)
            hand_s.append(h)
            ours_s.append(b)
            ratios.append(h / b)
            epoch_ratios += [x / y for x, y in zip(h_epochs, b_epochs, strict=True)]
    result = {
        "workload": f"{args.arch} @ {args.size} px, {3 * args.per_class} images, "
        f"batch {args.batch} = {-(-args.batch // args.micro)} x {args.micro}, {args.epochs} epochs",
        "rounds": args.rounds,
        "median_seconds": {
            "hand": statistics.median(hand_s),
            "bigbatch": statistics.median(ours_s),
        },
        # The loop: an epoch of training and validation, bigbatch's against the hand loop's.
        "ratio_vs_hand_loop": statistics.median(epoch_ratios),
        # The whole run, with bigbatch's fixed costs (scan, plan check, checkpoints, plots).
        "whole_run_ratio": statistics.median(ratios),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(result["workload"])
    print(
        f"per epoch: ratio {result['ratio_vs_hand_loop']:.3f} (hand / bigbatch; 1.0 is as fast)\n"
        f"whole run: hand loop {result['median_seconds']['hand']:.2f} s, bigbatch train "
        f"{result['median_seconds']['bigbatch']:.2f} s, ratio {result['whole_run_ratio']:.3f}"
    )


if __name__ == "__main__":
    main()
