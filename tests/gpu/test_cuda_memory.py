"""On a real NVIDIA GPU (`pytest -m cuda tests/gpu`): predictions, plans and the OOM back-off
against what the card does. Skipped where there is no GPU (CI); run wherever
benchmarks/cuda_memory.py runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bigbatch import Accumulator, OOMBackoff, run_window
from bigbatch.memory.plan import plan_under_budget
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def timm_spec(arch: str, size: int, batch: int, precision: str = "fp16") -> StepSpec:
    import timm

    return StepSpec(
        lambda: timm.create_model(arch, num_classes=10), (3, size, size), batch,
        precision=precision, device="cuda",  # type: ignore[arg-type]
    )  # fmt: skip


def measured_reserved(spec: StepSpec) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from cuda_memory import measure_cuda

    return measure_cuda(spec)[1]


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_predicted_reserved_is_within_5_percent_of_the_measured(precision: str) -> None:
    """At b32 cuDNN's weight-gradient workspaces are not modelled: 8 %, as the recorded
    trace shows from a CPU (tests/memory/test_gpu_truth.py)."""
    for batch, within in ((8, 0.05), (32, 0.08)):
        spec = timm_spec("resnet18", 128, batch, precision)
        predicted = predict_peak(spec)
        reserved = measured_reserved(spec)
        assert abs(predicted.reserved_bytes - reserved) <= within * reserved, (
            precision, batch, predicted.reserved_bytes, reserved,
        )  # fmt: skip


def test_seed000_slope_per_image_within_15_percent() -> None:
    """convnext_small at 128 px, fp16, AdamW: 32-33 MB per image published (nvidia-smi), over
    batch 16 to 64: a fixed miss at one batch (the allocator's fragmentation, where the peak
    falls) weighs a third of what it weighs over 16 to 32, where ~100 MiB at b16 was 20 %.
    The two ends only (b32's prediction and measurement took a third of the test's 31 s on an
    H100; the matrix records b32)."""
    specs = [timm_spec("convnext_small", 128, n) for n in (16, 64)]
    predicted = [predict_peak(spec).reserved_bytes for spec in specs]
    measured = [measured_reserved(spec) for spec in specs]
    print(f"convnext_small b16/b64 reserved MiB: predicted {[p >> 20 for p in predicted]}, "
          f"measured {[m >> 20 for m in measured]}")  # fmt: skip
    slope_predicted = (predicted[1] - predicted[0]) / 48
    slope_measured = (measured[1] - measured[0]) / 48
    assert abs(slope_predicted - slope_measured) <= 0.15 * slope_measured, (
        slope_predicted / 2**20, slope_measured / 2**20,
    )  # fmt: skip


def _window_train(micro: int, window: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, OOMBackoff]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=10).cuda()
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
    backoff = OOMBackoff(micro_batch=micro, grow_after=0)
    for _ in range(2):
        run_window(acc, window, lambda b: F.cross_entropy(model(b[0]), b[1]), backoff,
                   device="cuda")  # fmt: skip
    return model, backoff


def emulate_card(card_bytes: int) -> int:
    """Cap the allocator as a card of ``card_bytes`` would: the card less this process's
    context (measured; the cap applies to the allocator alone). Returns the cap."""
    from bigbatch.memory.plan import overhead_bytes

    total = torch.cuda.get_device_properties(0).total_memory
    cap = card_bytes - overhead_bytes("cuda")
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    return cap


@pytest.mark.parametrize("card_gib", [8, 16])
def test_a_plan_on_an_emulated_card_trains_and_the_refused_size_runs_out(card_gib: int) -> None:
    cap = emulate_card(card_gib * 2**30)
    try:
        plan = plan_under_budget(
            lambda b: timm_spec("resnet18", 224, b, "fp32"), 2048, f"{card_gib}GiB", device="cuda"
        )
        g = torch.Generator().manual_seed(1)
        x = torch.randn(plan.micro_batch, 3, 224, 224, generator=g).cuda()
        y = torch.randint(0, 10, (plan.micro_batch,), generator=g).cuda()
        _, backoff = _window_train(plan.micro_batch, (x, y))
        assert not backoff.events, backoff.events  # the plan fits
        # The premise, computed: a micro-batch whose live tensors alone are predicted 10 %
        # past the cap must run out. Not its reserved peak: under a cap the allocator frees its
        # cache and retries before it raises, so a step needs less than it reserves uncapped
        # (on an H100, 1.1x the cap's reserved peak trained at 296 and 643 without an OOM).
        bigger = plan.max_micro_batch + 1
        while predict_peak(timm_spec("resnet18", 224, bigger, "fp32")).allocated_bytes < 1.1 * cap:
            bigger = int(bigger * 1.25) + 1
        x = torch.randn(bigger, 3, 224, 224, generator=g).cuda()
        y = torch.randint(0, 10, (bigger,), generator=g).cuda()
        _, backoff = _window_train(bigger, (x, y))
        assert backoff.events, "a micro-batch well above the plan's should run out"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


REAL_OOM = """
import sys, torch, torch.nn.functional as F, timm
from bigbatch import Accumulator, OOMBackoff, run_window
torch.cuda.set_per_process_memory_fraction(float(sys.argv[1]))
torch.manual_seed(0)
model = timm.create_model("resnet18", num_classes=10).cuda()
acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
g = torch.Generator().manual_seed(1)
x = torch.randn(512, 3, 224, 224, generator=g).cuda(); y = torch.randint(0, 10, (512,), generator=g).cuda()
backoff = OOMBackoff(micro_batch=512, grow_after=0)
for _ in range(2):
    run_window(acc, (x, y), lambda b: F.cross_entropy(model(b[0]), b[1]), backoff, device="cuda",
               model=model)
print(backoff.micro_batch, len(backoff.events))
torch.save({k: v.cpu() for k, v in model.state_dict().items()}, sys.argv[2])
"""


@pytest.mark.parametrize("expandable", [False, True])
def test_real_cuda_oom_backs_off_and_keeps_the_update(tmp_path: Any, expandable: bool) -> None:
    from bigbatch.memory.plan import overhead_bytes

    total = torch.cuda.get_device_properties(0).total_memory
    cap = 6 * 2**30 - overhead_bytes("cuda")  # a 6 GiB card
    fraction = min(1.0, cap / total)
    # The premise, computed: 512 samples do not fit the card, so the back-off must halve.
    sgd = replace(timm_spec("resnet18", 224, 512, "fp32"), optimizer="sgd")
    assert predict_peak(sgd).planning_bytes > cap
    env = dict(os.environ)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    out = tmp_path / "w.pt"
    done = subprocess.run(
        [sys.executable, "-c", REAL_OOM, str(fraction), str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    landed, halvings = map(int, done.stdout.split()[-2:])
    assert halvings >= 1 and landed == 512 >> halvings and landed >= 32, done.stdout
    # The same windows without a limit, at a micro-batch that fits: the same weights.
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 3, 224, 224, generator=g).cuda()
    y = torch.randint(0, 10, (512,), generator=g).cuda()
    model, _ = _window_train(landed, (x, y))
    got = torch.load(out, weights_only=True)
    for name, p in model.state_dict().items():
        if p.is_floating_point():
            scale = float(p.abs().max()) + 1e-12
            assert float((got[name].cuda() - p).abs().max()) <= 1e-4 * scale, name


def test_bigbatch_train_stays_under_an_explicit_budget(tmp_path: Any) -> None:
    """budget= is a cap on the allocator (the budget less the context the plan kept out):
    max_memory_reserved never passes it, on a card of any size."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from train_throughput import write_images

    from bigbatch.memory.budget import parse_bytes
    from bigbatch.train.config import load_config
    from bigbatch.train.loop import train

    write_images(tmp_path / "images", 32, 224, 4, "jpg")
    overrides = [f"data={tmp_path / 'images'}", "arch=resnet50", "size=224", "batch=128",
                 "budget=3GiB", "epochs=3", "device=cuda", "precision=fp16", "log_every=0"]  # fmt: skip
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        train(
            load_config(overrides=overrides), tmp_path / "run", log=lambda _: None, progress=False
        )
        assert torch.cuda.max_memory_reserved() <= parse_bytes("3GiB")
        plan = json.loads((tmp_path / "run" / "plan.json").read_text())
        # Measured after the first steps (against the cap), and at the end: the summary's
        # measured peak is the allocator's reserved peak.
        assert (
            plan["first_steps"]["measured_peak_bytes"] <= plan["first_steps"]["limit_bytes"] * 1.1
        )
        assert plan["measured_peak_bytes"] == torch.cuda.max_memory_reserved()
        assert plan["valid_batch"] >= 1 and plan["valid_predicted_peak_bytes"] > 0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_a_measured_step_is_what_a_prediction_stands_for() -> None:
    """`bigbatch train` on a card with the memory for it plans from a real step of the whole
    batch (bigbatch.memory.measure.measure_step_reserved): its figure is the reserved peak a
    prediction's planning bytes stand for (within 5 %, resnet18 at 128 px b32), and it leaves
    the allocator as it found it but for cuBLAS's workspaces (kept by its handles, as training
    would make them)."""
    from bigbatch.memory.cuda_runtime import cublas_workspace_bytes
    from bigbatch.memory.measure import measure_step_reserved

    spec = timm_spec("resnet18", 128, 32)
    before = torch.cuda.memory_allocated()
    measured = measure_step_reserved(spec)
    settled = predict_peak(spec).settled_reserved_bytes
    assert abs(settled - measured) <= 0.05 * measured, (settled, measured)
    assert torch.cuda.memory_allocated() - before <= 2 * cublas_workspace_bytes()


def test_card_memory_counts_what_the_allocator_does_not_hold() -> None:
    """What a card holds outside the allocator (its context here) does not move when the
    allocator reserves more: reserving moves memory from free to the allocator only."""
    from bigbatch.device import card_memory

    total, outside = card_memory("cuda")  # type: ignore[misc]
    assert total == torch.cuda.get_device_properties(0).total_memory and outside > 0
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    after = card_memory("cuda")
    assert after is not None and abs(after[1] - outside) < 16 * 2**20  # no kernel ran between
    del block
