"""What keeping preprocessed volumes in memory (``cache=auto``, MONAI's CacheDataset) saves
per epoch of a segmentation run's data: BraTS-shaped cases (four NIfTI modalities of 1 x 1 x 2
mm voxels, resampled to 1 mm, z-scored), a random 32^3 patch with MONAI's augmentation per
sample, read in the training process (no loader workers: what a worker spends per sample).

Epochs of the cached and uncached datasets alternate; the medians and their ratio are printed
(the cache's one-time fill is reported apart, after a warm-up epoch).

    python benchmarks/seg_cache.py                 # 12 cases of 96 x 96 x 48 voxels, 3 rounds
    python benchmarks/seg_cache.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bigbatch.segmentation.synthetic import write_brats_like
from bigbatch.train.tasks.segmentation.cache import CachedCases
from bigbatch.train.tasks.segmentation.data import SegDataset, VolumeRecipe, scan_segmentation


def epoch_seconds(dataset: object) -> float:
    start = time.perf_counter()
    for i in range(len(dataset)):  # type: ignore[arg-type]
        dataset[i]  # type: ignore[index]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--shape", default="96,96,48", help="voxels per case, X,Y,Z (2 mm in Z)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_brats_like(Path(tmp), n=args.cases, shape=shape)  # type: ignore[arg-type]
        items = scan_segmentation(data)
        recipe = VolumeRecipe(32, spacing=(1.0, 1.0, 1.0), multiple=8)

        def dataset() -> SegDataset:
            return SegDataset(items, 32, train=True, augment=True, recipe=recipe)

        plain = dataset()
        epoch_seconds(plain)  # warm-up: MONAI's and torch's first calls, the page cache
        start = time.perf_counter()
        cached = CachedCases(dataset(), args.cases, threads=1)
        fill = time.perf_counter() - start
        timings: dict[str, list[float]] = {"plain": [], "cached": []}
        for _ in range(args.rounds):
            timings["plain"].append(epoch_seconds(plain))
            timings["cached"].append(epoch_seconds(cached))
    plain_s, cached_s = (statistics.median(timings[k]) for k in ("plain", "cached"))
    result = {
        "cases": args.cases,
        "shape": list(shape),
        "seconds_per_epoch_plain": round(plain_s, 3),
        "seconds_per_epoch_cached": round(cached_s, 3),
        "speedup": round(plain_s / cached_s, 2),
        "cache_fill_seconds": round(fill, 3),
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.cases} cases of {'x'.join(map(str, shape))} voxels, a 32^3 patch each: "
        f"{plain_s:.2f} s an epoch reading and preprocessing, {cached_s:.2f} s from the cache "
        f"({plain_s / cached_s:.1f}x; filled once in {fill:.2f} s)"
    )


if __name__ == "__main__":
    main()
