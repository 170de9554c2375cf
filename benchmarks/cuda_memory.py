"""Memory truth on a GPU: bigbatch's CUDA predictions and plans against what the card does.

    python benchmarks/cuda_memory.py                     # on an NVIDIA GPU: the whole matrix
    python benchmarks/cuda_memory.py --only seed000      # seed 000's published rows
    python benchmarks/cuda_memory.py --dry-run --out d/  # no GPU: tiny workloads, the same code

On a GPU, for each workload (timm classifiers, a MONAI 3D U-Net, a Llama-style LM with frozen
base weights and activation checkpointing; fp32, fp16 and bf16 autocast; AdamW and SGD) it
predicts the step's allocated and reserved peaks (``predict_peak`` on a CUDA target) and
measures two real steps: ``max_memory_allocated``, ``max_memory_reserved`` and the device memory
in use (``mem_get_info``: the context, cuDNN and cuBLAS workspaces, the allocator's segments).
Then, on emulated 8 and 16 GB cards (``set_per_process_memory_fraction``), it plans a batch,
trains two windows at the plan and tries the next micro-batch the plan refused (it should run
out); and it runs the OOM back-off from a micro-batch that cannot fit, checking where it lands
and that the weights equal a run without OOM (also with ``expandable_segments:True``).

Results go to ``benchmarks/results/<gpu>-torch<version>.json`` (commit them) and a Markdown
table on stdout. ``--dry-run`` runs tiny workloads on the CPU (a CUDA target is predicted, the
CPU step measured) so that CI keeps the harness working; its figures are not GPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from gpu_matrix import _llama, _timm, _unet3d, lm_step, seg_step

from bigbatch.memory.measure import measure_step_peak, real_step_setup
from bigbatch.memory.plan import overhead_bytes
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec, make_inputs

MiB = 2**20


@dataclass(frozen=True)
class Workload:
    name: str
    model: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    batches: tuple[int, ...]
    precision: str = "fp16"
    optimizer: str = "adamw"
    input_dtype: torch.dtype = torch.float32
    vocab: int = 2
    step: Callable[[nn.Module, Any], torch.Tensor] | None = None
    groups: tuple[str, ...] = ()  # --only picks by these (and by name)

    def spec(self, batch: int, device: str) -> StepSpec:
        return StepSpec(
            self.model, self.input_shape, batch, optimizer=self.optimizer,
            precision=self.precision, device=device, input_dtype=self.input_dtype,  # type: ignore[arg-type]
            name=self.name, vocab=self.vocab, step=self.step,
        )  # fmt: skip


def workloads(dry_run: bool) -> list[Workload]:
    if dry_run:  # tiny, on the CPU: the harness's code paths, in seconds
        return [
            Workload("resnet10t-32", _timm("resnet10t", num_classes=10), (3, 32, 32), (2, 4),
                     precision="fp32", groups=("timm",)),
            Workload("unet3d-16", _unet3d((8, 16)), (4, 16, 16, 16), (1, 2), precision="fp32",
                     step=seg_step, groups=("3d",)),
            Workload("llama-64", _llama(2, 64, 256), (64,), (1, 2), precision="fp32",
                     input_dtype=torch.long, vocab=256, step=lm_step, groups=("lm",)),
        ]  # fmt: skip
    seed000 = ("seed000",)
    return [
        # Seed 000's published nvidia-smi rows (fastai, fp16 AMP, Adam).
        Workload("convnext_small_in22k-128", _timm("convnext_small.fb_in22k"), (3, 128, 128),
                 (16, 32, 64), groups=seed000),
        Workload("convnext_large_in22k-224", _timm("convnext_large.fb_in22k"), (3, 224, 224),
                 (4,), groups=seed000),
        Workload("swinv2_large_window12_192_22k", _timm("swinv2_large_window12_192.ms_in22k"),
                 (3, 192, 192), (2,), groups=seed000),
        # The matrix.
        Workload("resnet50-224-fp16", _timm("resnet50"), (3, 224, 224), (32, 64, 128),
                 groups=("timm",)),
        Workload("resnet50-224-bf16-sgd", _timm("resnet50"), (3, 224, 224), (64,),
                 precision="bf16", optimizer="sgd", groups=("timm",)),
        Workload("resnet50-224-fp32", _timm("resnet50"), (3, 224, 224), (32,), precision="fp32",
                 groups=("timm",)),
        Workload("vit_base-224-bf16", _timm("vit_base_patch16_224"), (3, 224, 224), (32, 64),
                 precision="bf16", groups=("timm",)),
        Workload("unet3d-96", _unet3d((32, 64, 128, 256)), (4, 96, 96, 96), (1, 2),
                 step=seg_step, groups=("3d",)),
        Workload("unet3d-128-bf16", _unet3d((32, 64, 128, 256)), (4, 128, 128, 128), (1,),
                 precision="bf16", step=seg_step, groups=("3d",)),
        Workload("llama-2k-bf16", _llama(8, 1024, 32000), (2048,), (1, 4), precision="bf16",
                 input_dtype=torch.long, vocab=32000, step=lm_step, groups=("lm",)),
    ]  # fmt: skip


@dataclass
class Row:
    workload: str
    batch: int
    precision: str
    optimizer: str
    predicted_allocated_mib: float
    predicted_reserved_mib: float
    measured_allocated_mib: float
    measured_reserved_mib: float
    device_used_mib: float | None  # the whole process on the card (mem_get_info), GPU only
    predicted_process_mib: float  # the plan's need (reserved, handles) plus the context
    reserved_error_pct: float
    allocated_error_pct: float
    predict_seconds: float
    notes: list[str] = field(default_factory=list)


def measure_cuda(spec: StepSpec) -> tuple[int, int, int]:
    """Allocated and reserved peaks of two real steps (``measure_step_peak``, which resets the
    peak statistics first), and the device memory in use after them."""
    torch.cuda.empty_cache()  # the reserved peak starts from this step's own segments
    allocated = measure_step_peak(spec)
    free, total = torch.cuda.mem_get_info()
    result = (allocated, int(torch.cuda.max_memory_reserved()), int(total - free))
    torch.cuda.empty_cache()
    return result


def prediction_row(work: Workload, batch: int, gpu: bool) -> Row:
    cuda_spec = work.spec(batch, "cuda")
    t0 = time.perf_counter()
    pred = predict_peak(cuda_spec)
    seconds = time.perf_counter() - t0
    if gpu:
        allocated, reserved, used = measure_cuda(cuda_spec)
    else:  # dry run: the CPU step stands in, so the numbers flow end to end
        allocated = reserved = measure_step_peak(work.spec(batch, "cpu"))
        used = None
    predicted_reserved = pred.reserved_bytes or pred.peak_bytes
    process = pred.planning_bytes + overhead_bytes("cuda" if gpu else "cpu")
    return Row(
        work.name, batch, work.precision, work.optimizer,
        round((pred.allocated_bytes or pred.peak_bytes) / MiB, 1),
        round(predicted_reserved / MiB, 1), round(allocated / MiB, 1), round(reserved / MiB, 1),
        None if used is None else round(used / MiB, 1), round(process / MiB, 1),
        round(100 * (predicted_reserved - reserved) / reserved, 2),
        round(100 * (pred.peak_bytes - allocated) / allocated, 2),
        round(seconds, 2), list(pred.notes),
    )  # fmt: skip


def slope_per_sample(rows: list[Row], name: str, key: str) -> float | None:
    """MiB per sample between the smallest and largest batch of one workload."""
    points = sorted((r.batch, getattr(r, key)) for r in rows if r.workload == name)
    if len(points) < 2:
        return None
    (b0, m0), (b1, m1) = points[0], points[-1]
    return round((m1 - m0) / (b1 - b0), 2)


def emulated_card_check(work: Workload, card_gib: int, target_batch: int) -> dict[str, Any]:
    """Plan under an emulated card (the allocator capped at the card less this process's
    measured context: the cap covers the allocator alone), train two windows at the plan, then
    try the micro-batch the plan refused: the first must fit, the second should run out."""
    from bigbatch import Accumulator, OOMBackoff, run_window
    from bigbatch.memory.plan import plan_under_budget

    total = torch.cuda.get_device_properties(0).total_memory
    context = overhead_bytes("cuda")
    cap = card_gib * 2**30 - context
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    result: dict[str, Any] = {
        "workload": work.name,
        "card_gib": card_gib,
        "context_mib": round(context / MiB, 1),
    }
    try:
        plan = plan_under_budget(
            lambda b: work.spec(b, "cuda"), target_batch, f"{card_gib}GiB", device="cuda"
        )
        result.update(micro_batch=plan.micro_batch, micro_batches=plan.micro_batches)

        def train_at(micro: int) -> bool:
            torch.cuda.empty_cache()  # the last try's blocks: its locals are gone by now
            spec = work.spec(micro, "cuda")
            model, opt, _ = real_step_setup(spec, 0)
            acc = Accumulator(opt)
            backoff = OOMBackoff(micro_batch=micro, grow_after=0)
            window = make_inputs(work.spec(target_batch, "cuda"), "cuda")
            try:
                for _ in range(2):
                    run_window(acc, window, lambda b: _loss(work, model, b), backoff,
                               device="cuda")  # fmt: skip
                return not backoff.events
            except Exception:
                return False

        result["plan_trains"] = train_at(plan.micro_batch)
        refused = plan.max_micro_batch + 1
        if refused <= target_batch:
            result["refused_micro_batch"] = refused
            result["refused_runs_out"] = not train_at(refused)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return result


def _loss(work: Workload, model: nn.Module, batch: Any) -> torch.Tensor:
    from bigbatch.memory.step import run_step_loss

    return run_step_loss(work.spec(len(batch), "cuda"), model, batch, "cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny workloads on the CPU")
    parser.add_argument("--only", default="", help="workload names or groups, comma-separated")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--no-cards", action="store_true", help="skip the emulated-card checks")
    parser.add_argument("--json", action="store_true", help="print the JSON, not the table")
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.dry_run
    if not gpu and not args.dry_run:
        print("no CUDA device here: run on an NVIDIA GPU, or --dry-run", file=sys.stderr)
        return 2
    chosen = {w for w in args.only.split(",") if w}
    works = [
        w for w in workloads(args.dry_run)
        if not chosen or w.name in chosen or chosen & set(w.groups)
    ]  # fmt: skip
    if not works:
        known = sorted(
            {w.name for w in workloads(args.dry_run)}
            | {g for w in workloads(args.dry_run) for g in w.groups}
        )
        print(
            f"--only {args.only}: no such workload or group; choose from {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    rows = [prediction_row(w, b, gpu) for w in works for b in w.batches]
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu (dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dry_run": args.dry_run,
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "rows": [r.__dict__ for r in rows],
        "slopes_mib_per_sample": {
            w.name: {
                "predicted_reserved": slope_per_sample(rows, w.name, "predicted_reserved_mib"),
                "measured_reserved": slope_per_sample(rows, w.name, "measured_reserved_mib"),
            }
            for w in works
            if len(w.batches) > 1
        },
        "worst_reserved_error_pct": max((abs(r.reserved_error_pct) for r in rows), default=None),
    }
    if gpu and not args.no_cards:
        report["emulated_cards"] = [
            emulated_card_check(w, card, target_batch=4 * max(w.batches))
            for w in works
            if "seed000" not in w.groups
            for card in (8, 16)
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    gpu_name = re.sub(r"[^A-Za-z0-9]+", "-", report["device"]).strip("-").lower()
    path = args.out / f"{gpu_name}-torch{torch.__version__.split('+')[0]}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)  # atomic: a half-written result never replaces a whole one
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']}, torch {report['torch']}: {path}")
    print(
        "| workload | batch | precision | predicted reserved MiB | measured reserved MiB | error "
        "| predicted process MiB | measured process MiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        used = "-" if r.device_used_mib is None else f"{r.device_used_mib:,.1f}"
        print(
            f"| {r.workload} | {r.batch} | {r.precision} | {r.predicted_reserved_mib:,.1f} | "
            f"{r.measured_reserved_mib:,.1f} | {r.reserved_error_pct:+.1f} % | "
            f"{r.predicted_process_mib:,.1f} | {used} |"
        )
    worst = report["worst_reserved_error_pct"]
    print(f"worst |error| {worst:.1f} %" if worst is not None else "no rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
