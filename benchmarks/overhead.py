"""Overhead of bigbatch against a hand-written accumulation loop (and Lightning Fabric /
Accelerate when installed: `pip install -e '.[bench]'`).

Same workload, same data order, same initial weights; runs are paired and alternated in one
process so machine noise hits both sides alike; prints the median of the paired time ratios.

    python benchmarks/overhead.py            # MLP 512-1024-1024-10, 20k samples, 32 x 8
    python benchmarks/overhead.py --json     # {"ratio_vs_hand": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import bigbatch


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def batches(samples: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 512, generator=g)
    y = torch.randint(0, 10, (samples,), generator=g)
    return list(zip(x.split(micro), y.split(micro), strict=True))


def hand(data: list, accum: int) -> nn.Module:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i, (x, y) in enumerate(data):
        (F.cross_entropy(model(x), y) / accum).backward()
        if (i + 1) % accum == 0 or i == len(data) - 1:
            opt.step()
            opt.zero_grad()
    return model


def with_bigbatch(data: list, accum: int) -> nn.Module:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = bigbatch.Accumulator(opt, micro_batches=accum)
    for x, y in data:
        acc.backward(F.cross_entropy(model(x), y), count=len(y))
        if acc.window_full:
            acc.step()
    acc.end_epoch()
    return model


def with_fabric(data: list, accum: int) -> nn.Module:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    for i, (x, y) in enumerate(data):
        last = (i + 1) % accum == 0 or i == len(data) - 1
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(F.cross_entropy(model(x), y) / accum)
        if last:
            opt.step()
            opt.zero_grad()
    return model


def with_accelerate(data: list, accum: int) -> nn.Module:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    for x, y in data:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    return model


def timed(fn: Callable[[list, int], nn.Module], data: list, accum: int) -> float:
    t0 = time.perf_counter()
    fn(data, accum)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument(
        "--rounds", type=int, default=5, help="paired rounds (each runs every contender once)"
    )
    p.add_argument(
        "--no-frameworks", action="store_true", help="skip Lightning Fabric and Accelerate"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    data = batches(args.samples, args.micro)
    contenders: dict[str, Callable[[list, int], nn.Module]] = {
        "hand": hand,
        "bigbatch": with_bigbatch,
    }
    frameworks = [
        ("fabric", with_fabric, "lightning"),
        ("accelerate", with_accelerate, "accelerate"),
    ]
    for name, fn, module in [] if args.no_frameworks else frameworks:
        try:
            __import__(module)
            contenders[name] = fn
        except ImportError:
            pass
    for fn in contenders.values():  # warm-up: allocator, kernels, the frameworks' set-up
        timed(fn, data[: 2 * args.accum], args.accum)
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    pair_ratios: dict[str, list[float]] = {name: [] for name in names if name != "hand"}
    for r in range(args.rounds):
        for name in pair_ratios:
            # Each contender runs right beside its own hand-loop run, first or second in turn,
            # so drift in the machine's speed hits both sides of a pair alike.
            pair = ("hand", name) if r % 2 == 0 else (name, "hand")
            t = {n: timed(contenders[n], data, args.accum) for n in pair}
            times[name].append(t[name])
            times["hand"].append(t["hand"])
            pair_ratios[name].append(t[name] / t["hand"])
    ratios = {name: statistics.median(r) for name, r in pair_ratios.items()}
    result = {
        "workload": f"MLP 512-1024-1024-10, {args.samples} samples, micro-batch {args.micro} x {args.accum}",
        "rounds": args.rounds,
        "median_seconds": {name: statistics.median(t) for name, t in times.items()},
        "ratio_vs_hand": ratios["bigbatch"],
        "ratios_vs_hand": ratios,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(result["workload"], f"({args.rounds} paired rounds, torch {torch.__version__})")
    for name in names:
        ratio = "" if name == "hand" else f"  ratio vs hand (median of pairs) {ratios[name]:.3f}x"
        print(f"  {name:<11} median {statistics.median(times[name]):7.3f} s{ratio}")


if __name__ == "__main__":
    main()
