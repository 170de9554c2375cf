"""cuDNN's convolution workspaces as a card measured them: a profile per GPU architecture and
cuDNN version, read by the CUDA memory model before its rule.

cuDNN picks a convolution's algorithm by heuristics that depend on the whole signature (dtype,
layout, kernel, channels, stride, size, batch), and each algorithm takes its own scratch
memory: the recorded traces show 1x1 convolutions copying their operands at 7 px and not at
56 px, and weight gradients taking a few MiB more than the forward. No one rule holds, so
``benchmarks/cudnn_workspaces.py`` records, on a card, what each signature's forward, data
gradient and weight gradient allocate beyond their outputs; ``--package`` stores that here
(``cudnn_profiles/sm<major><minor>-cudnn<version>.json``).

A convolution whose signature the profile holds gets its measured workspace, interpolated
linearly in the batch between two measured batches (its layout copies grow with the batch);
any other falls back to the transposed-copy rule of :mod:`bigbatch.memory.cuda_runtime`, and
the prediction says how many did (:attr:`CudnnProfile.counts`).

>>> profile = CudnnProfile.from_rows([{"dtype": "float16", "layout": "nchw", "kernel": 3,
...     "groups": 1, "channels": 64, "size": 56, "batch": b, "benchmark": False,
...     "pass": "forward", "extra_bytes": 1000 * b} for b in (8, 64)], "test card")
>>> sig = Signature("float16", "nchw", 3, 1, 64, 64, 1, 1, 56, False)
>>> profile.workspace(sig, "forward", 32)
32000
>>> profile.workspace(sig, "forward", 128) is None  # outside what was measured: the rule's
True
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["CudnnProfile", "Signature", "profile_for_target", "with_defaults"]

PROFILES = Path(__file__).with_name("cudnn_profiles")


def with_defaults(row: dict[str, Any]) -> dict[str, Any]:
    """A sweep's row or signature with what the first sweep's grid rows leave out filled in:
    as many outputs as inputs, stride 1, "same" padding, 2D, not transposed.

    >>> with_defaults({"channels": 64, "kernel": 3})["padding"]
    1
    """
    defaults = {"out_channels": row["channels"], "stride": 1, "padding": row["kernel"] // 2}
    return defaults | {"dims": 2, "transposed": False, "output_padding": 0} | row


class Signature(NamedTuple):
    """A convolution as the profile keys it, the batch aside: square (2D) or cubic (3D)
    kernels, inputs, strides and paddings."""

    dtype: str  # "float16", "bfloat16", "float32"
    layout: str  # "nchw" (contiguous) or "nhwc" (channels last)
    kernel: int
    groups: int
    in_channels: int
    out_channels: int
    stride: int
    padding: int
    size: int  # the input's height (and width, and depth)
    benchmark: bool  # cuDNN's benchmark mode
    dims: int = 2  # 2 or 3 spatial dimensions
    transposed: bool = False
    output_padding: int = 0  # a transposed convolution's


@dataclass
class CudnnProfile:
    """One card's measured workspaces, by signature, pass and batch."""

    card: str
    allow_tf32: bool = True  # float32 rows were measured on TF32 kernels
    rows: dict[tuple[Signature, str], dict[int, int]] = field(default_factory=dict)
    counts: dict[str, int] = field(
        default_factory=lambda: {"profile": 0, "rule": 0, "without_benchmark": 0}
    )

    @classmethod
    def from_rows(
        cls, rows: list[dict[str, Any]], card: str, allow_tf32: bool = True
    ) -> CudnnProfile:
        """From ``benchmarks/cudnn_workspaces.py``'s rows (one per signature, pass, batch)."""
        profile = cls(card, allow_tf32)
        for r in map(with_defaults, rows):
            sig = Signature(
                r["dtype"],
                r["layout"],
                r["kernel"],
                r["groups"],
                r["channels"],
                r["out_channels"],
                r["stride"],
                r["padding"],
                r["size"],
                r["benchmark"],
                r["dims"],
                r["transposed"],
                r["output_padding"],
            )
            profile.rows.setdefault((sig, r["pass"]), {})[r["batch"]] = r["extra_bytes"]
        return profile

    @classmethod
    def load(cls, path: Path) -> CudnnProfile:
        """A packaged profile: ``columns`` once and a list per row."""
        data = json.loads(path.read_text())
        rows = [dict(zip(data["columns"], row, strict=True)) for row in data["rows"]]
        card = f"{data['device']}, cuDNN {data['cudnn']}"
        return cls.from_rows(rows, card, data.get("allow_tf32", True))

    def workspace(self, sig: Signature, pass_: str, batch: int) -> int | None:
        """The measured workspace bytes of ``pass_`` at ``batch``, or None where the profile
        does not hold the signature or the batch is outside the measured ones."""
        if sig.dtype == "float32" and torch.backends.cudnn.allow_tf32 != self.allow_tf32:
            return None  # other kernels than the ones measured
        by_batch = self.rows.get((sig, pass_))
        if not by_batch and sig.benchmark and not pass_.endswith("_trial"):
            # Benchmark mode times the algorithms the heuristics rank and mostly keeps the
            # same one: the recorded ResNet-50 steps' workspaces with and without it differ by
            # under 1 % in all (3289 and 3316 MiB over a step's 105 of 1 MiB or more).
            by_batch = self.rows.get((sig._replace(benchmark=False), pass_))
            self.counts["without_benchmark"] += bool(by_batch)
        if not by_batch:
            return None
        if batch in by_batch:
            return by_batch[batch]
        below = [b for b in by_batch if b < batch]
        above = [b for b in by_batch if b > batch]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        return round(by_batch[lo] + (by_batch[hi] - by_batch[lo]) * (batch - lo) / (hi - lo))

    def trial(self, sig: Signature, pass_: str, batch: int) -> int | None:
        """The workspace cuDNN's benchmark mode allocates to try ``pass_``'s algorithms (the
        largest any of them asks for, with the card's memory free), as the sweep measured it
        on the first call (its ``forward_trial``, ``data_grad_trial`` and ``weight_grad_trial``
        rows); None where it did not."""
        return self.workspace(sig, f"{pass_}_trial", batch) if sig.benchmark else None

    def note(self) -> str:
        """What the prediction says of its convolutions ("" where it had none)."""
        measured, rule = self.counts["profile"], self.counts["rule"]
        if not measured + rule:
            return ""
        without = self.counts["without_benchmark"]
        aside = f" ({without} measured without benchmark mode)" if without else ""
        return (
            f"cuDNN workspaces: {measured} of {measured + rule} convolution passes from the "
            f"card profile ({self.card}){aside}, the rest by the transposed-copy rule"
        )


def signature_of(
    x: torch.Tensor, w: torch.Tensor, conv: tuple[Any, ...], benchmark: bool = False
) -> Signature | None:
    """The profile's key for a convolution of ``x`` by ``w`` with aten's ``conv`` arguments
    (stride, padding, dilation, transposed, output padding, groups), in cuDNN's benchmark mode
    or not; None where the sweep measures no such convolution (neither 2D nor 3D, not square or
    cubic, or dilated)."""
    stride, padding, dilation, transposed, output_padding, groups = conv
    spatial, kernel = set(x.shape[2:]), set(w.shape[2:])
    if x.dim() not in (4, 5) or len(spatial) != 1 or len(kernel) != 1:
        return None
    same = (set(stride), set(padding), set(output_padding) or {0})
    if any(len(values) != 1 for values in same) or set(dilation) != {1}:
        return None
    # A transposed convolution's weight is (in, out / groups, ...), a convolution's the reverse.
    out_channels = w.shape[1] * groups if transposed else w.shape[0]
    return Signature(
        str(x.dtype).removeprefix("torch."),
        "nchw" if x.is_contiguous() else "nhwc",
        int(w.shape[-1]),
        int(groups),
        int(x.shape[1]),
        int(out_channels),
        int(stride[0]),
        int(padding[0]),
        int(x.shape[-1]),
        benchmark,
        x.dim() - 2,
        bool(transposed),
        int(output_padding[0]) if transposed else 0,
    )


@functools.cache
def _load(path: Path) -> CudnnProfile:
    return CudnnProfile.load(path)


@functools.cache
def _installed() -> dict[str, Path]:
    """The packaged profiles by name (``sm90-cudnn91900``), listed once: every CUDA prediction
    asks, and a plan makes many."""
    return {p.stem: p for p in PROFILES.glob("*.json")}


def _choose(installed: list[str], architecture: str | None, cudnn: int | None) -> str | None:
    """Among the packaged profiles' names (``sm90-cudnn91900``), the one for this card: its
    architecture and cuDNN version, else its architecture's newest cuDNN; with no card at hand
    (``architecture`` None), sm90's, the card the traces, the rule and the CUDA context come
    from. None where the architecture was never measured.

    >>> _choose(["sm90-cudnn91900", "sm80-cudnn91900"], "sm80", 90800)
    'sm80-cudnn91900'
    >>> _choose(["sm90-cudnn91900"], "sm75", 91900) is None
    True
    """
    if f"{architecture}-cudnn{cudnn}" in installed:
        return f"{architecture}-cudnn{cudnn}"
    same = [n for n in installed if n.startswith(f"{architecture or 'sm90'}-cudnn")]
    return max(same, key=lambda n: int(n.rsplit("cudnn", 1)[1]), default=None)


def profile_for_target() -> CudnnProfile | None:
    """The packaged profile for the card predicted for (:func:`_choose`: the GPU at hand's,
    else sm90's), a copy of its own to count one prediction's convolutions; None where none
    fits."""
    architecture = cudnn = None
    if torch.cuda.is_available():
        architecture = "sm{}{}".format(*torch.cuda.get_device_capability())
        cudnn = torch.backends.cudnn.version()
    name = _choose(sorted(_installed()), architecture, cudnn)
    if name is None:
        return None
    shared = _load(_installed()[name])
    return CudnnProfile(shared.card, shared.allow_tf32, shared.rows)
