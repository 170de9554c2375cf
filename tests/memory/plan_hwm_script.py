"""Run by test_plan_hwm.py in a subprocess: plan a model into a budget a few tens of MiB above
what this process needs, train two windows at the plan (giving freed memory back to the system
where the plan says so, as bigbatch train does), print the budget and the process's real
high-water mark (VmHWM) as JSON. argv[1]: "timm" or "gpt"; argv[2]: threads."""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# The small GPT (and /proc reader) of benchmarks/cpu_heap.py, which measures what this test
# relies on.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_heap import GPT, lm_loss, status

from bigbatch import Accumulator
from bigbatch.backoff import OOMBackoff, run_window
from bigbatch.device import return_freed_cpu_memory
from bigbatch.memory.plan import plan_micro_batch, plan_under_budget
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec
from bigbatch.models import timm_factory

SLACK = 40 * 2**20  # a few tens of MiB above the need at micro-batch 16


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[2]))
    timm_model = timm_factory("resnet10t", num_classes=10)

    def spec_at(b: int) -> StepSpec:
        if sys.argv[1] == "timm":
            return StepSpec(timm_model, (3, 64, 64), b)
        return StepSpec(GPT, (256,), b, input_dtype=torch.long, vocab=256, step=lm_loss)

    def loss_fn(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if sys.argv[1] == "timm":
            return F.cross_entropy(model(batch[0]), batch[1])
        return lm_loss(model, batch[0])

    if sys.argv[1] == "timm":
        window: tuple[torch.Tensor, ...] = (torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,)))
    else:
        window = (torch.randint(0, 256, (64, 256)),)

    # The library's planning path calibrates and then reads the overhead, as bigbatch train's
    # does; its calibration and overhead set a budget that holds 16 with SLACK to spare.
    probe = plan_under_budget(spec_at, 64, "16GB")
    cal, overhead = probe.calibration, probe.overhead_bytes
    need = predict_peak(spec_at(16), calibration=cal).planning_bytes
    budget = int((overhead + need + SLACK) / 0.9)  # the default 10 % margin on top
    plan = plan_micro_batch(spec_at, 64, budget, calibration=cal, overhead=overhead)
    if plan.return_freed_memory:  # as bigbatch train does: no room for glibc's heap to grow
        return_freed_cpu_memory()
    torch.manual_seed(0)
    model = spec_at(1).model()
    acc = Accumulator(torch.optim.AdamW(model.parameters()))
    backoff = OOMBackoff(micro_batch=plan.micro_batch, grow_after=0)
    for _ in range(2):
        run_window(acc, window, loss_fn, backoff)
    print(
        json.dumps(
            {
                "budget": budget,
                "hwm": status("VmHWM"),
                "micro_batch": plan.micro_batch,
                "overhead": overhead,
                "predicted": plan.predicted_peak_bytes,
                "return_freed_memory": plan.return_freed_memory,
            }
        )
    )
