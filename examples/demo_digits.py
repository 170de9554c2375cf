"""The demo: train on the bundled UCI digits three ways and compare the weights.

1. big batch: 256 images per optimizer step (the update we want);
2. bigbatch:  micro-batches of 64 accumulated into the same windows, including the last,
              partial window of each epoch (1797 = 7 x 256 + 5);
3. naive:     the usual (loss / 4).backward() accumulation.

Runs in float64 so that "equal" means equal to ~1e-15, not "close". No download: the digits
ship with bigbatch (bigbatch.train.demo.load_digits).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import bigbatch
from bigbatch.train.demo import load_digits

BIG, MICRO, EPOCHS = 256, 64, 5


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = load_digits()
    x = torch.tensor(images, dtype=torch.float64).reshape(-1, 64) / 16.0
    return x, torch.tensor(labels, dtype=torch.int64)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).double()


def epochs(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randperm(len(y), generator=g) for _ in range(EPOCHS)]


def train_big(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    for order in epochs(x, y):
        for idx in order.split(BIG):
            F.cross_entropy(m(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()


def train_bigbatch(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> bigbatch.Accumulator:
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    acc = bigbatch.Accumulator(opt, micro_batches=BIG // MICRO)
    for order in epochs(x, y):
        for idx in order.split(MICRO):
            acc.backward(F.cross_entropy(m(x[idx]), y[idx]), count=len(idx))
            if acc.window_full:
                acc.step()
        acc.end_epoch()  # the last window holds 5 samples: renormalised by 5, not divided by 4
    return acc


def train_naive(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    n = BIG // MICRO
    for order in epochs(x, y):
        chunks = order.split(MICRO)
        for i, idx in enumerate(chunks):
            (F.cross_entropy(m(x[idx]), y[idx]) / n).backward()
            if (i + 1) % n == 0 or i == len(chunks) - 1:
                opt.step()
                opt.zero_grad()


def max_rel(a: nn.Module, b: nn.Module, start: nn.Module) -> float:
    worst = 0.0
    for p, q, p0 in zip(a.parameters(), b.parameters(), start.parameters(), strict=True):
        update = (q - p0).abs().max()
        worst = max(worst, float(((p - q).abs().max() / update).detach()))
    return worst


def accuracy(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((m(x).argmax(1) == y).double().mean())


def main() -> None:
    x, y = digits()
    print(
        f"bigbatch demo: {len(y)} digit images (8x8 UCI digits, shipped with bigbatch), {EPOCHS} epochs"
    )
    print(
        f"  target batch {BIG} = micro-batch {MICRO} x {BIG // MICRO}; last window of each epoch: {len(y) % BIG} images\n"
    )
    start = model()
    runs = {}
    for name, fn in [
        ("big batch", train_big),
        ("bigbatch", train_bigbatch),
        ("naive loss/N", train_naive),
    ]:
        m = copy.deepcopy(start)
        t0 = time.perf_counter()
        fn(m, x, y)
        runs[name] = m
        print(
            f"  trained {name:<13} in {time.perf_counter() - t0:5.2f} s   accuracy {accuracy(m, x, y):.4f}"
        )
    ref = runs["big batch"]
    ours = max_rel(runs["bigbatch"], ref, start)
    naive = max_rel(runs["naive loss/N"], ref, start)
    print(
        "\nweights after training, compared with the big batch (max |difference| / max |update|):"
    )
    print(
        f"  bigbatch      {ours:.1e}   {'EQUAL (float64 round-off)' if ours < 1e-10 else 'DIFFERENT'}"
    )
    print(
        f"  naive loss/N  {naive:.1e}   {'EQUAL' if naive < 1e-10 else 'DIFFERENT: the short last windows were divided by 4'}"
    )
    if ours >= 1e-10:
        raise SystemExit("bigbatch did not reproduce the big batch: please report this")
    print(
        "\nNext: `bigbatch verify` checks the same on built-in cases; `bigbatch verify --model m:f --data m:g` on yours."
    )


if __name__ == "__main__":
    main()
