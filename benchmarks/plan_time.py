"""How long `bigbatch plan` takes from the command line, imports included, per model.

Each model is planned in a fresh process (`python -m bigbatch plan --arch A --size S --batch
128 --budget 2GB --json`), `--rounds` times, alternating the models so machine noise hits them
alike; the median wall time is printed beside the fixed cost every plan pays before its first
trace (a process that imports what the planner imports, then exits the same way), and their
ratio to the 5 s a plan aims for.

    python benchmarks/plan_time.py                        # the four models of the docs
    python benchmarks/plan_time.py --models resnet10t:32 --rounds 1 --json
    python benchmarks/plan_time.py --device cuda --models resnet18:128,convnext_small:128
                                   # a GPU's plan, from this machine (no GPU needed)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

TARGET_S = 5.0
MODELS = "resnet18:64,convnext_atto:64,efficientnet_b0:96,densenet121:64"
# What every plan imports before its first trace; `os._exit` as the command exits (no teardown).
IMPORTS = "import torch, torch._dynamo, timm, bigbatch.memory.plan, os; os._exit(0)"


def _seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help="arch:size,... (timm names)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", help="the plan's target: cpu or cuda")
    parser.add_argument("--budget", default="2GB")
    args = parser.parse_args()
    models = [tuple(m.split(":")) for m in args.models.split(",")]
    if any(len(m) != 2 or not m[1].isdigit() for m in models):
        parser.error(f"--models takes arch:size pairs, e.g. resnet18:64; got {args.models!r}")
    times: dict[str, list[float]] = {"imports": []}
    for _ in range(args.rounds):
        times["imports"].append(_seconds([sys.executable, "-c", IMPORTS]))
        for arch, size in models:
            argv = [sys.executable, "-m", "bigbatch", "plan", "--arch", arch, "--size", size]
            argv += ["--batch", "128", "--budget", args.budget, "--json", "--device", args.device]
            times.setdefault(f"{arch}@{size}", []).append(_seconds(argv))
    result = {
        name: {
            "seconds": round(statistics.median(t), 2),
            "vs_target": round(statistics.median(t) / TARGET_S, 2),
        }
        for name, t in times.items()
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name, r in result.items():
        print(f"{name:24s} {r['seconds']:6.2f} s  {r['vs_target']:.2f} x {TARGET_S:.0f} s")


if __name__ == "__main__":
    main()
