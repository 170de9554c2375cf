"""What a CUDA training process holds besides its tensors: the libraries' workspaces (inside the
caching allocator) and the context (outside it).

Measured on an NVIDIA H100 80GB with CUDA 13.0, cuDNN 9.19 and torch 2.11 (the allocator traces
in ``tests/memory/data/gpu_truth``), one process alone on the card, ``mem_get_info`` stage by
stage:

- CUDA initialisation: 621 MiB;
- the first cuBLAS call of a thread: a handle (64 MiB outside the allocator) and one 32 MiB
  workspace, which cuBLAS and cuBLASLt share, taken from the caching allocator. The backward
  runs on autograd's own thread, so a backward that multiplies matrices makes a second handle
  and a second workspace (seen in every trace whose model has a matmul; not in the 3D U-Net's);
- the first cuDNN convolution: 8 MiB;
- kernels loaded lazily as the model first runs them: about 10 MiB more after training.

So a process holds 703 MiB besides the allocator's segments (the U-Net: 702.8 measured), 767
MiB where its backward calls cuBLAS (758.8-772.8 measured). These figures differ by GPU, driver
and CUDA version: where a GPU is present the context is measured (:func:`measured_context_bytes`);
where none is, these defaults stand, and ``--overhead`` / ``overhead=`` overrides them.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import torch

from bigbatch.memory.cuda_cudnn import CudnnProfile, Signature, profile_for_target, signature_of
from bigbatch.memory.cuda_reduce import reduction_staging

__all__ = [
    "CUBLAS_HANDLE_BYTES",
    "CUBLAS_OPS",
    "CUDA_CONTEXT_BYTES",
    "ConvPass",
    "CudaLibraries",
    "conv_passes",
    "cublas_workspace_bytes",
    "cudnn_workspaces",
    "measured_context_bytes",
]

MiB = 2**20
CUDA_INIT_BYTES = 621 * MiB
CUBLAS_HANDLE_BYTES = 64 * MiB
CUDNN_HANDLE_BYTES = 8 * MiB
LAZY_KERNEL_BYTES = 10 * MiB
# The main thread's context: CUDA, one cuBLAS handle, cuDNN, the kernels a step loads.
CUDA_CONTEXT_BYTES = CUDA_INIT_BYTES + CUBLAS_HANDLE_BYTES + CUDNN_HANDLE_BYTES + LAZY_KERNEL_BYTES

# The aten ops that call cuBLAS on a CUDA device (a thread's first one creates its handle and
# workspace).
CUBLAS_OPS = frozenset(
    f"aten.{op}.default"
    for op in [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addmv",
        "mv",
        "dot",
        "vdot",
        "addbmm",
        "_addmm_activation",
    ]
)


def cublas_workspace_bytes() -> int:
    """One cuBLAS handle's workspace, taken from the caching allocator: ``CUBLASLT_WORKSPACE_SIZE``
    (KiB) where set, else 32 MiB (Hopper's size; 1-4 MiB on older cards, so the default errs
    high there).

    >>> cublas_workspace_bytes() // MiB if "CUBLASLT_WORKSPACE_SIZE" not in os.environ else 32
    32
    """
    kib = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "")
    return int(kib) * 1024 if kib.isdigit() else 32 * MiB


def measured_context_bytes(device: torch.device | str = "cuda") -> int:
    """This process's memory on ``device`` outside the caching allocator, after a matmul and a
    convolution have made the cuBLAS and cuDNN handles, plus the kernels a training step will
    still load (:data:`LAZY_KERNEL_BYTES`). Counts what other processes hold on the card too:
    pass an overhead where the card is shared."""
    device = torch.device(device)
    with torch.device(device):
        a = torch.ones(64, 64)
        (a @ a).sum().item()
        x = torch.ones(1, 1, 8, 8)
        torch.nn.functional.conv2d(x, torch.ones(1, 1, 3, 3)).sum().item()
        del a, x
    from bigbatch.device import card_memory  # device.py imports bigbatch.memory

    card = card_memory(device)
    if card is None:
        raise ValueError(f"the CUDA context is measured on a CUDA device, not {device}")
    return card[1] + LAZY_KERNEL_BYTES


# cuDNN's 16-bit convolutions on NCHW tensors run NHWC tensor-core kernels on transposed copies
# of their operands, in a workspace that is freed when the kernel is done: the bytes of every
# operand whose two layouts differ, plus 16 (the traces: resnet18's forward and data-gradient
# workspaces, to the byte). Where a channel count is not a multiple of 8 (an RGB input), there
# is no tensor-core kernel and no such copy.
_CUDNN_EXTRA = 16


def _layouts_differ(t: torch.Tensor) -> bool:
    """Whether a conv operand's NCHW and NHWC layouts differ (more than one channel and more
    than one position; a 1x1 kernel's weight is the same in both)."""
    return t.dim() >= 3 and t.shape[1] > 1 and math.prod(t.shape[2:]) > 1


def _tensor_core(*channels: int) -> bool:
    return all(c % 8 == 0 for c in channels)


class ConvPass(NamedTuple):
    """One pass of a convolution as cuDNN runs it: its name (``forward``, ``data_grad``,
    ``weight_grad``), what keys PyTorch's cache of chosen algorithms (shapes, strides, dtype,
    layout: a new key is benchmarked), the profile's signature (None where it measures no such
    convolution) and the batch."""

    name: str
    key: tuple[Any, ...]
    sig: Signature | None
    batch: int
    workspace: int  # the chosen algorithm's workspace bytes (0: none)


def conv_passes(
    func: str,
    args: tuple[Any, ...],
    out: Any,
    profile: CudnnProfile | None = None,
    benchmark: bool = False,
) -> list[ConvPass]:
    """The cuDNN passes of one convolution op (forward, or backward: the input's gradient, then
    the weight's), each with the workspace ``profile`` measured for its signature, else the rule
    above, which gives none to 32-bit tensors, grouped convolutions and channels-last inputs (no
    copy needed); ``[]`` for other ops."""
    if func not in ("aten.convolution.default", "aten.convolution_backward.default"):
        return []
    if func == "aten.convolution.default":
        x, w, conv = args[0], args[1], args[3:9]
        passes = [("forward", (x, w, out))]
    else:
        grad_out, x, w, conv = args[0], args[1], args[2], args[4:10]
        grad_x, grad_w = out[0], out[1]
        passes = [("data_grad", (grad_out, w, grad_x))] if grad_x is not None else []
        passes += [("weight_grad", (grad_out, x, grad_w))] if grad_w is not None else []
    groups = conv[-1]
    by_rule = (
        groups == 1
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.is_contiguous()
        and _tensor_core(w.shape[0], w.shape[1])
    )
    sig = signature_of(x, w, conv, benchmark) if profile is not None else None
    key = (
        tuple(x.shape),
        tuple(w.shape),
        x.dtype,
        x.is_contiguous(),
        tuple(tuple(a) if isinstance(a, list | tuple) else a for a in conv),
    )
    result = []
    for name, trio in passes:
        measured = profile.workspace(sig, name, x.shape[0]) if profile and sig else None
        if profile is not None:
            profile.counts["rule" if measured is None else "profile"] += 1
        if measured is None and by_rule:
            measured = sum(t.numel() * t.element_size() for t in trio if _layouts_differ(t))
            measured += _CUDNN_EXTRA
        result.append(ConvPass(name, (name, *key), sig, int(x.shape[0]), measured or 0))
    return result


def cudnn_workspaces(
    func: str, args: tuple[Any, ...], out: Any, profile: CudnnProfile | None = None
) -> list[int]:
    """The transient workspaces cuDNN takes for one convolution op (:func:`conv_passes`'),
    those of zero bytes left out."""
    return [p.workspace for p in conv_passes(func, args, out, profile) if p.workspace]


class CudaLibraries:
    """What cuBLAS and cuDNN add to a traced CUDA step's allocations, as allocator events:
    the main thread's cuBLAS workspace from the start (a training process's first matmul makes
    it), autograd's thread's handle and workspace at the backward's first matmul, and cuDNN's
    transient convolution workspaces, and the reduction kernel's staging buffers.

    In cuDNN's benchmark mode (``benchmark``), the first pass of each new convolution key also
    tries every algorithm: PyTorch allocates one workspace as large as the largest any of them
    asks for (halved until it fits where memory is short), frees it, and empties the allocator's
    cache before running the fastest (``aten/src/ATen/native/cudnn/Conv_v8.cpp``). So the event
    stream gets a ``("trial", key, bytes)`` where the profile measured the trial (the allocator
    model halves it under a limit), and an ``("empty_cache", None, 0)`` in every case: replaying
    the recorded traces of benchmark-mode steps with their cache emptied there gives their
    reserved peaks to the byte (``tests/memory/test_gpu_truth.py``).

    >>> libraries = CudaLibraries(benchmark=True)
    >>> x = torch.empty(8, 64, 56, 56, dtype=torch.float16, device="meta")
    >>> w = torch.empty(64, 64, 3, 3, dtype=torch.float16, device="meta")
    >>> conv = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    >>> for _ in range(2):  # the first call tries the algorithms (its trial not profiled here)
    ...     [e[0] for e in libraries.after("aten.convolution.default", conv, torch.empty_like(x))]
    ['empty_cache', 'malloc', 'free']
    ['malloc', 'free']
    """

    def __init__(self, benchmark: bool = False) -> None:
        self.autograd_blas = False
        self.benchmark = benchmark
        self._transients = 0
        self._tried: set[tuple[Any, ...]] = set()
        self.trials = {"measured": 0, "unmeasured": 0}
        self.cudnn_profile = profile_for_target()

    def start(self) -> list[tuple[str, Any, int]]:
        return [("malloc", "cublas:main", cublas_workspace_bytes())]

    def before(self, func: str, phase: str) -> list[tuple[str, Any, int]]:
        if self.autograd_blas or phase != "backward" or func not in CUBLAS_OPS:
            return []
        self.autograd_blas = True
        return [("malloc", "cublas:autograd", cublas_workspace_bytes())]

    def after(self, func: str, args: tuple[Any, ...], out: Any) -> list[tuple[str, Any, int]]:
        events: list[tuple[str, Any, int]] = []
        for conv in conv_passes(func, args, out, self.cudnn_profile, self.benchmark):
            if self.benchmark and conv.key not in self._tried:
                self._tried.add(conv.key)
                events += self._trial(conv)
            if conv.workspace:
                self._transients += 1
                key = ("cudnn", self._transients)
                events += [("malloc", key, conv.workspace), ("free", key, 0)]
        # A reduction's staging buffer and semaphores, both alive until the kernel is queued.
        staged = []
        for size in reduction_staging(func, args):
            self._transients += 1
            staged.append(("reduce", self._transients))
            events.append(("malloc", staged[-1], size))
        events += [("free", key, 0) for key in reversed(staged)]
        return events

    def _trial(self, conv: ConvPass) -> list[tuple[str, Any, int]]:
        """Benchmark mode's trial of ``conv``'s algorithms: its workspace, then the emptied
        cache."""
        size = None
        if self.cudnn_profile is not None and conv.sig is not None:
            size = self.cudnn_profile.trial(conv.sig, conv.name, conv.batch)
        self.trials["unmeasured" if size is None else "measured"] += 1
        events: list[tuple[str, Any, int]] = []
        if size:
            self._transients += 1
            key = ("trial", self._transients)
            events += [("trial", key, size), ("free", key, 0)]
        return [*events, ("empty_cache", None, 0)]

    def cudnn_note(self) -> str:
        """Where the convolutions' workspaces came from (the profile, the rule), or ""."""
        return self.cudnn_profile.note() if self.cudnn_profile is not None else ""

    def trials_note(self) -> str:
        """What the prediction lacks of benchmark mode's trials, or ""."""
        measured, unmeasured = self.trials["measured"], self.trials["unmeasured"]
        if not unmeasured:
            return ""
        return (
            f"cuDNN benchmark mode: the trials of {unmeasured} of {measured + unmeasured} "
            "convolution passes are not in this card's profile (on the first step they take "
            "only free memory: the plan does not need them)"
        )

    @property
    def workspace_bytes(self) -> int:
        """The cuBLAS workspaces held (cuDNN's are transient)."""
        return cublas_workspace_bytes() * (1 + self.autograd_blas)

    @property
    def handle_bytes(self) -> int:
        """Outside the allocator: autograd's thread's cuBLAS handle, where it made one."""
        return CUBLAS_HANDLE_BYTES * self.autograd_blas
