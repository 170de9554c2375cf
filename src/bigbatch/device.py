"""What bigbatch knows about devices, in one place: each kind's policy as data
(:class:`DeviceKind`), which device and precision ``auto`` means, whether a device is here, free
and total memory, the process's size and peak, cache release and random-number state, for cpu,
cuda and mps.

Everything else asks here instead of testing ``torch.cuda``/``torch.backends.mps`` or comparing
``device.type`` itself, so a new backend is one module's change: an entry in ``DEVICE_KINDS``
and its branches below.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bigbatch.memory.oom import ONEDNN_OOM_MESSAGE

__all__ = [
    "AMPERE",
    "DEVICE_KINDS",
    "DeviceClock",
    "DeviceKind",
    "auto_device",
    "auto_precision",
    "autocast_for",
    "bound_onednn_cache",
    "cap_cuda_allocator",
    "card_memory",
    "compute_capability",
    "cudnn_benchmark_mode",
    "decodes_jpeg",
    "device_kind",
    "empty_cache",
    "emulates_bf16",
    "free_bytes",
    "free_memory",
    "measures_reserved",
    "onednn_stuck",
    "peak_allocated_bytes",
    "peak_memory_bytes",
    "peak_memory_text",
    "pins_memory",
    "process_rss",
    "reset_peak_memory",
    "return_freed_cpu_memory",
    "rng_state",
    "set_rng_state",
    "synchronize",
    "torch_threads",
    "total_bytes",
    "trim_cpu_heap",
    "unavailable_reason",
    "uncap_cuda_allocator",
    "uses_cudnn_benchmark",
]

log = logging.getLogger("bigbatch")

# torch's CPU process baseline on Linux, for a platform that does not say its resident size.
_RSS_FALLBACK = 300 * 2**20


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device's policy, as data: what the planner, the loop and the Accumulator
    ask of a device besides running kernels on it.

    >>> device_kind("cuda:1").distributed_backend, device_kind("cpu").distributed_backend
    ('nccl', 'gloo')
    """

    name: str
    # Memory of its own (a discrete GPU's): a budget counts its free memory alone, and the
    # process around the step is a context on it. Otherwise the step shares the system's memory
    # with the process (CPU; MPS's unified memory), which the budget counts in.
    dedicated_memory: bool
    allocator_block: int  # bytes its caching allocator rounds each block up to (1: none)
    float64: bool  # float64 kernels exist (MPS has none: counts are summed in float32)
    distributed_backend: str  # torch.distributed's backend for several processes on it
    pin_memory: bool  # page-locked batches let the copy to it overlap compute
    channels_last: bool  # convolutions run faster NHWC (tensor cores): the default there
    per_rank_device: bool  # under torchrun each rank takes its own (LOCAL_RANK)
    decodes_jpeg: bool  # torchvision decodes JPEGs on it (CUDA's nvJPEG)
    # bigbatch train's AdamW runs torch's fused kernel there: one launch a step and no update
    # temporaries, where the multi-tensor one launches several per group of weights (what
    # Trainer runs by default from torch 2.8). Elsewhere torch's own default.
    fused_adamw: bool
    flash_attention: bool  # flash-attn's kernels (transformers' flash_attention_2) run on it


DEVICE_KINDS = {
    "cpu": DeviceKind("cpu", False, 1, True, "gloo", False, False, False, False, False, False),
    "cuda": DeviceKind("cuda", True, 512, True, "nccl", True, True, True, True, True, True),
    "mps": DeviceKind("mps", False, 1, False, "gloo", False, False, False, False, False, False),
}


def device_kind(device: str | torch.device) -> DeviceKind:
    """The policy of ``device``'s kind (``"cuda:1"`` is ``cuda``'s).

    >>> kind = device_kind("cuda:1")
    >>> kind.name, kind.allocator_block, device_kind("cpu").dedicated_memory
    ('cuda', 512, False)
    """
    name = torch.device(device).type
    if name not in DEVICE_KINDS:
        raise ValueError(f"bigbatch trains on {', '.join(DEVICE_KINDS)}, not {name}")
    return DEVICE_KINDS[name]


def unavailable_reason(device: torch.device) -> str:
    """Why ``device`` cannot be used on this machine ('' when it can), with the fix.

    >>> unavailable_reason(torch.device("cpu"))
    ''
    """
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device is available; use cpu or auto"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    elif device.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available here; use cpu or auto"
    return ""


def auto_device() -> torch.device:
    """The best device here: cuda, then mps, then cpu.

    >>> auto_device().type in ("cuda", "mps", "cpu")
    True
    """
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


NVIDIA_DRIVER = "/proc/driver/nvidia/version"  # there where NVIDIA's Linux driver is loaded


def describe_device(device: torch.device, *, auto: bool = False) -> str:
    """``device`` as a run's log names it: a GPU's model and memory (``cuda:0 (NVIDIA T4,
    15.0 GiB)``); with ``auto`` (``device=auto`` chose it), a CPU says that no GPU was found,
    so that a notebook with its accelerator off is told before hours of training on the CPU.

    >>> describe_device(torch.device("cpu"))
    'cpu'
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        card = torch.cuda.get_device_properties(index)
        return f"cuda:{index} ({card.name}, {card.total_memory / 2**30:.1f} GiB)"
    if device.type == "cpu" and auto:
        if torch.version.cuda is None and os.path.exists(NVIDIA_DRIVER):
            return (
                "cpu (device=auto: this torch is a CPU build, and this machine has an NVIDIA "
                "driver: install torch's CUDA build, e.g. pip install torch --index-url "
                "https://download.pytorch.org/whl/cu128)"
            )
        return "cpu (device=auto found no GPU: no CUDA or MPS device is visible to torch)"
    return str(device)


def idle_gpus_note(device: torch.device, world: int) -> str:
    """Where this one process trains on one of several GPUs (a Kaggle notebook's two T4s):
    the others stay idle unless torchrun starts a process on each; '' otherwise.

    >>> idle_gpus_note(torch.device("cpu"), 1)
    ''
    """
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if world > 1 or count < 2:
        return ""
    return (
        f"note: {count} CUDA GPUs here and this run trains on one; `torchrun --nproc-per-node "
        f"{count} -m bigbatch train ...` trains on all {count}, the same global batch"
    )


def auto_precision(device: torch.device) -> str:
    """``precision=auto``: bf16 on a GPU that has it (else fp16), fp32 elsewhere (CPU bf16 is slow
    on most CPUs; MPS autocast is young).

    >>> auto_precision(torch.device("cpu"))
    'fp32'
    """
    if device.type == "cuda":
        return "fp16" if emulates_bf16(device) else "bf16"
    return "fp32"


# A CUDA card's compute capability from which it has bfloat16 units (and runs FlashAttention 2):
# Ampere's. Before it, torch emulates bf16 in float32.
AMPERE = (8, 0)


def emulates_bf16(device: torch.device) -> bool:
    """Whether ``device`` has no bfloat16 units and torch emulates bf16 in float32 there,
    several times slower than fp16: a CUDA card before Ampere (compute capability below 8: a
    T4, a V100). ``torch.cuda.is_bf16_supported()`` says True on these, as their bf16 tensors
    work.

    >>> emulates_bf16(torch.device("cpu"))
    False
    """
    capability = compute_capability(device)
    return capability is not None and capability < AMPERE


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s CUDA compute capability (major, minor); None off CUDA, where no CUDA GPU is
    visible, and on ROCm (whose numbers are AMD's architectures, not NVIDIA's).

    >>> compute_capability(torch.device("cpu")) is None
    True
    """
    if device.type != "cuda" or torch.version.hip or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def pins_memory(device: torch.device) -> bool:
    """Whether loaders for ``device`` page-lock their batches: on CUDA a pinned batch's copy
    (``non_blocking``) overlaps the computation; elsewhere there is no such copy to overlap.

    >>> pins_memory(torch.device("cuda")), pins_memory(torch.device("cpu"))
    (True, False)
    """
    return device_kind(device).pin_memory


def decodes_jpeg(device: torch.device) -> bool:
    """Whether torchvision decodes JPEGs on ``device`` (CUDA's nvJPEG).

    >>> decodes_jpeg(torch.device("cuda")), decodes_jpeg(torch.device("cpu"))
    (True, False)
    """
    return device_kind(device).decodes_jpeg


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class DeviceClock:
    """Spans of the device's own time (a step's, without making the host wait for it): CUDA
    events recorded on the queue where the device is CUDA, the host's clock after synchronising
    elsewhere. :meth:`seconds` waits for the device once and sums the spans.

    >>> clock = DeviceClock(torch.device("cpu"))
    >>> start = clock.now(); clock.add(start, clock.now()); clock.seconds() >= 0
    True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spans: list[tuple[Any, Any]] = []

    def now(self) -> Any:
        """A mark at this point of the device's queue."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        synchronize(self.device)
        return time.perf_counter()

    def add(self, start: Any, end: Any) -> None:
        self.spans.append((start, end))

    def seconds(self) -> float:
        synchronize(self.device)
        if self.device.type == "cuda":
            return sum(start.elapsed_time(end) for start, end in self.spans) / 1000
        return float(sum(end - start for start, end in self.spans))


def empty_cache() -> None:
    """Return the caching allocators' unused blocks (CUDA, MPS) to the driver."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


def rng_state() -> dict[str, Any]:
    """Every random generator torch draws from here: the CPU's and each accelerator's."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (the parts this machine has)."""
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    if state.get("mps") is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


def _meminfo(key: str) -> int | None:
    return _meminfo_of("/proc/meminfo", key)


def _meminfo_of(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a Linux /proc file, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def free_bytes(device: str | torch.device) -> int:
    """Free memory on ``device`` now: CUDA's ``mem_get_info``; for the CPU and MPS (which shares
    the system's memory) what the system can still give (Linux's MemAvailable, else psutil).

    >>> free_bytes("cpu") > 0
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("budget 'auto' needs a CUDA device; give a size such as 16GB instead")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo("MemAvailable")
    if available is None:
        try:
            import psutil  # macOS, Windows: not a dependency, used where installed

            available = int(psutil.virtual_memory().available)
        except ImportError:
            pass
    if available is None:
        raise ValueError(
            "cannot read the free memory here (no /proc/meminfo, no psutil): give a size such as "
            "8GB instead of 'auto', or pip install psutil"
        )
    return available


def total_bytes(device: str | torch.device) -> int | None:
    """All the memory of ``device`` (a GPU's, or the machine's RAM); None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = _meminfo("MemTotal")
    if total is not None:
        return total
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return None


def card_memory(device: str | torch.device) -> tuple[int, int] | None:
    """``(total, outside)`` of a CUDA card now: all its memory, and what of it this process's
    caching allocator does not hold: the CUDA context, NCCL's communicators (which allocate
    beside PyTorch's allocator, so no trace sees them), and any other process on the card. The
    allocator can hold at most ``total - outside`` of the card, whatever a plan said.
    None off CUDA (a CPU's process is measured whole instead: :func:`peak_memory_bytes`).

    >>> card_memory("cpu") is None
    True
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(total), int(total - free - torch.cuda.memory_reserved(device))


def process_rss() -> int:
    """This process's resident memory now (Linux's statm, else psutil, else torch's baseline)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return _RSS_FALLBACK


def peak_memory_text(device: torch.device) -> str:
    """``", peak 1.23 GiB"`` for a progress line: the allocator's peak on a GPU, the process's
    peak resident memory on the CPU; empty where unknown."""
    if device.type == "cuda":
        return f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    if device.type == "mps":
        return f", MPS {torch.mps.driver_allocated_memory() / 2**30:.2f} GiB"
    if sys.platform == "linux":
        import resource  # the process's peak resident memory, in KiB on Linux

        return f", peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    return ""


def cap_cuda_allocator(device: torch.device, cap_bytes: int) -> tuple[int, float] | None:
    """Limit this process's CUDA caching allocator to ``cap_bytes`` of ``device``
    (``torch.cuda.set_per_process_memory_fraction``): past it an allocation raises
    ``OutOfMemoryError`` after the allocator has freed its cache, as on a card of that size,
    whatever the card's real size or what else runs on it. The CUDA context is outside the
    allocator and so outside the cap. Returns the cap set (the card's memory at most) and the
    fraction in force before (to put back: :func:`uncap_cuda_allocator`), or None where
    ``device`` is not CUDA."""
    if device.type != "cuda":
        return None
    index = _cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    cap = max(0, min(cap_bytes, total))
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    before = float(getter(index)) if getter is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    return cap, before


def uncap_cuda_allocator(device: torch.device, fraction: float | None) -> None:
    """Put back the allocator's fraction :func:`cap_cuda_allocator` replaced (None: it capped
    nothing): the caller's process keeps its own setting after a run."""
    if device.type == "cuda" and fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, _cuda_index(device))


def _cuda_index(device: torch.device) -> int:
    """``device``'s index, the current device's for a bare ``cuda``: torch's memory-fraction
    calls refuse a device without one."""
    return device.index if device.index is not None else torch.cuda.current_device()


def peak_memory_bytes(device: torch.device) -> tuple[int, bool] | None:
    """This process's peak memory on ``device`` since it started or since
    :func:`reset_peak_memory`, and whether it counts the process's overhead too: the CUDA
    allocator's reserved peak (``max_memory_reserved``: the step's, as a plan predicts it; the
    context is outside it), or the process's peak resident memory on a Linux CPU (``VmHWM``:
    everything, interpreter, libraries, data). None where neither is known."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device)), False
    if device.type == "cpu" and sys.platform == "linux":
        peak = _meminfo_of("/proc/self/status", "VmHWM")
        if peak is None:
            import resource  # ru_maxrss is in KiB on Linux

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, True
    return None


def peak_allocated_bytes(device: torch.device) -> int | None:
    """The CUDA allocator's allocated peak (``max_memory_allocated``: the bytes tensors held at
    once, rounded to the allocator's blocks) since :func:`reset_peak_memory`; None off CUDA.
    Where micro-batches change shape (sequences padded to each batch's longest), the reserved
    peak grows with fragmentation that the allocator gives back at its cap before it would fail,
    so it overstates what a step needs; the allocated peak does not.

    >>> peak_allocated_bytes(torch.device("cpu")) is None
    True
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def reset_peak_memory(device: torch.device) -> bool:
    """Start :func:`peak_memory_bytes` again from now (the CUDA allocator's peak statistics;
    Linux's resident high-water mark through ``/proc/self/clear_refs``), so that a run's peak
    is its own, not the planning's or an earlier run's in the same process. False where the
    peak cannot be reset (it then counts from the process's start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    if device.type == "cpu" and sys.platform == "linux":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
            return True
        except OSError:
            return False
    return False


def measures_reserved(device: torch.device) -> bool:
    """Whether a step's reserved peak can be measured on ``device`` here: a CUDA device that
    is present (its caching allocator's statistics).

    >>> measures_reserved(torch.device("cpu"))
    False
    """
    return device.type == "cuda" and torch.cuda.is_available()


def uses_cudnn_benchmark(setting: str, device: torch.device) -> bool:
    """Whether a run in ``device`` times cuDNN's convolution algorithms (``cudnn_benchmark=``:
    ``auto`` where cuDNN runs the convolutions, on CUDA).

    >>> uses_cudnn_benchmark("auto", torch.device("cpu")), uses_cudnn_benchmark("true", torch.device("cpu"))
    (False, True)
    """
    return setting == "true" or (setting == "auto" and device.type == "cuda")


@contextlib.contextmanager
def cudnn_benchmark_mode(enabled: bool) -> Iterator[None]:
    """``torch.backends.cudnn.benchmark`` set to ``enabled`` inside, the caller's setting back
    after: a run's choice is not left behind in the process that ran it.

    >>> with cudnn_benchmark_mode(True):
    ...     torch.backends.cudnn.benchmark
    True
    """
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def autocast_for(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The autocast context of a precision: bf16/fp16 autocast, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(
        device_type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16
    )


# oneDNN primitive-cache entries one convolution layer adds per micro-batch size (forward,
# backward for data and for weights, and their reorders), at most: counted with
# ONEDNN_VERBOSE=all on six timm models, one size took 1.0 (efficientnet_b0) to 4.0 (resnet18)
# per convolution module, since layers of one shape share their kernels.
_ONEDNN_ENTRIES_PER_CONV = 4
_ONEDNN_CACHE_DEFAULT = 1024  # oneDNN's own capacity


def bound_onednn_cache(
    model: torch.nn.Module, sizes: int = 2, entries_per_size: int | None = None
) -> int | None:
    """Bound oneDNN's primitive cache to what ``sizes`` micro-batch sizes of ``model`` need;
    call it before the model's first convolution on the CPU. Returns the capacity set, or None
    where it is left alone (the variable already set, or no convolution on the CPU).

    oneDNN keeps the kernels it built for every convolution shape it ran, up to 1024 entries,
    and each micro-batch size is new shapes. After an OOM back-off from 128 (convnext_atto at
    64 px, under an address-space limit) the cache held the sizes that failed, 2.5 -> 89 MiB,
    and the back-off fell to 1 where a clean start fits 16. torch has no call to empty the
    cache, and oneDNN reads its capacity once, when it builds its first primitive; bounded
    from the start, the failed sizes' kernels leave it as the new size fills it. Two sizes are
    a window's (balanced micro-batches differ by one sample).

    Without ``entries_per_size`` the bound assumes 4 entries per convolution module, an upper
    bound (1.0-4.0 counted), so the cache can still hold several sizes; count one step's
    entries with the threads you train with, ``ONEDNN_VERBOSE=all python step.py | grep -c
    cache_miss`` (convnext_atto: 52 on one thread, 110 on two), and pass that. Under a tight
    limit hold one size (``sizes=1``) and return freed memory from the start
    (:func:`return_freed_cpu_memory`): the back-off then lands where a clean start fits (the
    OOM guide's table), at up to a tenth more time per window.

    >>> bound_onednn_cache(torch.nn.Linear(2, 2)) is None  # no convolution: nothing to bound
    True
    """
    if sizes < 1:
        raise ValueError(f"sizes must be >= 1 (micro-batch sizes the cache holds), got {sizes}")
    if entries_per_size is not None and entries_per_size < 1:
        raise ValueError(f"entries_per_size must be >= 1, got {entries_per_size}")
    if any(
        n in os.environ
        for n in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
    ):
        return None  # the user's choice
    convs = sum(
        isinstance(m, torch.nn.modules.conv._ConvNd) and m.weight.device.type == "cpu"
        for m in model.modules()
    )
    if not convs or not torch.backends.mkldnn.is_available():
        return None
    if entries_per_size is None:
        capacity = max(256, sizes * _ONEDNN_ENTRIES_PER_CONV * convs)
    else:  # counted: the sizes, and a little room for the loss and optimizer's own primitives
        capacity = sizes * entries_per_size + 8
    if capacity >= _ONEDNN_CACHE_DEFAULT:
        return None  # a model this large already fills oneDNN's own bound
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity)
    return capacity


# Each probe a convolution height never built before, so oneDNN must write a new kernel.
_PROBE_ROWS = itertools.count(11)


def onednn_stuck() -> bool:
    """True when oneDNN can no longer build a CPU kernel on this thread, whatever memory is
    free: then no smaller micro-batch can run in this process.

    oneDNN writes its CPU kernels at run time with Xbyak, whose error flag is kept per thread
    and never cleared by oneDNN: one out-of-memory error while a kernel's code buffer is
    allocated (256 KiB, by mmap), and every convolution of a shape not built yet fails on
    this thread with "could not create a primitive" for the rest of the process; shapes
    already built keep running. Under an address-space limit (``ulimit -v``) 5 back-offs in
    27 hit it (convnext_atto, ``tests/memory/test_oom.py``, under CPU load). Tested by
    building one tiny convolution of a new shape (batch 2: oneDNN's, not torch's own kernel).

    >>> onednn_stuck()
    False
    """
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    rows = next(_PROBE_ROWS)
    try:
        with torch.no_grad():
            torch.nn.functional.conv2d(torch.zeros(2, 1, rows, 4), torch.zeros(1, 1, 3, 3))
    except RuntimeError as exc:
        return ONEDNN_OOM_MESSAGE in str(exc)
    return False


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Any:
    """Run the block with torch on ``threads`` CPU threads (None: as it is), then restore.

    Planning measures CPU kernel workspaces, which grow with the threads (oneDNN keeps a
    reduction buffer per thread), so it must run with the threads training will have.

    >>> with torch_threads(1):
    ...     torch.get_num_threads()
    1
    """
    before = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_memory(host_oom: bool) -> None:
    """Collect garbage, empty the device cache and, after a host OOM, return the CPU heap."""
    gc.collect()
    empty_cache()
    if host_oom:
        _release_cpu_heap()


_GLIBC: Any = None  # glibc, once loaded; False where there is none (macOS, musl, Windows)
_RETURNING = False  # whether return_freed_cpu_memory has fixed the mmap threshold


def _glibc() -> Any:
    global _GLIBC
    if _GLIBC is None:
        try:
            import ctypes

            lib = ctypes.CDLL("libc.so.6")
            lib.mallopt, lib.malloc_trim  # noqa: B018 -- both must exist
            _GLIBC = lib
        except (OSError, AttributeError):
            _GLIBC = False
    return _GLIBC


def return_freed_cpu_memory() -> bool:
    """From now on, have this process give large freed CPU blocks (over 128 KiB: tensors) back to
    the system at once, so its resident size follows the tensors alive, as a CPU memory plan
    predicts. Returns False where the C library is not glibc (nothing changed).

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so after
    the first big step a step's tensors come from its brk heap, where small objects settle in
    the holes they leave: the resident size grows past the tensors alive, 1.3-2.5x the step's
    working set over 40 steps (a small GPT, resnet10t; ``benchmarks/cpu_heap.py``), and an
    OOM back-off cannot give the failed attempt's memory back. A fixed threshold stops that, at
    a cost: every large block is fresh pages, about a third of a CPU step's speed. ``bigbatch
    train`` calls it when a plan leaves no room for that growth, and after a host OOM.

    >>> return_freed_cpu_memory() in (True, False)
    True
    """
    global _RETURNING
    lib = _glibc()
    if not lib:
        return False
    if not _RETURNING:
        lib.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed, so never raised again
        _RETURNING = True
    trim_cpu_heap()  # what the heap holds free now goes back too
    return True


def trim_cpu_heap() -> None:
    """Give the free memory glibc's heap holds now back to the system (``malloc_trim``; nothing
    where the C library is not glibc), so the resident size counts what is in use.

    >>> trim_cpu_heap()
    """
    lib = _glibc()
    if lib:
        lib.malloc_trim(0)


def _release_cpu_heap() -> None:
    """Give the CPU heap back after an OOM, and keep it returnable from then on (measured under
    RLIMIT_AS, convnext_atto at 64 px with 150 MiB of headroom: the back-off fell from 128 to 2
    with glibc's default heap, though a clean start at 32 trains; it lands on 32 with this)."""
    if not _RETURNING and _glibc():
        log.warning(
            "bigbatch: after an out-of-memory error, large CPU allocations now bypass "
            "glibc's heap (M_MMAP_THRESHOLD 128 KiB), so freed memory is returned"
        )
    return_freed_cpu_memory()
