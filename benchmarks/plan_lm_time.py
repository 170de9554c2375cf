"""How long `bigbatch plan --hf` takes for 7-8B models from the command line, imports included:
a Llama-3-8B-, a Mistral-7B- and a Qwen2.5-7B-shaped config (benchmarks/gpu_matrix.py's
HF_CONFIGS, written to a folder: no download), LoRA r=16 on a 24 GB card and QLoRA 4-bit on a
16 GB one, each in a fresh process, against the minute a plan of such a model aims for. With
--against-trace, each plan again with every size traced in full rather than bounded from below
first (bigbatch.memory.predict.live_peak), in the same run: the same plan, and the ratio of the
times. With --against-depth, each plan again with every trace made at the model's own depth
rather than from its 5-layer model's (bigbatch.memory.stack), likewise.
With --large, a Llama-3-70B-shaped QLoRA plan on an 80 GB card too (two to three minutes a
round on 2 cores; no target). With --bound, in one process, the Llama plan's lower bound on
micro-batch 2 as the planner makes it (its trace stopped once past the usable memory and the
held gradients twice over) beside the same bound traced to the end of its step, alternately,
``--rounds`` times each.

    python benchmarks/plan_lm_time.py [--rounds 1] [--against-trace] [--large] [--bound] [--json]
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
# The command with the planner's lower bounds switched off: every size it asks for is traced.
TRACED = (
    "import sys; import bigbatch.memory.plan as plan; "
    "plan._Predictions.beyond = lambda *args: None; "
    "plan._Predictions.whole = lambda self, b, *args: self.alone(b); "
    "from bigbatch.cli.main import console; sys.argv[0] = 'bigbatch'; console()"
)
# The command with every trace made at the model's own depth (no layer stack).
FULL_DEPTH = (
    "import sys; import bigbatch.memory.lm_model as lm; lm._layer_stack = lambda *args: None; "
    "from bigbatch.cli.main import console; sys.argv[0] = 'bigbatch'; console()"
)
CASES = [
    ("llama3-8b", "LoRA r=16, 2048 tokens, 24 GB", ["--lora", "16", "--seq-len", "2048",
                                                    "--budget", "rtx4090"]),
    ("mistral-7b", "LoRA r=16, 1024 tokens, 24 GB", ["--lora", "16", "--seq-len", "1024",
                                                     "--budget", "rtx4090"]),
    ("qwen2.5-7b", "QLoRA 4-bit r=16, 1024 tokens, 16 GB", ["--lora", "16", "--qlora",
                                                             "--seq-len", "1024", "--budget", "t4"]),
]  # fmt: skip
LARGE = ("llama3-70b", "QLoRA 4-bit r=16, 2048 tokens, 80 GB",
         ["--lora", "16", "--qlora", "--seq-len", "2048", "--budget", "a100-80gb"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--against-trace", action="store_true")
    parser.add_argument("--against-depth", action="store_true")
    parser.add_argument("--large", action="store_true")
    parser.add_argument("--bound", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.bound:
        bounds = bound_times(args.rounds)
        print(json.dumps(bounds, indent=1) if args.json else
              f"micro-batch 2's bound: stopped {bounds['stopped_seconds']} s "
              f"({bounds['stopped_gib']} GiB), whole step {bounds['whole_seconds']} s "
              f"({bounds['whole_gib']} GiB): {bounds['ratio']:.2f}x the time")  # fmt: skip
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, what, flags in [*CASES, *([LARGE] if args.large else [])]:
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
            argv = ["plan", "--hf", str(folder), "--batch", "16", "--gradient-checkpointing",
                    "--json", *flags]  # fmt: skip
            seconds, plan = _timed([sys.executable, "-m", "bigbatch", *argv], args.rounds)
            row = {
                "model": name, "setup": what, "seconds": round(seconds, 1),
                "ratio_to_target": None if name == LARGE[0] else round(seconds / TARGET_S, 2),
                "micro_batch": plan["micro_batch"], "accumulation": plan["accumulation"],
                "peak_gib": round(plan["peak_bytes_per_rank"] / 2**30, 2),
            }  # fmt: skip
            if args.against_trace:
                traced, same = _timed([sys.executable, "-c", TRACED, *argv], args.rounds)
                row |= {"traced_seconds": round(traced, 1),
                        "ratio_to_traced": round(seconds / traced, 2),
                        "same_plan": same == plan}  # fmt: skip
            if args.against_depth:
                deep, same = _timed([sys.executable, "-c", FULL_DEPTH, *argv], args.rounds)
                row |= {"full_depth_seconds": round(deep, 1),
                        "ratio_to_full_depth": round(seconds / deep, 2),
                        "same_plan_at_full_depth": same == plan}  # fmt: skip
            results.append(row)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        traced = (f"; traced in full {r['traced_seconds']} s ({r['ratio_to_traced']:.2f}x, "
                  f"same plan: {r['same_plan']})" if "traced_seconds" in r else "")  # fmt: skip
        traced += (f"; at full depth {r['full_depth_seconds']} s "
                   f"({r['ratio_to_full_depth']:.2f}x, same plan: "
                   f"{r['same_plan_at_full_depth']})" if "full_depth_seconds" in r else "")  # fmt: skip
        target = ("" if r["ratio_to_target"] is None else
                  f"  ({r['ratio_to_target']:.2f} of {TARGET_S:.0f} s)")  # fmt: skip
        print(f"{r['model']:<11} {r['setup']:<38} {r['seconds']:>6.1f} s{target}  "
              f"micro-batch {r['micro_batch']} "
              f"x {r['accumulation']}, peak {r['peak_gib']} GiB{traced}")  # fmt: skip


def bound_times(rounds: int) -> dict[str, float]:
    """The median seconds of the Llama-3-8B LoRA plan's bound on micro-batch 2 (24 GB card,
    2048 tokens), stopped as the planner stops it and traced whole, and the two bounds."""
    import logging

    from bigbatch.memory.lm import LMSetup, lm_spec_at, load_lm_config
    from bigbatch.memory.plan import (
        default_overhead,
        resolve_budget,
        stop_tracing_above,
        usable_bytes,
    )
    from bigbatch.memory.predict import live_peak, predict_peak

    logging.disable(logging.WARNING)  # as `bigbatch plan` does: bitsandbytes' CPU kernels
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(HF_CONFIGS["llama3-8b"]))
        config = load_lm_config(tmp)
    setup = LMSetup(seq_len=2048, lora_r=16, gradient_checkpointing=True)
    spec_at = lm_spec_at(config, setup, device="cuda", precision="bf16")
    usable = usable_bytes(
        resolve_budget("rtx4090", "cuda"), default_overhead("rtx4090", "cuda"), "cuda"
    )
    floor = predict_peak(spec_at(1).in_window(16))
    stop_above = stop_tracing_above(usable, floor)  # as the planner stops it
    times: dict[str, list[float]] = {"stopped": [], "whole": []}
    peaks = {}
    for _ in range(rounds):
        for name, stop in (("stopped", stop_above), ("whole", None)):
            start = time.perf_counter()
            bound = live_peak(spec_at(2).in_window(16), stop_above=stop)
            times[name].append(time.perf_counter() - start)
            assert bound is not None
            peaks[name] = round(bound.peak_bytes / 2**30, 2)
    stopped, whole = (statistics.median(times[k]) for k in ("stopped", "whole"))
    return {
        "stopped_seconds": round(stopped, 1), "whole_seconds": round(whole, 1),
        "ratio": round(stopped / whole, 2), "stopped_gib": peaks["stopped"],
        "whole_gib": peaks["whole"], "stop_above_gib": round(stop_above / 2**30, 2),
    }  # fmt: skip


def _timed(argv: list[str], rounds: int) -> tuple[float, dict]:  # type: ignore[type-arg]
    """The median time of ``rounds`` runs of ``argv``, and the plan (JSON) the last printed."""
    times, plan = [], {}
    for _ in range(rounds):
        start = time.perf_counter()
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        plan = json.loads(done.stdout)
    return statistics.median(times), plan


if __name__ == "__main__":
    main()
