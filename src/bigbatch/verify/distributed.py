"""``bigbatch verify --distributed N``: exactness across processes, on CPU with gloo.

N processes on 127.0.0.1 each hold a different share of one window (different micro-batch sizes
and token counts per rank) and train it under ``DistributedDataParallel``; the gradient the
optimizer applies on rank 0 is compared with one process computing the big batch over every
rank's data at once. bigbatch runs with both sync modes; plain DDP with ``loss / N`` is the
negative control. Each row also records how many all-reduces the window cost.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bigbatch import distributed as bbdist
from bigbatch.accumulate import Accumulator
from bigbatch.verify import TOLERANCES, CaseResult, compare_gradients, token_cross_entropy

__all__ = [
    "DISTRIBUTED_CASES",
    "count_bigbatch_allreduces",
    "count_ddp_allreduces",
    "free_port",
    "run_distributed",
    "verify_distributed",
]

# case -> per-rank micro-batch counts (samples, or real tokens), micro-batches per window.
DISTRIBUTED_CASES: dict[str, tuple[list[list[int]], int, bool]] = {
    "ddp_uneven_ranks": ([[4, 12], [16, 2]], 2, False),
    "ddp_tokens": ([[8, 120], [40, 420]], 2, True),
    "ddp_partial_window": ([[6, 10], [3, 5]], 3, False),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_distributed(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, port, *args)`` on ``world_size`` CPU processes (gloo)."""
    import torch.multiprocessing as mp

    for attempt in range(3):
        processes = mp.start_processes(
            _entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=False
        )
        try:
            while not processes.join():
                pass
            return
        except mp.ProcessRaisedException as exc:
            # The free port can be taken between finding it and binding it: try another.
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
        finally:
            # torch leaves the file a failed worker wrote its traceback to in the temp folder.
            for path in processes.error_files:
                Path(path).unlink(missing_ok=True)


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...]
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    fn(rank, world_size, port, *args)
    dist.barrier()
    # Neither destroy_process_group() nor the interpreter's teardown: with torch 2.14's gloo
    # either can abort a finished worker ("terminate called without an active exception",
    # about 1 run in 10 here, plain DDP scripts included), failing work that is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Net(nn.Module):
    def __init__(self, tokens: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = tokens
        self.embed = nn.Embedding(50, 16) if tokens else nn.Linear(10, 16)
        self.body = nn.Sequential(nn.Tanh(), nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 50 if tokens else 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def case_data(
    counts: list[list[int]], tokens: bool, seed: int = 0
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per rank, per micro-batch (inputs, targets); the same on every process."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for rank_counts in counts:
        batches = []
        for c in rank_counts:
            if tokens:  # 2 sequences x 256 slots, c of them real labels
                x = torch.randint(0, 50, (2, 256), generator=g)
                y = torch.randint(0, 50, (2, 256), generator=g)
                keep = torch.zeros(512, dtype=torch.bool)
                keep[torch.randperm(512, generator=g)[:c]] = True
                y[~keep.view(2, 256)] = -100
            else:
                x = torch.randn(c, 10, generator=g, dtype=torch.float64)
                y = torch.randint(0, 5, (c,), generator=g)
            batches.append((x, y))
        out.append(batches)
    return out


def _reference(counts: list[list[int]], tokens: bool) -> dict[str, torch.Tensor]:
    data = case_data(counts, tokens)
    model = _Net(tokens).double()
    x = torch.cat([b[0] for rank in data for b in rank])
    y = torch.cat([b[1] for rank in data for b in rank])
    loss = token_cross_entropy(model(x), y) if tokens else F.cross_entropy(model(x), y)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import warnings

    # The test network returns a view; nothing here modifies it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

    for case, (counts, n_window, tokens) in DISTRIBUTED_CASES.items():
        batches = case_data(counts, tokens)[rank]
        loss_fn = token_cross_entropy if tokens else F.cross_entropy
        for method in _methods(case):
            fsdp = "fsdp" in method
            calls = {"ddp": 0, "step": 0}
            model: nn.Module
            if fsdp:
                from torch.distributed.fsdp import fully_shard

                model = _Net(tokens).double()
                fully_shard(model)
            else:
                model = nn.parallel.DistributedDataParallel(_Net(tokens).double())
                count_ddp_allreduces(model, calls, "ddp")
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            captured: dict[str, torch.Tensor] = {}
            names = [n.removeprefix("module.") for n, _ in model.named_parameters()]

            def capture(
                *_: Any,
                captured: dict[str, torch.Tensor] = captured,
                names: list[str] = names,
                model: nn.Module = model,
            ) -> None:
                for name, p in zip(names, model.parameters(), strict=True):
                    if p.grad is not None:
                        captured[name] = _full(p.grad).detach().clone()

            opt.register_step_pre_hook(capture)
            mid_window_differs = False
            if method == "naive":
                for i, (x, y) in enumerate(batches):
                    (loss_fn(model(x), y) / n_window).backward()
                    if i == 0:
                        mid_window_differs = _grads_differ(model)
                opt.step()
            else:
                sync: Literal["last", "step", "every"] = method.rsplit("_", 1)[1]  # type: ignore[assignment]
                acc = Accumulator(opt, micro_batches=n_window, model=model, sync=sync)
                with count_bigbatch_allreduces(calls, "step"):
                    for i, (x, y) in enumerate(batches):
                        with acc.no_sync():
                            loss = loss_fn(model(x), y)
                            if tokens:
                                acc.backward(loss, labels=y)
                            else:
                                acc.backward(loss, count=len(y))
                        if i == 0 and not fsdp:  # FSDP2 keeps unsynced gradients to itself
                            mid_window_differs = _grads_differ(model)
                        if acc.window_full:
                            acc.step()
                    acc.end_epoch()
            after = [_full(p).detach().clone() for p in model.parameters()]
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, [t.tolist() for t in after])
            if rank == 0:
                torch.save(
                    {
                        "grads": captured,
                        "ddp_allreduces": calls["ddp"],
                        "other_allreduces": calls["step"],
                        "mid_window_differs": mid_window_differs,
                        "ranks_equal_after": all(g == gathered[0] for g in gathered),
                    },
                    Path(out_dir) / f"{case}-{method}.pt",
                )


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("no process group")
    return group


def _methods(case: str) -> list[str]:
    methods = ["bigbatch_sync_last", "bigbatch_sync_step", "naive", "bigbatch_fsdp_every"]
    if case != "ddp_partial_window":  # FSDP2 with sync='last' needs windows that fill
        methods.append("bigbatch_fsdp_last")
    return methods


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2 shards parameters and gradients); a tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def count_ddp_allreduces(
    model: nn.parallel.DistributedDataParallel, calls: dict[str, int], key: str
) -> None:
    """Count in ``calls[key]`` the gradient all-reduces DDP launches (one per bucket)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def counted(calls: dict[str, int]) -> bool:
        calls[key] += 1
        return True

    # DDP checks a hook's annotations, and this module's are strings: a lambda has none.
    model.register_comm_hook(
        calls,
        lambda state, bucket: counted(state) and default_hooks.allreduce_hook(_world(), bucket),
    )


@contextmanager
def count_bigbatch_allreduces(calls: dict[str, int], key: str) -> Iterator[None]:
    """Count in ``calls[key]`` the all-reduces bigbatch itself runs inside (counts, losses,
    and gradients DDP did not synchronise)."""
    original = bbdist.all_reduce_sum

    def counting(*args: Any) -> Any:
        calls[key] += 1
        return original(*args)

    bbdist.all_reduce_sum = counting  # type: ignore[assignment]
    try:
        yield
    finally:
        bbdist.all_reduce_sum = original


def _grads_differ(model: nn.Module) -> bool:
    """Whether this rank's gradient differs from rank 0's (i.e. it was not synchronised)."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    differs = torch.tensor([0.0 if torch.equal(flat, ref) else 1.0], dtype=torch.float64)
    dist.all_reduce(differs)
    return bool(differs.item() > 0)


def verify_distributed(world_size: int = 2) -> list[CaseResult]:
    """Run :data:`DISTRIBUTED_CASES` on ``world_size`` processes; one row per case and method.

    Each row's ``explanation`` also tells the all-reduces of the window and whether gradients
    were synchronised mid-window (they must not be, for bigbatch)."""
    if world_size != 2:
        raise ValueError(
            "the built-in distributed cases hold data for 2 ranks: use --distributed 2"
        )
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_worker, world_size, tmp)
        results = []
        for case, (counts, _, tokens) in DISTRIBUTED_CASES.items():
            ref = _reference(counts, tokens)
            flat_counts = [c for rank in counts for c in rank]
            for method in _methods(case):
                got = torch.load(Path(tmp) / f"{case}-{method}.pt", weights_only=True)
                max_abs, max_rel, groups = compare_gradients(got["grads"], ref)
                tol = TOLERANCES[torch.float64]
                note = (
                    f"{got['ddp_allreduces']} DDP bucket all-reduce(s) + {got['other_allreduces']} "
                    f"bigbatch all-reduce(s) (counts; gradients when not synced by DDP; the epoch's end); gradients synchronised mid-window: "
                    f"{not got['mid_window_differs']}; ranks equal after the step: {got['ranks_equal_after']}"
                )
                if method == "naive" and max_rel > tol:
                    note = (
                        "DDP averages over ranks and loss / N over micro-batches: exact only for equal counts. "
                        + note
                    )
                results.append(
                    CaseResult(
                        case=case,
                        method="naive" if method == "naive" else "bigbatch",
                        dtype=f"float64/{method.removeprefix('bigbatch_')}"
                        if method != "naive"
                        else "float64",
                        micro_batch_counts=flat_counts,
                        max_abs=max_abs,
                        max_rel=max_rel,
                        tolerance=tol,
                        passed=max_rel <= tol and got["ranks_equal_after"],
                        groups=groups,
                        explanation=note,
                    )
                )
        return results
