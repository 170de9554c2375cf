"""How long `bigbatch plan --hf` takes for 7-8B models from the command line, imports included:
a Llama-3-8B- and a Qwen2.5-7B-shaped config (benchmarks/gpu_matrix.py's HF_CONFIGS, written to
a folder: no download), LoRA r=16 on a 24 GB card and QLoRA 4-bit on a 16 GB one, each in a
fresh process, against the minute a plan of such a model aims for.

    python benchmarks/plan_lm_time.py [--rounds 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_matrix import HF_CONFIGS

TARGET_S = 60.0
CASES = [
    ("llama3-8b", "LoRA r=16, 2048 tokens, 24 GB", ["--lora", "16", "--seq-len", "2048",
                                                    "--budget", "rtx4090"]),
    ("qwen2.5-7b", "QLoRA 4-bit r=16, 1024 tokens, 16 GB", ["--lora", "16", "--qlora",
                                                             "--seq-len", "1024", "--budget", "t4"]),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, what, flags in CASES:
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
            argv = [sys.executable, "-m", "bigbatch", "plan", "--hf", str(folder), "--batch",
                    "16", "--gradient-checkpointing", "--json", *flags]  # fmt: skip
            times, plan = [], {}
            for _ in range(args.rounds):
                start = time.perf_counter()
                done = subprocess.run(argv, check=True, capture_output=True, text=True)
                times.append(time.perf_counter() - start)
                plan = json.loads(done.stdout)
            seconds = statistics.median(times)
            results.append({
                "model": name, "setup": what, "seconds": round(seconds, 1),
                "ratio_to_target": round(seconds / TARGET_S, 2),
                "micro_batch": plan["micro_batch"], "accumulation": plan["accumulation"],
                "peak_gib": round(plan["peak_bytes_per_rank"] / 2**30, 2),
            })  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        print(f"{r['model']:<11} {r['setup']:<38} {r['seconds']:>6.1f} s  "
              f"({r['ratio_to_target']:.2f} of {TARGET_S:.0f} s)  micro-batch {r['micro_batch']} "
              f"x {r['accumulation']}, peak {r['peak_gib']} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
