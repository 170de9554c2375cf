"""Reference runs for the equivalence tests: big batch, bigbatch, and the naive ``loss / N``.

Every run starts from the same weights (``make_model(seed)``) and walks the same data in the
same order; they differ only in how the gradient of a window is formed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch import Accumulator

OptFactory = Callable[[Any], torch.optim.Optimizer]


def make_model(seed: int = 0, dtype: torch.dtype = torch.float64, width: int = 24) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 4)).to(dtype)


def make_data(
    n: int, seed: int = 1, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def sgd(params: Any) -> torch.optim.Optimizer:
    # Momentum makes the result depend on every step's scale, so a wrong scale cannot hide.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def split(
    x: torch.Tensor, y: torch.Tensor, sizes: Sequence[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if sum(sizes) != len(y):
        raise ValueError(f"sizes {sizes} do not split {len(y)} samples")
    return list(zip(torch.split(x, list(sizes)), torch.split(y, list(sizes)), strict=True))


def windows_of(epoch: Sequence[Any], sizes_per_window: Sequence[int]) -> list[list[Any]]:
    """Group micro-batches into windows of the given numbers of micro-batches."""
    out, i = [], 0
    for k in sizes_per_window:
        out.append(list(epoch[i : i + k]))
        i += k
    if i != len(epoch):
        raise ValueError("windows do not cover the epoch")
    return out


def big_batch_run(
    model: nn.Module,
    windows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    opt_factory: OptFactory = sgd,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    *,
    clip: float | None = None,
    scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> nn.Module:
    """One optimizer step per window on the concatenated window: the reference."""
    opt = opt_factory(model.parameters())
    sched = scheduler_factory(opt) if scheduler_factory else None
    for window in windows:
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        loss_fn(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return model


def naive_run(
    model: nn.Module,
    windows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    n: int,
    opt_factory: OptFactory = sgd,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    *,
    clip: float | None = None,
    scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> nn.Module:
    """The usual accumulation: ``(loss / n).backward()`` per micro-batch, step per window."""
    opt = opt_factory(model.parameters())
    sched = scheduler_factory(opt) if scheduler_factory else None
    for window in windows:
        for x, y in window:
            (loss_fn(model(x), y) / n).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return model


def bigbatch_run(
    model: nn.Module,
    epochs: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    opt_factory: OptFactory = sgd,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    *,
    count: Callable[[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]] = lambda b: {
        "count": len(b[1])
    },
    **acc_kwargs: Any,
) -> tuple[nn.Module, Accumulator]:
    """Epochs of micro-batches through the Accumulator, stepping when the window is full."""
    opt = opt_factory(model.parameters())
    sched_factory = acc_kwargs.pop("scheduler_factory", None)
    if sched_factory is not None:
        acc_kwargs["scheduler"] = sched_factory(opt)
    acc = Accumulator(opt, **acc_kwargs)
    for epoch in epochs:
        for batch in epoch:
            acc.backward(loss_fn(model(batch[0]), batch[1]), **count(batch))
            if acc.window_full:
                acc.step()
        acc.end_epoch()
    return model, acc


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest parameter difference relative to that parameter's largest magnitude."""
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        d = float((p.detach().double() - q.detach().double()).abs().max())
        s = float(q.detach().double().abs().max())
        worst = max(worst, d / s if s else d)
    return worst


def update_rel_diff(start: nn.Module, a: nn.Module, b: nn.Module) -> float:
    """Difference of the updates (a - start) and (b - start), relative to b's update."""
    worst = 0.0
    for p0, p, q in zip(start.parameters(), a.parameters(), b.parameters(), strict=True):
        da = p.detach().double() - p0.detach().double()
        db = q.detach().double() - p0.detach().double()
        s = float(db.abs().max())
        worst = max(worst, float((da - db).abs().max()) / s if s else float((da - db).abs().max()))
    return worst


def roundoff_tol(rounded: Sequence[torch.Tensor], exact: Sequence[torch.Tensor]) -> float:
    """The tolerance of a float32 equivalence check: a multiple of the float32 big batch's own
    distance from the float64 big batch (``rounded`` and ``exact``: the same gradients or
    updates in both), never below 8 units in
    float32's last place (``bigbatch.verify.roundoff_tolerance``)."""
    from bigbatch.verify import roundoff_tolerance

    def named(ts: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {str(i): t.detach() for i, t in enumerate(ts)}

    return roundoff_tolerance(named(rounded), named(exact), torch.float32)[0]


def write_hub_cache(root: Any, repo_id: str, state: dict[str, torch.Tensor]) -> Any:
    """A Hugging Face hub cache under ``root`` holding ``repo_id``'s ``model.safetensors``
    (what timm's pretrained=True reads offline); returns ``root``."""
    from pathlib import Path

    from safetensors.torch import save_file

    repo = Path(root) / ("models--" + repo_id.replace("/", "--"))
    sha = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    (repo / "snapshots" / sha).mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(repo / "snapshots" / sha / "model.safetensors"),
    )
    return root


def window_gradients(
    model: nn.Module,
    window: Any,
    step: Callable[[Any], Any],
    micro_batch: int,
    *,
    split: Callable[[Any, int, int], list[Any]] | None = None,
    equal_weights: bool = False,
) -> list[torch.Tensor]:
    """The gradient ``run_window`` steps with for ``window`` at ``micro_batch`` (``step(micro)``
    returns ``(loss, count)`` or a loss); ``equal_weights``: each micro-batch's mean weighed
    the same, the naive ``loss / N``."""
    from bigbatch import OOMBackoff, run_window

    grads: list[torch.Tensor] = []

    class Keep(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # the window's gradient, as stepped
            grads.extend(p.grad.clone() for p in model.parameters())  # type: ignore[union-attr]

    acc = Accumulator(Keep(model.parameters(), lr=0.1))
    if equal_weights:

        def loss_only(micro: Any) -> Any:
            out = step(micro)
            return out[0] if isinstance(out, tuple) else out

        count_one = {"count": 1}
        run_window(
            acc,
            window,
            loss_only,
            OOMBackoff(micro_batch),
            count_fn=lambda m: count_one,
            split=split,
        )
    else:
        run_window(acc, window, step, OOMBackoff(micro_batch), split=split)
    return grads


def right_padded(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collator for token rows: right-pads to the batch's longest sequence (pad id 0, label
    -100, attention mask 0)."""
    longest = max(len(i["input_ids"]) for i in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = item["input_ids"], item["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
