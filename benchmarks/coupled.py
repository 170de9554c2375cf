"""A contrastive loss at one target batch: the big batch, plain accumulation, gradient caching.

SimCLR-style: an MLP encoder (two views per sample, dropout on) and InfoNCE over the batch. For
each path: the peak tensor memory of one optimizer step (measured with torch's profiler on the
CPU, the weights included) and the time per step (medians; the time ratio is the median of the
rounds' paired ratios). The big batch holds every activation at once; plain accumulation holds
one micro-batch's but trains another objective (fewer negatives); the cached path holds one
micro-batch's activations plus the representations and computes the big batch's gradient, for
one more forward.

    python benchmarks/coupled.py                       # batch 1024 = 8 x 128
    python benchmarks/coupled.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from bigbatch import Accumulator
from bigbatch.coupled import cached_backward, info_nce
from bigbatch.memory.measure import measure_peak


def encoder(dim: int, width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(dim, width), nn.ReLU(), nn.Dropout(0.1)]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 128))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--micro", type=int, default=128)
    p.add_argument("--dim", type=int, default=512, help="input features")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model = encoder(args.dim, args.width, args.depth)
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(args.batch, args.dim, generator=g)
    x2 = torch.randn(args.batch, args.dim, generator=g)
    parts = list(zip(x1.split(args.micro), x2.split(args.micro), strict=True))

    def big() -> None:
        acc = Accumulator(torch.optim.SGD(model.parameters(), lr=1e-3), micro_batches=1)
        acc.backward(info_nce(model(x1), model(x2)), count=args.batch)
        acc.step()

    def plain() -> None:
        acc = Accumulator(torch.optim.SGD(model.parameters(), lr=1e-3), micro_batches=len(parts))
        for a, b in parts:
            acc.backward(info_nce(model(a), model(b)), count=len(a))
        acc.step()

    def cached() -> None:
        acc = Accumulator(torch.optim.SGD(model.parameters(), lr=1e-3), micro_batches=1)
        cached_backward(acc, lambda mb: (model(mb[0]), model(mb[1])), info_nce, parts)
        acc.step()

    paths: dict[str, Callable[[], None]] = {"big_batch": big, "plain": plain, "cached": cached}
    alive = [*model.parameters(), x1, x2]
    peak = {name: measure_peak(fn, alive=alive) for name, fn in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for name in paths:  # warm-up
        paths[name]()
    for r in range(args.rounds):
        # plain and cached adjacent, their order alternating; the big batch first or last.
        order = ["big_batch", "plain", "cached"] if r % 2 == 0 else ["cached", "plain", "big_batch"]
        for name in order:
            t0 = time.perf_counter()
            paths[name]()
            times[name].append(time.perf_counter() - t0)
    seconds = {name: statistics.median(t) for name, t in times.items()}
    # Paired within each round (the two paths run back to back), so drift on a shared machine
    # cancels out of the ratio.
    paired = [c / p for c, p in zip(times["cached"], times["plain"], strict=True)]
    result = {
        "batch": args.batch,
        "micro_batch": args.micro,
        "peak_bytes": peak,
        "seconds_per_step": seconds,
        "memory_ratio_vs_big_batch": peak["cached"] / peak["big_batch"],
        "memory_ratio_vs_plain_accumulation": peak["cached"] / peak["plain"],
        "time_ratio_vs_plain_accumulation": statistics.median(paired),
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(
        f"InfoNCE, batch {args.batch} = {len(parts)} x {args.micro}, MLP {args.dim} -> "
        f"{args.depth} x {args.width} -> 128"
    )
    print(f"{'path':<10} {'peak MiB':>9} {'s/step':>8}")
    for name in paths:
        print(f"{name:<10} {peak[name] / 2**20:>9.1f} {seconds[name]:>8.3f}")
    print(
        f"cached: memory {result['memory_ratio_vs_big_batch']:.2f}x the big batch's "
        f"({result['memory_ratio_vs_plain_accumulation']:.2f}x plain accumulation's), time "
        f"{result['time_ratio_vs_plain_accumulation']:.2f}x plain accumulation's"
    )


if __name__ == "__main__":
    main()
