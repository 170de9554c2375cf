"""`bigbatch train` against fastai's `vision_learner` + `fit_one_cycle`: time and accuracy.

Both train the same timm architecture from random weights on the same generated folder of
images (a seeded 20 % validation split each), at the same size, batch, epochs, learning rate and
one-cycle schedule, in this process with the same torch threads and in-process data loading.
Rounds are paired and alternated. `time_ratio_vs_fastai` is the median of bigbatch / fastai
seconds per epoch (below 1.0: bigbatch is faster; the goal is <= 1.0 at equal or better
accuracy), `whole_run_ratio` the same for whole runs, setup included; the accuracies are each
tool's own validation accuracy after the last epoch (median over rounds).

    python benchmarks/vs_fastai.py                  # resnet10t at 32 px, 600 images, 3 epochs
    python benchmarks/vs_fastai.py --json           # {"time_ratio_vs_fastai": ..., ...}
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
from PIL import Image

from bigbatch.train.config import load_config
from bigbatch.train.loop import train


def write_images(root: Path, per_class: int, size: int) -> None:
    """Three classes of noisy images, each brighter in one colour channel."""
    rng = np.random.default_rng(0)
    for c, name in enumerate(("red", "green", "blue")):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 120, (size, size, 3))
            pixels[..., c] += 100
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i}.png")


def run_fastai(data: Path, arch: str, size: int, batch: int, epochs: int, lr: float) -> dict:
    from fastai.callback.core import Callback
    from fastai.vision.all import ImageDataLoaders, Resize, accuracy, vision_learner

    class EpochTimes(Callback):
        def before_fit(self) -> None:
            self.times: list[float] = []

        def before_epoch(self) -> None:
            self.t0 = time.perf_counter()

        def after_epoch(self) -> None:
            self.times.append(time.perf_counter() - self.t0)

    t0 = time.perf_counter()
    torch.manual_seed(42)
    dls = ImageDataLoaders.from_folder(
        data, valid_pct=0.2, seed=42, item_tfms=Resize(size), bs=batch, num_workers=0
    )
    timer = EpochTimes()
    learn = vision_learner(dls, arch, pretrained=False, metrics=accuracy, cbs=[timer])
    with learn.no_logging(), learn.no_bar():
        learn.fit_one_cycle(epochs, lr)
        seconds, epoch_times = time.perf_counter() - t0, list(timer.times)
        accuracy_value = float(learn.validate()[1])  # (its own pass resets the timer)
    return {"seconds": seconds, "epochs": epoch_times, "accuracy": accuracy_value}


def run_bigbatch(
    data: Path, out: Path, arch: str, size: int, batch: int, epochs: int, lr: float
) -> dict:
    t0 = time.perf_counter()
    cfg = load_config(
        overrides=[
            f"data={data}", f"arch={arch}", f"size={size}", f"batch={batch}",
            f"micro_batch={batch}", f"epochs={epochs}", f"lr={lr}", "mode=fit",
            "schedule=one_cycle", "device=cpu", "num_workers=0", "valid_pct=0.2",
        ]
    )  # fmt: skip
    result = train(cfg, out, log=lambda _: None, progress=False)
    return {
        "seconds": time.perf_counter() - t0,
        "epochs": [float(r["seconds"]) for r in result.history],
        "accuracy": float(result.history[-1]["accuracy"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", default="resnet10t")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--per-class", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        write_images(data, args.per_class, args.size)
        rows = []
        for r in range(args.rounds):
            torch.set_num_threads(threads)
            fa = run_fastai(data, args.arch, args.size, args.batch, args.epochs, args.lr)
            torch.set_num_threads(threads)
            bb = run_bigbatch(
                data, Path(tmp) / f"run{r}", args.arch, args.size, args.batch, args.epochs, args.lr
            )
            rows.append({"fastai": fa, "bigbatch": bb})
    per_epoch = [
        statistics.median(r["bigbatch"]["epochs"]) / statistics.median(r["fastai"]["epochs"])
        for r in rows
    ]
    whole = [r["bigbatch"]["seconds"] / r["fastai"]["seconds"] for r in rows]
    result = {
        "time_ratio_vs_fastai": statistics.median(per_epoch),
        "whole_run_ratio": statistics.median(whole),
        "accuracy_bigbatch": statistics.median(r["bigbatch"]["accuracy"] for r in rows),
        "accuracy_fastai": statistics.median(r["fastai"]["accuracy"] for r in rows),
        "config": vars(args) | {"threads": threads},
        "rounds": rows,
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(
        f"{args.arch} @ {args.size} px, batch {args.batch}, {args.epochs} epochs, "
        f"{3 * args.per_class} images, {threads} threads, {args.rounds} paired rounds"
    )
    print(
        f"bigbatch / fastai seconds per epoch: {result['time_ratio_vs_fastai']:.2f} "
        f"(whole runs {result['whole_run_ratio']:.2f})"
    )
    print(
        f"validation accuracy: bigbatch {result['accuracy_bigbatch']:.3f}, "
        f"fastai {result['accuracy_fastai']:.3f}"
    )


if __name__ == "__main__":
    main()
