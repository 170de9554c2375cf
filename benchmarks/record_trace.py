"""Record one matrix row's training step on a GPU as a CUDA allocator trace, in its own process
and in the format of tests/memory/data/gpu_truth (its README): every allocator event from
just after CUDA's initialisation, the peaks, the device memory in use at each stage.

    python benchmarks/record_trace.py '{"kind": "timm", "arch": "resnet18", ...}' out.json.gz
    python benchmarks/record_trace.py --dry-run ROW out.json.gz   # no GPU: the CPU step's peak

The loop is the one a user writes: ``torch.autocast("cuda", dtype)``, ``GradScaler`` for fp16,
torch's default (foreach) optimizer (``adamw_fused``: the fused AdamW),
``zero_grad(set_to_none=True)``, two steps; cuDNN's benchmark mode as the row says (off by
default: such rows repeat to the MiB), the allocator capped at ``cap_mib`` where the row has one, and the model under ``torch.compile``
where the row says ``compile``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gzip
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gpu_matrix import ranks_of, row_name, spec_of

from bigbatch.memory.measure import measure_step_peak, real_step_setup
from bigbatch.memory.step import make_inputs, run_step_loss

MiB = 2**20


def _used_mib() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / MiB


def _event_count() -> int:
    traces = torch.cuda.memory._snapshot()["device_traces"]
    return len(traces[0]) if traces else 0


def model_and_optimizer(row: dict[str, Any], spec: Any) -> tuple[torch.nn.Module, Any]:
    """The row's model on its device, in train mode, and its optimizer, as
    :func:`~bigbatch.memory.measure.real_step_setup` makes them. A language model (``hf``) is
    built without its random initialisation (:func:`no_random_fills`, which peft's adapters
    go through too) and its floating weights are filled with constants where they are: on the
    CPU before the move (so bitsandbytes quantizes defined values there), or in place on the
    GPU where FSDP2 has moved its shards. The initialisation was most of such a row's time (a
    1B model's: 20 s on 2 cores, two random fills of each weight, one core's work); the memory
    is the same: the same tensors, moved in the same order, and a fill allocates nothing. The
    values are not (no step here branches on them: bf16, no scaler)."""
    if row["kind"] == "hf":
        spec = dataclasses.replace(spec, model=functools.partial(without_random_fills, spec.model))
    model, opt, _ = real_step_setup(spec, 0)
    return model, opt


def without_random_fills(build: Any) -> torch.nn.Module:
    """``build()``'s model without its random fills, its weights filled with constants."""
    with no_random_fills():
        model = build()
    fill_weights(model)
    return model


@contextlib.contextmanager
def no_random_fills() -> Iterator[None]:
    """transformers' ``no_init_weights`` (torch's init functions and transformers' own
    ``init_weights`` made no-ops), but with the weights still tied as ``init_weights`` ties
    them: without it a model with tied embeddings (Llama-3.2-1B, Qwen2.5-0.5B) gets a head of
    its own (Llama-3.2-1B's: 525 MB more of weights)."""
    from transformers import PreTrainedModel

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined]

    def tie_only(self: Any) -> None:
        self.tie_weights()

    with no_init_weights():  # which puts init_weights back on leaving
        PreTrainedModel.init_weights = tie_only
        yield


def fill_weights(model: torch.nn.Module) -> None:
    """Constants in every floating weight of ``model``, in place (a sharded one's local
    shard): norms' scales 1, the rest 0.02; a weight bitsandbytes has already quantized
    (integer) is left as it is."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.is_floating_point():
                local.fill_(1.0 if p.dim() == 1 and "norm" in name else 0.02)


def record_cuda(row: dict[str, Any]) -> dict[str, Any]:
    with ranks_of(row):  # an FSDP2 row: one rank of its fake process group
        return _record_cuda(row)


def _record_cuda(row: dict[str, Any]) -> dict[str, Any]:
    torch.backends.cudnn.benchmark = bool(row.get("cudnn_benchmark", False))
    # Where a row's time goes (a language model's row took 45-60 s on an H200, its two steps
    # 1-2 s of it): each stage's seconds from this function's start.
    start = time.perf_counter()
    torch.cuda.init()
    stages = {"cuda_init": _used_mib()}
    seconds: dict[str, float] = {}

    def lap(stage: str) -> None:
        seconds[stage] = round(time.perf_counter() - start, 2)

    cap = row.get("cap_mib", 0) * MiB  # the allocator's limit, as on a card of that size
    if cap:
        torch.cuda.set_per_process_memory_fraction(
            cap / torch.cuda.get_device_properties(0).total_memory
        )
    # Events only (no stack traces): recording stacks slows the step and bloats the trace.
    torch.cuda.memory._record_memory_history(context=None, max_entries=10_000_000)
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()
    del a
    stages["after_cublas"] = _used_mib()
    x, w = torch.randn(1, 3, 16, 16, device="cuda"), torch.randn(8, 3, 3, 3, device="cuda")
    F.conv2d(x, w).sum().item()
    del x, w
    stages["after_cudnn"] = _used_mib()
    marks = {"model_begin": _event_count()}
    lap("cuda_and_warm_ups")
    spec = spec_of(row, "cuda", real=True)
    lap("spec")
    model, opt = model_and_optimizer(row, spec)
    lap("model_on_gpu")
    if row.get("compile"):  # as nnU-Net's trainer does on CUDA; compiled on the first step
        model = torch.compile(model)
    inputs = [make_inputs(spec, "cuda") for _ in range(2)]
    # GradScaler's default first scale (65536) overflows on some nets (convnext, ViT), so both
    # recorded steps would skip the optimizer and hold no Adam state: start where training
    # settles instead (recorded in the trace).
    scaler = (
        torch.amp.GradScaler("cuda", init_scale=2.0**10) if row["precision"] == "fp16" else None
    )
    stages["after_model_and_inputs"] = _used_mib()
    marks["steps_begin"] = _event_count()
    torch.cuda.reset_peak_memory_stats()
    skipped = 0
    t0 = time.perf_counter()
    while inputs:
        loss = run_step_loss(spec, model, inputs.pop(0), "cuda")
        (scaler.scale(loss) if scaler else loss).backward()
        del loss
        if scaler:
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < scale  # an inf: the optimizer step was skipped
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    stages["after_two_steps"] = _used_mib()
    two_steps = time.perf_counter() - t0
    lap("two_steps")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    lap("snapshot")
    events = [
        [e["action"], e["addr"], e["size"], e["stream"]] for e in snapshot["device_traces"][0]
    ]
    props = torch.cuda.get_device_properties(0)
    return {
        **row,
        "name": row_name(row),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "device": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "cap_bytes": cap or None,
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        "process_used_mib_by_stage": stages,
        "optimizer_steps_skipped": int(skipped),
        "two_steps_seconds": round(two_steps, 3),
        "seconds_by_stage": seconds,
        "segments_at_end": [
            {"address": s["address"], "total_size": s["total_size"], "stream": s["stream"]}
            for s in snapshot["segments"]
        ],
        "events_columns": ["action", "addr", "size", "stream"],
        "event_marks": marks,
        "events": events,
        "loop": "recorded by benchmarks/record_trace.py from just after CUDA init: a cuBLAS "
        "warm-up matmul and a cuDNN conv (freed), the model, inputs, optimizer, then 2 steps; "
        "torch.autocast(cuda, dtype); GradScaler for fp16; foreach optimizer (adamw_fused: fused); "
        "zero_grad(set_to_none=True)",
    }


def record_dry(row: dict[str, Any]) -> dict[str, Any]:
    """No GPU: the CPU step's measured peak stands in, so that the harness runs end to end."""
    with ranks_of(row):
        peak = measure_step_peak(spec_of(row, "cpu"))
    return {
        **row,
        "name": row_name(row),
        "device": "cpu (dry run)",
        "torch": torch.__version__,
        "max_allocated_bytes": peak,
        "max_reserved_bytes": peak,
        "process_used_mib_by_stage": {},
        "event_marks": {},
        "events": [],
    }


def record_to(
    row: dict[str, Any], out: Path, dry_run: bool = False, threads: int | None = None
) -> None:
    """Record ``row`` into ``out`` (written whole or not at all), in a process that has not
    started CUDA: its own, or one forked from a process that never did (gpu_evidence's
    forkserver), on ``threads`` CPU threads (the cores the predictions beside it leave). A
    failure leaves its traceback in ``out`` + ``.error`` and is raised."""
    if threads:
        torch.set_num_threads(threads)
    try:
        if not dry_run and torch.cuda._is_in_bad_fork():
            raise RuntimeError("forked from a process that started CUDA: record in a new one")
        trace = record_dry(row) if dry_run else record_cuda(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with gzip.open(tmp, "wt") as f:
            json.dump(trace, f, separators=(",", ":"))
        tmp.replace(out)
    except BaseException:
        out.with_name(out.name + ".error").write_text(traceback.format_exc()[-3000:])
        raise


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("row", help="the row as JSON (benchmarks/gpu_matrix.py)")
    p.add_argument("out", type=Path, help="where the trace goes (.json.gz)")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: run on an NVIDIA GPU, or --dry-run", file=sys.stderr)
        return 2
    record_to(json.loads(args.row), args.out, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
