"""Prove, on a model and data, that accumulated training equals big-batch training.

One window is run twice from identical weights and RNG state: once as a big batch, once as
micro-batches through the real :class:`~bigbatch.Accumulator` step path. The gradients the
optimizer would apply are compared per parameter group. A difference is explained: BatchNorm in
train mode, dropout, or a loss that is not a per-sample (per-token) mean.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.accumulate import Accumulator
from bigbatch.batching import even_sizes, split_by_sizes
from bigbatch.inexact import describe_inexact_layers, find_inexact_layers

__all__ = [
    "TOLERANCES",
    "CaseResult",
    "GroupDiff",
    "builtin_cases",
    "roundoff_tolerance",
    "run_builtin_cases",
    "verify",
    "window_gradients",
]

# bigbatch / naive (loss / N); for coupled losses: cached (gradient caching) / plain; a Hugging
# Face Trainer's own step (bigbatch.integrations.hf.verify_trainer).
Method = Literal["bigbatch", "naive", "cached", "plain", "trainer"]
CountBy = Literal["samples", "tokens"]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Relative tolerance (max |difference| / max |reference|, per parameter group) by dtype. Below
# float64 this is the floor: the tolerance grows with the big batch's own round-off at that
# precision (see roundoff_tolerance), up to ROUNDOFF_CAPS. The floors are a few units in the
# dtype's last place: summing the same terms in another order moves a sum by that much even
# where the big batch's own round-off measured none.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 8 * torch.finfo(torch.float32).eps,  # 9.5e-7
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
}
# Accumulation sums the same terms in another order: its error is of the order of the big
# batch's own distance from float64. This factor leaves room for both errors and their spread.
ROUNDOFF_FACTOR = 4.0
# Beyond these, a difference is not round-off whatever the big batch's own error (which a
# model that draws other random numbers at another precision could inflate).
ROUNDOFF_CAPS: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 2e-2,
}


@dataclass
class GroupDiff:
    group: str  # the top-level module the parameters belong to ("" for the root)
    max_abs: float
    max_rel: float


@dataclass
class CaseResult:
    """One comparison of a window's accumulated gradient with the big-batch gradient."""

    case: str
    method: Method
    dtype: str
    micro_batch_counts: list[int]
    max_abs: float
    max_rel: float
    tolerance: float
    passed: bool
    groups: list[GroupDiff] = field(default_factory=list)
    explanation: str = ""
    # The big batch's own relative distance from float64 at this dtype (0 for float64).
    roundoff: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not -100 (the usual LM loss)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def window_gradients(
    model: nn.Module,
    batches: Sequence[tuple[Any, torch.Tensor]],
    loss_fn: LossFn,
    *,
    method: Method = "bigbatch",
    window: int | None = None,
    count_by: CountBy = "samples",
) -> dict[str, torch.Tensor]:
    """The gradient an optimizer step would apply after accumulating ``batches``.

    ``method="bigbatch"`` runs the real :class:`Accumulator` (weights by count, normalises at
    step time); ``method="naive"`` is the common ``(loss / window).backward()``, where
    ``window`` defaults to the number of micro-batches (give more for a short, partial window).

    >>> import torch
    >>> m = torch.nn.Linear(2, 2)
    >>> data = [(torch.randn(3, 2), torch.tensor([0, 1, 1])), (torch.randn(1, 2), torch.tensor([0]))]
    >>> sorted(window_gradients(m, data, torch.nn.functional.cross_entropy))
    ['bias', 'weight']
    """
    params = dict(model.named_parameters())
    model.zero_grad(set_to_none=True)
    captured: dict[str, torch.Tensor] = {}
    if method == "bigbatch":
        opt = torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=0.0)

        def capture(*_: Any) -> None:
            for name, p in params.items():
                if p.grad is not None:
                    captured[name] = p.grad.detach().clone()

        opt.register_step_pre_hook(capture)
        acc = Accumulator(opt, micro_batches=len(batches))
        for x, y in batches:
            loss = loss_fn(model(x), y)
            if count_by == "tokens":
                acc.backward(loss, labels=y)
            else:
                acc.backward(loss, count=len(y))
        acc.step()
        return captured
    if method == "naive":
        n = window if window is not None else len(batches)
        for x, y in batches:
            (loss_fn(model(x), y) / n).backward()
        out = {name: p.grad.detach().clone() for name, p in params.items() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out
    raise ValueError(f"method must be 'bigbatch' or 'naive', got {method!r}")


def big_batch_gradients(
    model: nn.Module, x: Any, y: torch.Tensor, loss_fn: LossFn
) -> dict[str, torch.Tensor]:
    """The reference: the gradient of the loss over the whole window at once."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    out = {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return out


def compare_gradients(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
) -> tuple[float, float, list[GroupDiff]]:
    """Max absolute and relative (to the group's max |reference|) difference, per top-level group."""
    if set(got) != set(ref):
        missing = sorted(set(ref) ^ set(got))
        raise RuntimeError(f"gradients differ in which parameters have one: {missing[:5]}")
    groups: dict[str, tuple[float, float]] = {}
    for name, r in ref.items():
        diff = float((got[name].double() - r.double()).abs().max()) if r.numel() else 0.0
        scale = float(r.double().abs().max()) if r.numel() else 0.0
        group = name.split(".")[0] if "." in name else ""
        d, s = groups.get(group, (0.0, 0.0))
        groups[group] = (max(d, diff), max(s, scale))
    result = [
        GroupDiff(group=g, max_abs=d, max_rel=(d / s if s > 0 else (0.0 if d == 0 else math.inf)))
        for g, (d, s) in groups.items()
    ]
    max_abs = max((g.max_abs for g in result), default=0.0)
    max_rel = max((g.max_rel for g in result), default=0.0)
    return max_abs, max_rel, result


def roundoff_tolerance(
    rounded: dict[str, torch.Tensor], exact: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[float, float]:
    """(tolerance, round-off) for comparing gradients computed in ``dtype``: ``rounded`` is the
    big batch's gradient in ``dtype``, ``exact`` the same big batch in float64 from the same
    (``dtype``-valued) weights and inputs. The tolerance is ``ROUNDOFF_FACTOR`` times that
    round-off, at least ``TOLERANCES[dtype]`` and at most ``ROUNDOFF_CAPS[dtype]``.

    >>> g = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    >>> exact = {"w": torch.tensor([1.0, 2.0 + 1e-5], dtype=torch.float64)}
    >>> round(roundoff_tolerance(g, exact, torch.float32)[0], 9)
    2e-05
    """
    floor = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    if dtype == torch.float64:
        return floor, 0.0
    _, roundoff, _ = compare_gradients(rounded, exact)
    tol = min(max(floor, ROUNDOFF_FACTOR * roundoff), ROUNDOFF_CAPS.get(dtype, floor))
    return tol, roundoff


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, tuple | list):
        return type(x)(_cast_floats(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast_floats(v, dtype) for k, v in x.items()}
    return x


def verify(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batch_sizes: Sequence[int],
    loss_fn: LossFn = F.cross_entropy,
    *,
    case: str = "user",
    methods: Sequence[Method] = ("bigbatch",),
    dtypes: Sequence[torch.dtype] = (torch.float64,),
    window: int | None = None,
    count_by: CountBy = "samples",
    seed: int = 0,
) -> list[CaseResult]:
    """Compare one accumulated window with the big batch on ``model`` and the data given.

    ``inputs``/``targets`` hold the whole window; ``micro_batch_sizes`` splits it (the sizes
    must add up to its length). The model is copied, never changed. When bigbatch's result
    differs, the explanation names the cause and, for BatchNorm or dropout, shows that the
    difference disappears with those layers in eval mode.

    >>> import torch
    >>> r = verify(torch.nn.Linear(4, 3), torch.randn(10, 4), torch.randint(0, 3, (10,)), [4, 4, 2])
    >>> r[0].passed
    True
    """
    n = int(targets.shape[0])
    sizes = [int(s) for s in micro_batch_sizes]
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(
            f"micro_batch_sizes must be positive integers, got {list(micro_batch_sizes)}"
        )
    if sum(sizes) != n:
        raise ValueError(
            f"micro_batch_sizes add up to {sum(sizes)} but the batch has {n} samples; "
            f"give sizes that split the batch, e.g. {even_sizes(n, len(sizes))}"
        )
    results = []
    for dtype in dtypes:
        base = copy.deepcopy(model).to(dtype)
        x = _cast_floats(inputs, dtype)
        ref = _seeded(seed, partial(big_batch_gradients, base, x, targets, loss_fn))
        tol, roundoff = _tolerance(base, x, targets, loss_fn, ref, seed)
        batches = list(zip(split_by_sizes(x, sizes), split_by_sizes(targets, sizes), strict=True))
        counts = [int((y != -100).sum()) if count_by == "tokens" else len(y) for _, y in batches]
        for method in methods:
            run = partial(
                window_gradients,
                base,
                batches,
                loss_fn,
                method=method,
                window=window,
                count_by=count_by,
            )
            got = _seeded(seed, run)
            max_abs, max_rel, groups = compare_gradients(got, ref)
            passed = max_rel <= tol
            explanation = ""
            if not passed:
                explanation = _explain(
                    base, x, targets, sizes, loss_fn, method, window, count_by, seed, tol
                )
            results.append(
                CaseResult(
                    case=case,
                    method=method,
                    dtype=str(dtype).replace("torch.", ""),
                    micro_batch_counts=counts,
                    max_abs=max_abs,
                    max_rel=max_rel,
                    tolerance=tol,
                    passed=passed,
                    groups=groups,
                    explanation=explanation,
                    roundoff=roundoff,
                )
            )
    return results


def _tolerance(
    model: nn.Module,
    x: Any,
    y: torch.Tensor,
    loss_fn: LossFn,
    ref: dict[str, torch.Tensor],
    seed: int,
) -> tuple[float, float]:
    """(tolerance, round-off) at the model's precision: below float64, the same big batch in
    float64 from the same rounded weights and inputs says how far this precision itself is from
    exact, which bounds what accumulation can reach."""
    dtype = next((p.dtype for p in model.parameters()), torch.float64)
    if dtype == torch.float64:
        return TOLERANCES[torch.float64], 0.0
    wide, x64 = copy.deepcopy(model).double(), _cast_floats(x, torch.float64)
    exact = _seeded(seed, partial(big_batch_gradients, wide, x64, y, loss_fn))
    return roundoff_tolerance(ref, exact, dtype)


def _explain(
    model: nn.Module,
    x: Any,
    y: torch.Tensor,
    sizes: list[int],
    loss_fn: LossFn,
    method: Method,
    window: int | None,
    count_by: CountBy,
    seed: int,
    tol: float,
) -> str:
    if method == "naive":
        return (
            "loss / N weights every micro-batch equally; the big batch weights each by its "
            "count. Exact only when all micro-batches have the same count."
        )
    dtype = next((p.dtype for p in model.parameters()), torch.float64)
    if dtype != torch.float64:
        # Measured, not assumed: the same window in float64 separates round-off from the rest.
        wide = copy.deepcopy(model).double()
        x64 = _cast_floats(x, torch.float64)
        ref = _seeded(seed, lambda: big_batch_gradients(wide, x64, y, loss_fn))
        batches = list(zip(split_by_sizes(x64, sizes), split_by_sizes(y, sizes), strict=True))
        got = _seeded(
            seed,
            lambda: window_gradients(wide, batches, loss_fn, method=method, count_by=count_by),
        )
        _, rel64, _ = compare_gradients(got, ref)
        if rel64 <= TOLERANCES[torch.float64]:
            return (
                f"In float64 the same window agrees to {rel64:.1e}: the difference is "
                f"{str(dtype).replace('torch.', '')} round-off, larger than the big batch's own "
                "at this precision (summation order, an ill-conditioned layer); it is not the "
                "loss or the layers. Train in float64 to confirm, or accept it."
            )
    if getattr(loss_fn, "couples_samples", False):
        name = getattr(loss_fn, "__name__", "the loss")
        return (
            f"{name} couples the samples of a batch (it declares couples_samples): its value on "
            "the micro-batches is not its value on the big batch, whatever the weights, so no "
            "accumulation can be exact. Use a per-sample form (for Dice: "
            "bigbatch.segmentation.losses.dice_loss, averaged over samples)."
        )
    layers = find_inexact_layers(model)
    if layers:
        text = describe_inexact_layers(layers)
        quiet = copy.deepcopy(model)
        for name, module in quiet.named_modules():
            if any(layer.name == name for layer in layers):
                module.eval()
        ref = _seeded(seed, lambda: big_batch_gradients(quiet, x, y, loss_fn))
        batches = list(zip(split_by_sizes(x, sizes), split_by_sizes(y, sizes), strict=True))
        got = _seeded(seed, lambda: window_gradients(quiet, batches, loss_fn, count_by=count_by))
        _, rel, _ = compare_gradients(got, ref)
        verdict = "so they explain the difference" if rel <= tol else "but a difference remains"
        return f"{text} With those layers in eval mode the relative difference is {rel:.1e}, {verdict}."
    return (
        "No BatchNorm or dropout is active, so the loss is probably not a mean of per-sample "
        "(or per-token) terms: a loss that couples the samples of a batch (in-batch negatives, "
        "normalising by batch statistics, a ranking loss) cannot be split into micro-batches. "
        "Check that loss_fn averages over samples and that count= says how many it averaged."
    )


def _seeded(seed: int, fn: Callable[[], Any]) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


# ----------------------------------------------------------------- built-in cases
@dataclass(frozen=True)
class BuiltinCase:
    name: str
    sizes: tuple[int, ...]  # samples per micro-batch (or real tokens per micro-batch)
    window: int  # micro-batches per window (the naive divisor)
    tokens: bool = False
    description: str = ""


def builtin_cases() -> list[BuiltinCase]:
    """The cases ``bigbatch verify`` runs with no model: where ``loss / N`` goes wrong."""
    return [
        BuiltinCase("equal", (16, 16, 16, 16), 4, description="four equal micro-batches"),
        BuiltinCase("uneven_last", (16, 16, 4), 3, description="last window of an epoch: 16+16+4"),
        BuiltinCase("half_window", (16, 16), 4, description="a window of 4 cut short after 2"),
        BuiltinCase("mixed", (4, 12, 16, 32), 4, description="micro-batches of 4, 12, 16, 32"),
        BuiltinCase(
            "tokens_padding",
            (8, 40, 120, 420),
            4,
            tokens=True,
            description="token loss, real tokens 8, 40, 120, 420 of 512 slots each (rest padding)",
        ),
    ]


class _TokenModel(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, 32), nn.Tanh())
        self.head = nn.Linear(32, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(tokens)))


def _builtin_data(
    case: BuiltinCase, seed: int
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if not case.tokens:
        model: nn.Module = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 5))
        n = sum(case.sizes)
        return (
            model,
            torch.randn(n, 10, generator=g),
            torch.randint(0, 5, (n,), generator=g),
            list(case.sizes),
        )
    # Each micro-batch: 4 sequences x 128 slots; only the first `real` labels are not padding.
    seqs, length, vocab = 4, 128, 50
    tokens, labels = [], []
    for real in case.sizes:
        t = torch.randint(0, vocab, (seqs, length), generator=g)
        lab = torch.randint(0, vocab, (seqs, length), generator=g)
        mask = torch.zeros(seqs * length, dtype=torch.bool)
        mask[torch.randperm(seqs * length, generator=g)[:real]] = True
        lab[~mask.view(seqs, length)] = -100
        tokens.append(t)
        labels.append(lab)
    return _TokenModel(vocab), torch.cat(tokens), torch.cat(labels), [seqs] * len(case.sizes)


def run_builtin_cases(
    *,
    methods: Sequence[Method] = ("bigbatch", "naive"),
    dtypes: Sequence[torch.dtype] = (torch.float64, torch.float32),
    seed: int = 0,
) -> list[CaseResult]:
    """Run :func:`builtin_cases` with bigbatch and the naive ``loss / N`` side by side."""
    results = []
    for case in builtin_cases():
        model, x, y, sizes = _builtin_data(case, seed)
        results += verify(
            model,
            x,
            y,
            sizes,
            token_cross_entropy if case.tokens else F.cross_entropy,
            case=case.name,
            methods=methods,
            dtypes=dtypes,
            window=case.window,
            count_by="tokens" if case.tokens else "samples",
            seed=seed,
        )
    return results
