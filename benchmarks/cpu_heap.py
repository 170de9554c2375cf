"""How far glibc's default heap takes a CPU training process past the predicted peak, and what
giving freed memory back to the system (`bigbatch.device.return_freed_cpu_memory`) costs.

Each model trains `--steps` steps (AdamW) in its own subprocess, once with glibc's default heap
and once with freed memory returned, alternately; each reports the process's high-water mark
(VmHWM) above its size before the model was built, and samples/s after the first step. The
parent predicts the step (calibrated) and prints, per model, the excess over the prediction in
units of the step's working set (activations and temporaries: what `CPU_HEAP_GROWTH` bounds)
and the speed ratio.

    python benchmarks/cpu_heap.py                   # small GPT, resnet10t, convnext_atto; 16 x 40
    python benchmarks/cpu_heap.py --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("gpt", "resnet10t", "convnext_atto")
M = 2**20


class GPT(nn.Module):
    """A small causal LM: two transformer encoder blocks with a causal mask, vocabulary 256."""

    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def spec(name: str, micro: int):  # type: ignore[no-untyped-def]
    from bigbatch.memory.step import StepSpec
    from bigbatch.models import timm_factory

    if name == "gpt":
        return StepSpec(GPT, (256,), micro, input_dtype=torch.long, vocab=256, step=lm_loss)
    return StepSpec(timm_factory(name, num_classes=10), (3, 64, 64), micro)


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def child(name: str, mode: str, micro: int, steps: int) -> dict[str, float]:
    from bigbatch.device import return_freed_cpu_memory
    from bigbatch.memory.measure import real_step_setup
    from bigbatch.memory.step import make_inputs, run_training_step

    if mode == "returned":
        return_freed_cpu_memory()
    s = spec(name, micro)
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))]).step()  # what any optimizer step imports
    base = status("VmRSS")
    model, opt, _ = real_step_setup(s, 0)
    run_training_step(model, opt, make_inputs(s, "cpu"), s, "cpu")  # creates the state
    start = time.perf_counter()
    for _ in range(steps - 1):  # one batch at a time, as a loader hands them over
        run_training_step(model, opt, make_inputs(s, "cpu"), s, "cpu")
    seconds = time.perf_counter() - start
    return {"hwm": status("VmHWM") - base, "samples_per_s": micro * (steps - 1) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(*args.child, args.micro, args.steps)))
        return
    from bigbatch.memory.calibrate import calibrate
    from bigbatch.memory.predict import predict_peak

    rows = []
    for name in args.models:
        p = predict_peak(spec(name, args.micro), calibration=calibrate(spec(name, 2)))
        working = p.activations + p.temporaries + p.workspace_bytes
        got = {}
        for mode in ("default", "returned"):
            done = subprocess.run(
                [sys.executable, __file__, "--child", name, mode, *sys.argv[1:]],
                capture_output=True,
                text=True,
                check=True,
            )
            got[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "model": name,
                "micro_batch": args.micro,
                "threads": args.threads,
                "predicted_mib": round(p.peak_bytes / M, 1),
                "working_set_mib": round(working / M, 1),
                **{
                    f"excess_over_working_set_{mode}": round((r["hwm"] - p.peak_bytes) / working, 2)
                    for mode, r in got.items()
                },
                **{f"hwm_mib_{mode}": round(r["hwm"] / M, 1) for mode, r in got.items()},
                **{
                    f"samples_per_s_{mode}": round(r["samples_per_s"], 1) for mode, r in got.items()
                },
                "speed_ratio_returned": round(
                    got["returned"]["samples_per_s"] / got["default"]["samples_per_s"], 2
                ),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(
            f"{r['model']:<14} mb {r['micro_batch']}, {r['threads']} thread(s): predicted "
            f"{r['predicted_mib']} MiB (working set {r['working_set_mib']}); VmHWM default "
            f"{r['hwm_mib_default']} (+{r['excess_over_working_set_default']} x working set), "
            f"returned {r['hwm_mib_returned']} (+{r['excess_over_working_set_returned']} x); "
            f"samples/s {r['samples_per_s_default']} -> {r['samples_per_s_returned']} "
            f"(x{r['speed_ratio_returned']})"
        )


if __name__ == "__main__":
    main()
