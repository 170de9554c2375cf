"""cuDNN's workspaces as data: for each convolution signature and pass, the allocations the
call makes beyond its inputs and outputs (workspaces, layout copies), recorded by the CUDA
allocator itself. The result is a card profile (one per GPU architecture and cuDNN version)
that the CUDA memory model can read.

    python benchmarks/cudnn_workspaces.py --out profile.json [--seconds 45]
    python benchmarks/cudnn_workspaces.py --dry-run --out p.json   # no GPU: the code path only
    python benchmarks/cudnn_workspaces.py --package profile.json  # into bigbatch's profiles

Signatures, the networks' own first: ResNet-50's bottleneck convolutions (1x1 between 64 and
2048 channels, 3x3 at 7-56 px, the strided ones), ResNet-18's basic blocks and the 7x7 stem and
ViT-B/S's patch embeddings at batch 8-256, ResNet-18 at 128 px at batch 8-64, in float16,
bfloat16 and float32 (TF32 kernels, with workspaces of their own) NCHW; then the grid: kernel
1/3/7, dense or depthwise, 64/256 channels, 28/56 px, batch 8/64, float16/float32, NCHW/NHWC,
cuDNN's benchmark mode off/on. No one rule gives these workspaces (the traces: 1x1 convolutions
copy their operands at 7 px and not at 56 px, weight gradients take 2-8 MiB over the forward's,
a rule from the 64/256-channel grid overshoots ResNet-50's 512-2048-channel 1x1s by 7-15 %),
hence the measurement. Passes: forward, data gradient, weight gradient, and in benchmark mode
each one's trial (``forward_trial``, ...: the workspace its first call tries the algorithms
with). The sweep ends within
``--seconds`` of its process's start (its imports and CUDA's start included, so that a time box
of that length never has to kill it) and says how far it got.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

STARTED = time.monotonic()  # before torch's import, which a fresh machine reads from disk

import torch  # noqa: E402

from bigbatch.io import atomic_write_text  # noqa: E402
from bigbatch.memory.cuda_cudnn import with_defaults  # noqa: E402

MiB = 2**20


# The networks' own convolutions, ResNet-50's first: (in, out, kernel, stride, input size), and
# the padding where it is not "same" (kernel // 2).
NETWORKS = (
    (64, 64, 1, 1, 56),
    (64, 256, 1, 1, 56),
    (256, 64, 1, 1, 56),
    (256, 128, 1, 1, 56),
    (128, 128, 3, 2, 56),
    (128, 512, 1, 1, 28),
    (512, 128, 1, 1, 28),
    (256, 512, 1, 2, 56),
    (512, 256, 1, 1, 28),
    (256, 256, 3, 2, 28),
    (256, 1024, 1, 1, 14),
    (1024, 256, 1, 1, 14),
    (512, 1024, 1, 2, 28),
    (1024, 512, 1, 1, 14),
    (512, 512, 3, 2, 14),
    (512, 2048, 1, 1, 7),
    (2048, 512, 1, 1, 7),
    (1024, 2048, 1, 2, 14),
    (64, 64, 3, 1, 56),
    (128, 128, 3, 1, 28),
    (256, 256, 3, 1, 14),
    (512, 512, 3, 1, 7),
    # ResNet-18's basic blocks beside those: the strided 3x3s and 1x1 shortcuts; both nets' stem.
    (64, 128, 3, 2, 56),
    (64, 128, 1, 2, 56),
    (128, 256, 3, 2, 28),
    (128, 256, 1, 2, 28),
    (256, 512, 3, 2, 14),
    (256, 512, 1, 2, 14),
    (3, 64, 7, 2, 224),
    # ViT-B/16's and ViT-S/16's patch embedding: an RGB input, no tensor-core copy by the rule,
    # yet a workspace that grows with the batch (the traces: 73.8 MiB at b64 in bfloat16).
    (3, 768, 16, 16, 224, 0),
    (3, 384, 16, 16, 224, 0),
)


def _hooked(build: Any, shape: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each convolution a network's forward pass at input ``shape`` makes, once, as the sweep's
    rows key it (without dtype, layout, batch): read on the meta device through forward hooks.
    Square (cubic) kernels, inputs and strides alone, as the profile keys them."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    kinds = (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)

    def hook(conv: torch.nn.Module, args: tuple[torch.Tensor, ...], _: torch.Tensor) -> None:
        if not isinstance(conv, kinds):
            return
        transposed = isinstance(conv, (torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d))
        row = {
            "kernel": conv.kernel_size[0], "groups": conv.groups,
            "channels": conv.in_channels, "out_channels": conv.out_channels,
            "stride": conv.stride[0], "padding": int(conv.padding[0]),
            "size": args[0].shape[-1], "dims": args[0].dim() - 2,
        }  # fmt: skip
        if transposed:
            row |= {"transposed": True, "output_padding": int(conv.output_padding[0])}
        seen[tuple(row.values())] = row

    with torch.device("meta"):
        net = build()
        for m in net.modules():
            m.register_forward_hook(hook)
        net(torch.empty(1, *shape))
    return list(seen.values())


def convolutions_of(arch: str, size: int) -> tuple[tuple[int, ...], ...]:
    """A timm network's dense 2D convolutions at ``size`` px as NETWORKS lists them (in, out,
    kernel, stride, input size, padding), each once."""
    import timm

    rows = _hooked(lambda: timm.create_model(arch, num_classes=10), (3, size, size))
    return tuple(
        (r["channels"], r["out_channels"], r["kernel"], r["stride"], r["size"], r["padding"])
        for r in rows
        if r["groups"] == 1
    )


def _unet3d() -> torch.nn.Module:
    """The memory matrix's MONAI 3D U-Net (benchmarks/gpu_matrix.py's ``unet3d`` rows)."""
    from monai.networks.nets import UNet

    return UNet(3, 4, 4, channels=(32, 64, 128, 256), strides=(2, 2, 2), num_res_units=2)


def _calls(
    build: Any,
    shape: tuple[int, ...],
    batches: tuple[int, ...],
    dtypes: tuple[str, ...],
    benchmark: tuple[bool, ...] = (False,),
) -> list[dict[str, Any]]:
    """A network's own convolutions, every kind (depthwise, 3D, transposed), at ``batches``."""
    convs = _hooked(build, shape)  # the network built and run once, not per batch and dtype
    return [
        {"benchmark": bench, "layout": "nchw", "dtype": dtype, "batch": b, **conv}
        for bench in benchmark
        for b in batches
        for dtype in dtypes
        for conv in convs
    ]


def networks_beyond_2d() -> list[dict[str, Any]]:
    """The matrix's rows the 2D dense sweep cannot key: the MONAI 3D U-Net's convolutions
    (3D, strided, transposed; its rows miss 5-7 % reserved by the rule) at 96 and 128 voxels,
    EfficientNet-B0's (depthwise 3x3 and 5x5, +3.0 %) at 224 px, ConvNeXt-S's (depthwise 7x7
    at 4-32 px, benchmark mode on and off: the H200's b64 row +7.5 %) at 128 px, ResNet-50's at
    224 px in benchmark mode (the matrix's ``-bench`` row: its trials, and the workspaces the
    fastest algorithms take)."""
    import timm

    half = ("float16", "bfloat16")
    effnet = functools.partial(timm.create_model, "efficientnet_b0", num_classes=10)
    convnext = functools.partial(timm.create_model, "convnext_small", num_classes=10)
    resnet50 = functools.partial(timm.create_model, "resnet50", num_classes=10)
    return (
        _calls(_unet3d, (4, 96, 96, 96), (2, 1), half)
        + _calls(_unet3d, (4, 128, 128, 128), (1, 2), half)
        + _calls(effnet, (3, 224, 224), (64, 32, 128), ("float16",))
        + _calls(convnext, (3, 128, 128), (64, 32, 16), ("float16",), (True, False))
        + _calls(resnet50, (3, 224, 224), (64,), ("float16",), (True,))
    )


def _dense(nets: tuple[tuple[int, ...], ...], batches: tuple[int, ...]) -> list[dict[str, Any]]:
    return [
        {
            "benchmark": False, "layout": "nchw", "dtype": dtype, "kernel": k, "groups": 1,
            "channels": cin, "out_channels": cout, "stride": stride, "size": size, "batch": b,
            "padding": pad[0] if pad else k // 2,
        }
        for b in batches
        for dtype in ("float16", "bfloat16", "float32")
        for cin, cout, k, stride, size, *pad in nets
    ]  # fmt: skip


def signatures() -> list[dict[str, Any]]:
    # What the H100's sweep (batch 32/128/256) did not measure first: batch 64 and 8 (between
    # 32 and 128 cuDNN changes algorithm, a float32 3x3 at 56 px taking 24.6 MiB at 32 and
    # 98.1 at 64, so b64 interpolated misses: resnet50 b64 +4.6 %), and the 128 px ResNet-18.
    # A packaged profile keeps the rows a sweep did not reach.
    # ResNet-18 at 128 px (the recorded rows at b8 and b32, and tests/gpu's): its convolutions
    # at 4-32 px, which the 224 px networks' do not cover (so the rule's: -3.7 to -6.5 %).
    small = convolutions_of("resnet18", 128)
    rows = networks_beyond_2d() + _dense(NETWORKS, (64, 8)) + _dense(small, (8, 32, 64))
    rows += _dense(NETWORKS, (32, 128, 256))
    for bench, layout, dtype, kernel, depthwise, channels, size, batch in itertools.product(
        (False, True), ("nchw", "nhwc"), ("float16", "float32"), (3, 1, 7), (False, True),
        (64, 256), (56, 28), (64, 8),
    ):  # fmt: skip
        if depthwise and kernel == 1:
            continue
        rows.append({
            "benchmark": bench, "layout": layout, "dtype": dtype, "kernel": kernel,
            "groups": channels if depthwise else 1, "channels": channels, "size": size,
            "batch": batch,
        })  # fmt: skip
    return rows


def _allocs_during(fn: Any, device: str) -> tuple[list[int], list[int]]:
    """The sizes of the allocator's allocations while ``fn()`` runs, and those of what it
    returns (which are not workspaces)."""
    if device != "cuda":
        return [], [t.untyped_storage().nbytes() for t in fn() if t is not None]
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context=None, max_entries=100_000, clear_history=True)
    out = fn()
    torch.cuda.synchronize()
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    sizes = [e["size"] for e in events if e["action"] == "alloc"]
    return sizes, [t.untyped_storage().nbytes() for t in out if t is not None]


def measure(sig: dict[str, Any], device: str) -> list[dict[str, Any]]:
    torch.backends.cudnn.benchmark = sig["benchmark"]
    dtype = getattr(torch, sig["dtype"])
    full = with_defaults(sig)
    dims, transposed = full["dims"], full["transposed"]
    channels_last = torch.channels_last if dims == 2 else torch.channels_last_3d
    fmt = channels_last if sig["layout"] == "nhwc" else torch.contiguous_format
    c, k, g, out = sig["channels"], sig["kernel"], sig["groups"], full["out_channels"]
    x = torch.randn(sig["batch"], c, *[sig["size"]] * dims, device=device, dtype=dtype)
    x = x.contiguous(memory_format=fmt)
    # A transposed convolution's weight is (in, out / groups, ...), a convolution's the reverse.
    w_shape = (c, out // g) if transposed else (out, c // g)
    w = torch.randn(*w_shape, *[k] * dims, device=device, dtype=dtype)
    w = w.contiguous(memory_format=fmt)
    conv = (
        [full["stride"]] * dims, [full["padding"]] * dims, [1] * dims, transposed,
        [full["output_padding"]] * dims, g,
    )  # fmt: skip

    def forward() -> tuple[torch.Tensor]:
        return (torch.ops.aten.convolution(x, w, None, *conv),)

    grad = torch.randn_like(forward()[0])

    def backward(mask: list[bool]) -> Any:
        return torch.ops.aten.convolution_backward(grad, x, w, None, *conv, mask)

    passes = {
        "forward": forward,
        "data_grad": lambda: backward([True, False, False]),
        "weight_grad": lambda: backward([False, True, False]),
    }
    rows = []
    for name, fn in passes.items():
        # Benchmark mode's trials happen on the first call: one workspace as large as the
        # largest algorithm's (the card's memory free), freed, then the fastest run with its
        # own. The second call is what repeats.
        first, outputs = _allocs_during(fn, device)
        sizes, kept = _allocs_during(fn, device)
        rows.append({**sig, "pass": name, "alloc_sizes": sizes, "output_bytes": sum(kept),
                     "extra_bytes": max(0, sum(sizes) - sum(kept))})  # fmt: skip
        if sig["benchmark"]:
            for n in outputs:
                if n in first:
                    first.remove(n)  # the outputs, not workspaces
            rows.append({**sig, "pass": f"{name}_trial", "alloc_sizes": first,
                         "output_bytes": sum(outputs), "extra_bytes": max(first, default=0)})  # fmt: skip
    return rows


PACKAGED = Path(__file__).parents[1] / "src" / "bigbatch" / "memory" / "cudnn_profiles"


COLUMNS = ("benchmark", "layout", "dtype", "kernel", "groups", "channels", "out_channels",
           "stride", "padding", "size", "dims", "transposed", "output_padding", "batch", "pass",
           "extra_bytes")  # fmt: skip


def package(result: Path) -> Path:
    """A sweep's profile as the CUDA model reads it (bigbatch.memory.cuda_cudnn): named by the
    card's architecture and cuDNN version, each row's signature, pass, batch and workspace.
    Added to the packaged profile of that name: the sweep's rows replace the same signatures'
    and the rest are kept, so a sweep its time box cut short loses nothing measured before."""
    data = json.loads(result.read_text())
    if not data.get("compute_capability"):
        raise SystemExit(f"{result} is a dry run's (no card): nothing to package")
    name = "sm{}-cudnn{}.json".format(data["compute_capability"].replace(".", ""), data["cudnn"])
    out = PACKAGED / name
    kept: list[dict[str, Any]] = []
    if out.exists():
        old = json.loads(out.read_text())
        # An older profile's columns are a subset (2D only): its rows take the defaults.
        if not set(old["columns"]) <= set(COLUMNS) or old.get("allow_tf32") != data.get(
            "allow_tf32"
        ):
            raise SystemExit(f"{out} was measured otherwise: move it aside to package {result}")
        kept = [dict(zip(old["columns"], values, strict=True)) for values in old["rows"]]
    # A table (columns once, a list a row): a third of the rows-of-objects' size in the wheel.
    # The sweep's rows come last, replacing the kept ones of the same signature.
    by_key: dict[tuple[Any, ...], list[Any]] = {}
    for r in map(with_defaults, kept + data["rows"]):
        row = [r[k] for k in COLUMNS]
        by_key[tuple(row[:-1])] = row
    rows = sorted(by_key.values(), key=lambda r: [str(v) for v in r[:-1]])
    header = {k: data.get(k) for k in ("device", "compute_capability", "cudnn", "torch")}
    allow_tf32 = data.get("allow_tf32", True)
    profile = {**header, "allow_tf32": allow_tf32, "columns": COLUMNS, "rows": rows}
    out.write_text(json.dumps(profile, separators=(",", ":")).replace("],[", "],\n[") + "\n")
    out.chmod(0o644)
    return out


def lacking_first(sigs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``sigs`` with those this card's packaged profile lacks first: a sweep its time box cuts
    short measures what the CUDA model does not have yet, then repeats the rest."""
    name = "sm{}{}-cudnn{}.json".format(
        *torch.cuda.get_device_capability(0), torch.backends.cudnn.version()
    )
    path = PACKAGED / name
    if not path.exists():
        return sigs
    rows = json.loads(path.read_text())["rows"]
    have = {tuple(row[:-2]) for row in rows}
    tried = {tuple(row[:-2]) for row in rows if row[-2].endswith("_trial")}

    def measured(sig: dict[str, Any]) -> bool:
        full = with_defaults(sig)
        key = tuple(full[k] for k in COLUMNS[:-2])
        # A benchmark-mode signature measured before its trials were is measured again.
        return key in (tried if full["benchmark"] else have)

    return [s for s in sigs if not measured(s)] + [s for s in sigs if measured(s)]


def _profile(device: str, rows: list[dict[str, Any]], total: int) -> dict[str, Any]:
    cuda = device == "cuda"
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
        "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(0))
        if cuda
        else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        # float32 convolutions run on TF32 tensor cores (other kernels, other workspaces) when on.
        "allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch": torch.__version__,
        "signatures_done": sum(not r["pass"].endswith("_trial") for r in rows) // 3,
        "signatures_total": total,
        "rows": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--seconds", type=float, default=45.0)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--package", type=Path, metavar="PROFILE", help="a sweep's output, packaged")
    args = p.parse_args()
    if args.package:
        print(f"packaged: {package(args.package)}")
        return 0
    if args.out is None:
        p.error("--out is required (or --package PROFILE)")
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run on an NVIDIA GPU, or --dry-run", file=sys.stderr)
        return 2
    if args.dry_run:  # the code paths: a few signatures, one in benchmark mode (its trials)
        every = signatures()
        sigs = [*every[:3], next(s for s in every if s["benchmark"])]
    else:
        sigs = lacking_first(signatures())
    deadline = STARTED + args.seconds
    rows: list[dict[str, Any]] = []
    written = time.monotonic()
    slowest = 0.0  # seconds: a signature is begun only where one as slow still fits
    for i, sig in enumerate(sigs):
        began = time.monotonic()
        if began + slowest > deadline:
            break
        if device == "cpu" and sig["dtype"] == "float16":
            sig = {**sig, "dtype": "float32"}
        rows.extend(measure(sig, device))
        torch.cuda.empty_cache() if device == "cuda" else None
        slowest = max(slowest, time.monotonic() - began)
        # Written as it goes: a time box that kills the sweep keeps what it measured.
        if time.monotonic() - written > 5:
            atomic_write_text(args.out, json.dumps(_profile(device, rows, len(sigs))) + "\n")
            written = time.monotonic()
            print(f"{i + 1} of {len(sigs)} signatures", flush=True)
    profile = _profile(device, rows, len(sigs))
    atomic_write_text(args.out, json.dumps(profile) + "\n")
    print(f"{profile['signatures_done']} of {len(sigs)} signatures: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
