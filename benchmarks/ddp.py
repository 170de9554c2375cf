"""bigbatch under DDP vs DDP synchronising every micro-batch: 2 CPU processes, gloo on 127.0.0.1.

A model with many parameters and little compute (communication dominates), micro-batch 4 x 8
per window. bigbatch runs every micro-batch but the last under no_sync (sync="last": DDP
all-reduces once, during the last backward) or all of them (sync="step": one flat all-reduce at
step time); plain DDP all-reduces every micro-batch's gradients. Paired and alternated in one
run; prints seconds per window, the ratio, and all-reduces per window.

    python benchmarks/ddp.py            # table
    python benchmarks/ddp.py --json     # {"ratio_vs_ddp_every_micro_batch": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bigbatch import Accumulator
from bigbatch.verify.distributed import (
    count_bigbatch_allreduces,
    count_ddp_allreduces,
    run_distributed,
)

METHODS = ("ddp_every_micro_batch", "bigbatch_sync_last", "bigbatch_sync_step")


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def _window(
    method: str, model: nn.Module, acc: Accumulator | None, opt: torch.optim.Optimizer, data: list
) -> None:
    if acc is None:  # plain DDP: gradients all-reduced after every micro-batch
        for x, y in data:
            (F.cross_entropy(model(x), y) / len(data)).backward()
        opt.step()
        opt.zero_grad()
        return
    for x, y in data:
        with acc.no_sync():
            acc.backward(F.cross_entropy(model(x), y), count=len(y))
        if acc.window_full:
            acc.step()


def worker(
    rank: int, world: int, port: int, out: str, width: int, micro: int, accum: int, rounds: int
) -> None:
    g = torch.Generator().manual_seed(rank)
    data = [
        (torch.randn(micro, 256, generator=g), torch.randint(0, 10, (micro,), generator=g))
        for _ in range(accum)
    ]
    setups = {}
    for method in METHODS:
        model = nn.parallel.DistributedDataParallel(make_model(width))
        state = {"allreduces": 0}
        count_ddp_allreduces(model, state, "allreduces")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        acc = None
        if method != "ddp_every_micro_batch":
            sync = "last" if method.endswith("last") else "step"
            acc = Accumulator(opt, micro_batches=accum, model=model, sync=sync)  # type: ignore[arg-type]
        setups[method] = (model, acc, opt, state)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    counts: dict[str, float] = {}
    for method in METHODS:  # a warm-up window (DDP rebuilds its buckets), then one counted
        model, acc, opt, state = setups[method]
        _window(method, model, acc, opt, data)
        state["allreduces"] = 0
        with count_bigbatch_allreduces(state, "allreduces"):
            _window(method, model, acc, opt, data)
        counts[method] = state["allreduces"]
    for r in range(rounds):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        for method in order:
            model, acc, opt, _ = setups[method]
            dist.barrier()
            t0 = time.perf_counter()
            _window(method, model, acc, opt, data)
            dist.barrier()
            times[method].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps({"times": times, "allreduces": counts}))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--width", type=int, default=2048, help="hidden width (parameters ~ width^2)")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(worker, 2, tmp, args.width, args.micro, args.accum, args.rounds)
        raw = json.loads(Path(tmp, "result.json").read_text())
    base = raw["times"]["ddp_every_micro_batch"]
    ratios = {
        m: statistics.median(t / b for t, b in zip(raw["times"][m], base, strict=True))
        for m in METHODS[1:]
    }
    params = sum(p.numel() for p in make_model(args.width).parameters())
    result = {
        "workload": f"MLP 256-{args.width}-{args.width}-10 ({params / 1e6:.1f}M params), 2 ranks, micro-batch {args.micro} x {args.accum}",
        "median_seconds_per_window": {m: statistics.median(t) for m, t in raw["times"].items()},
        "allreduces_per_window": raw["allreduces"],
        "ratio_vs_ddp_every_micro_batch": ratios["bigbatch_sync_last"],
        "ratios": ratios,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(result["workload"], f"({args.rounds} paired rounds, gloo on CPU)")
    for m in METHODS:
        ratio = f"  ratio {ratios[m]:.2f}x" if m in ratios else ""
        print(
            f"  {m:<22} {result['median_seconds_per_window'][m]:7.3f} s/window  "
            f"{raw['allreduces'][m]:>4.0f} all-reduces/window{ratio}"
        )


if __name__ == "__main__":
    main()
