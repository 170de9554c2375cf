"""Workers for test_distributed.py, run in spawned processes (gloo on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bigbatch import Accumulator
from bigbatch.backoff import OOMBackoff, run_window
from bigbatch.distributed import maxima_over_ranks


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4)).double()


def rank_data(rank: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randn(n, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (n,), generator=g),
        )
        for n in sizes
    ]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _save(rank: int, out: str, name: str, model: nn.Module, extra: object = None) -> None:
    torch.save(
        {"params": [p.detach().clone() for p in model.parameters()], "extra": extra},
        Path(out) / f"{name}-{rank}.pt",
    )


def oom_on_one_rank(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 runs out of memory above micro-batch 8; both ranks must shrink together."""
    model = nn.parallel.DistributedDataParallel(net())
    acc = Accumulator(sgd(model), model=model, sync="step")
    backoff = OOMBackoff(micro_batch=16, grow_after=0)
    for x, y in rank_data(rank, [24, 24, 24]):  # three windows of 24 samples per rank

        def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            if rank == 1 and len(batch[1]) > 8:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected on rank 1)")
            return F.cross_entropy(model(batch[0]), batch[1])

        run_window(acc, (x, y), loss_fn, backoff)
    # What a refit agrees on, each figure's largest over the ranks in one collective.
    agreed = maxima_over_ranks([rank, 10 - rank])
    _save(rank, out, "oom", model, ([(e.old, e.new) for e in backoff.events], agreed))


def uneven_data(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 has 5 micro-batches, rank 1 only 3: rank 1 runs out first and joins the steps."""
    model = nn.parallel.DistributedDataParallel(net())
    acc = Accumulator(sgd(model), micro_batches=2, model=model, sync="step")
    for x, y in rank_data(rank, [4, 6, 8, 2, 5] if rank == 0 else [7, 3, 9]):
        with acc.no_sync():
            acc.backward(F.cross_entropy(model(x), y), count=len(y))
        if acc.window_full:
            acc.step()
    acc.end_epoch()
    _save(rank, out, "uneven", model, acc.optimizer_step)
    dist.barrier()


def contrastive_views(rank: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(200 + rank)
    return [
        (torch.randn(n, 6, generator=g, dtype=torch.float64),
         torch.randn(n, 6, generator=g, dtype=torch.float64))
        for n in sizes
    ]  # fmt: skip


def info_nce(z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    logits = F.normalize(z1, dim=1) @ F.normalize(z2, dim=1).T / 0.2
    return F.cross_entropy(logits, torch.arange(len(z1)))


CONTRASTIVE_SIZES = {0: [5, 3], 1: [4, 4, 2]}  # uneven: 8 rows on rank 0, 10 on rank 1


def cached_contrastive(rank: int, world: int, port: int, out: str) -> None:
    """InfoNCE over both ranks' rows (all-gathered): every rank's negatives are the global batch."""
    from bigbatch.coupled import cached_backward

    model = net()
    acc = Accumulator(sgd(model), micro_batches=1, sync="step")
    batches = contrastive_views(rank, CONTRASTIVE_SIZES[rank])
    cached_backward(acc, lambda b: (model(b[0]), model(b[1])), info_nce, batches, gather=True)
    acc.step()
    _save(rank, out, "cached", model)


def port_taken_once(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 fails as a port another program took would, on the first run only; it records
    each port it was given."""
    if rank == 0:
        ports = Path(out) / "ports.txt"
        first = not ports.exists()
        with ports.open("a") as f:
            f.write(f"{port}\n")
        if first:
            raise RuntimeError("The server socket has failed to listen: Address already in use")


def fails(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 fails with an error that is not about ports."""
    if rank == 1:
        raise ValueError("not a port problem")
