"""What bounding oneDNN's primitive cache costs a CPU training window (bigbatch.device.
bound_onednn_cache): timm convnext_atto at 64 px, windows of 128 samples with SGD, split evenly
(16 x 8) and unevenly (43, 43, 42: two sizes, so a cache that holds one size rebuilds kernels
at every switch), with oneDNN's default cache, a bound of two counted sizes and of one.

Each cache runs in its own subprocess (oneDNN reads its capacity once); the first window is
warm-up, then `--windows` are timed. Prints seconds per window and the ratio to the default.

    python benchmarks/onednn_cache.py                  # 1 thread
    python benchmarks/onednn_cache.py --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def child(micro: int, sizes: int, entries: int, windows: int) -> float:
    import timm

    from bigbatch import Accumulator
    from bigbatch.backoff import OOMBackoff, run_window
    from bigbatch.device import bound_onednn_cache

    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", num_classes=10)
    if sizes:
        bound_onednn_cache(model, sizes=sizes, entries_per_size=entries)
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(128, 3, 64, 64), torch.randint(0, 10, (128,))
    backoff = OOMBackoff(micro_batch=micro, grow_after=0)

    def loss_fn(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b[0]), b[1])

    run_window(acc, (x, y), loss_fn, backoff)  # warm-up: kernels built once
    start = time.perf_counter()
    for _ in range(windows):
        run_window(acc, (x, y), loss_fn, backoff)
    return (time.perf_counter() - start) / windows


def count_entries(threads: int) -> int:
    """One size's cache entries: the cache misses oneDNN reports for a first step."""
    code = (
        f"import torch, timm; torch.set_num_threads({threads}); m = timm.create_model("
        "'convnext_atto', num_classes=10); m(torch.randn(2, 3, 64, 64)).sum().backward()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, ONEDNN_VERBOSE="all"),
    )
    return done.stdout.count("cache_miss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(child(*args.child, args.windows))
        return
    entries = count_entries(args.threads)
    rows = []
    for micro in (16, 43):
        seconds = {}
        for label, sizes in (("default", 0), ("two_sizes", 2), ("one_size", 1)):
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(micro), str(sizes), str(entries),
                 "--threads", str(args.threads), "--windows", str(args.windows)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            seconds[label] = float(done.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "micro_batch": micro,
                "threads": args.threads,
                "entries_per_size": entries,
                "seconds_per_window": {k: round(v, 3) for k, v in seconds.items()},
                "ratio_two_sizes": round(seconds["two_sizes"] / seconds["default"], 3),
                "ratio_one_size": round(seconds["one_size"] / seconds["default"], 3),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        split = "16 x 8" if r["micro_batch"] == 16 else "43, 43, 42"
        print(
            f"{split:<11} {r['threads']} thread(s), {r['entries_per_size']} entries a size: "
            f"s/window {r['seconds_per_window']}; two sizes x{r['ratio_two_sizes']}, "
            f"one size x{r['ratio_one_size']}"
        )


if __name__ == "__main__":
    main()
