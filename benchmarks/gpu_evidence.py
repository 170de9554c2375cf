"""Everything bigbatch measures on a GPU, in one time-boxed run (`make gpu-evidence`).

    python benchmarks/gpu_evidence.py                  # on a machine with one NVIDIA GPU
    python benchmarks/gpu_evidence.py --dry-run        # no GPU: tiny workloads, every part

Results go to ``benchmarks/results/<gpu>-cuda<version>-<date>/`` (``-run2`` and on where a
finished run's folder is there already; ``--out`` to choose; a dry run writes to
``build/gpu-evidence-dry/``): a JSON per part, the allocator traces, each
part's log, ``summary.json`` and ``summary.md`` naming the card, driver, CUDA, cuDNN and torch.
The parts, each in its own process under its own time box, the slowest last, after the
imports they all make (``imports``: a fresh machine reads them from disk once):

1. ``gpu_tests``: ``pytest -m cuda tests/gpu`` (JUnit XML kept);
2. ``cudnn_workspaces``: cuDNN's workspaces per convolution signature (a card profile);
3. ``decode``: JPEG decoding and augmentation on the GPU against CPU workers;
4. ``memory_matrix``: every row of benchmarks/gpu_matrix.py recorded in its own process
   (forked from one that imported the libraries once: :class:`Recorder`) as an allocator trace
   (gzipped, in tests/memory/data/gpu_truth's format) while the same rows are predicted from
   the CPU (``CUDA_VISIBLE_DEVICES=``) in parallel: predicted against measured allocated,
   reserved and process peaks;
5. ``speed``: the data already on the GPU (the loader-less limit), `bigbatch train` under a
   budget (did it stay under, did the back-off fire), and `bigbatch train` against the
   hand-written timm AMP loop (benchmarks/train_throughput.py; resnet50 fp16, its steady
   state, ViT bf16, then where resnet50's host time goes).

A part that runs out of its time keeps what it wrote; the summary says which parts finished.
Nothing is fetched from the network: the packages a GPU machine lacks are installed from the
wheels benchmarks/prepare_gpu_wheels.sh prepared (the Makefile's target does it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gpu_matrix import matrix, row_name  # noqa: E402

from bigbatch.io import atomic_write_text  # noqa: E402

MiB = 2**20


# ---- the parts that run in a process of their own (--part NAME) ----


def predict_row(row: dict[str, Any]) -> dict[str, Any]:
    """bigbatch's CUDA prediction of a matrix row, made without a GPU."""
    import warnings

    from gpu_matrix import ranks_of, spec_of

    from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES
    from bigbatch.memory.predict import predict_peak

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ranks_of(row):
            p = predict_peak(spec_of(row, "cuda"))
    return {
        "allocated_mib": round(p.allocated_bytes / MiB, 1),
        "reserved_mib": round(p.reserved_bytes / MiB, 1),
        "process_mib": round((p.planning_bytes + CUDA_CONTEXT_BYTES) / MiB, 1),
        "breakdown_mib": {k: round(v / MiB, 1) for k, v in p.parts().items()},
        "notes": list(p.notes),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def loaderless(dry_run: bool) -> dict[str, Any]:
    """The step alone: resnet50 at 224 px, batch 128, fp16 AMP, channels_last, the batch
    already on the GPU (train_throughput's loader-less limit). What no loader can beat. With
    torch's fused AdamW (bigbatch train's on a card) and, side by side, the multi-tensor one
    it replaced: ``fused_over_foreach`` is their ratio of images per second."""
    sys.path.insert(0, str(HERE))
    from train_throughput import Device, loaderless_images_per_s

    device, batch, size, steps = ("cpu", 4, 32, 2) if dry_run else ("cuda", 128, 224, 20)
    precision = "fp16" if device == "cuda" else "fp32"
    dev = Device(device, precision)
    rates = {
        fused: loaderless_images_per_s("resnet50", size, batch, dev, steps, fused=fused)
        for fused in (True, False)
    }
    return {
        "workload": f"resnet50 @ {size} px, batch {batch}, fp16 AMP, channels_last",
        "images_per_s": round(rates[True], 1),
        "foreach_images_per_s": round(rates[False], 1),
        "fused_over_foreach": round(rates[True] / rates[False], 3),
    }


def budget_train(dry_run: bool) -> dict[str, Any]:
    """`bigbatch train` with a budget far below what the target batch needs: what it planned,
    what the allocator reserved, whether the back-off fired."""
    sys.path.insert(0, str(HERE))
    from train_throughput import write_images

    from bigbatch.device import process_rss
    from bigbatch.memory.budget import parse_bytes
    from bigbatch.train.config import load_config
    from bigbatch.train.loop import train

    # On a CPU the budget holds the whole process, whose size (the parts run before, the
    # libraries this machine loads) is no test's to depend on: the dry run's is that plus 768 MiB.
    dry_budget = f"{process_rss() // MiB + 768}MiB"
    arch, size, batch, per_class, budget = (
        ("resnet10t", 32, 16, 8, dry_budget) if dry_run else ("resnet50", 224, 256, 64, "3GiB")
    )
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "images"
        write_images(data, per_class, size, 4, "jpg")
        device = "cpu" if dry_run else "cuda"
        overrides = [f"data={data}", f"arch={arch}", f"size={size}", f"batch={batch}",
                     f"budget={budget}", "epochs=1", f"device={device}", "log_every=0",
                     f"precision={'fp32' if dry_run else 'fp16'}"]  # fmt: skip
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        result = train(load_config(overrides=overrides), Path(tmp) / "run", log=lambda _: None,
                       progress=False)  # fmt: skip
        plan = json.loads((Path(tmp) / "run" / "plan.json").read_text())
    out: dict[str, Any] = {
        "workload": f"{arch} @ {size} px, batch {batch}, budget {budget}",
        "budget_mib": round(parse_bytes(budget) / MiB, 1),
        "plan": plan,
        "backoff_events": [str(e) for e in result.backoff_events],
    }
    if device == "cuda":
        reserved = torch.cuda.max_memory_reserved()
        out["max_reserved_mib"] = round(reserved / MiB, 1)
        out["max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MiB, 1)
        out["stayed_under_budget"] = reserved <= parse_bytes(budget)
    return out


def trainer_budget(dry_run: bool, plan_file: Path | None, wait_seconds: float) -> dict[str, Any]:
    """Hugging Face Trainer set from `bigbatch plan --hf`'s plan under a budget (LoRA on a
    Qwen2.5-0.5B-shaped model): benchmarks/trainer_budget.py, its plan from ``plan_file``
    (the orchestrator's planner, started on the CPU at the beginning) where it comes in time."""
    sys.path.insert(0, str(HERE))
    import trainer_budget as tb

    return tb.run(dry_run, plan_file, wait_seconds)


def start_planner(out: Path, dry_run: bool) -> tuple[subprocess.Popen[bytes], Path]:
    """trainer_budget's plan, made on the CPU while the other parts use the GPU: on the H200
    its tracing took most of the 140 s that run had. CUDA is hidden from it (a context of its
    own would count in what the tests and the matrix measure of the card), so it plans for
    sm90's profile and 132 multiprocessors, the H100's and the H200's alike."""
    path = out / "trainer-plan.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "trainer_budget.py"), "--plan-out", str(path)]
    cmd += ["--dry-run"] if dry_run else []
    (out / "logs").mkdir(exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    with open(out / "logs" / "trainer_plan.log", "wb") as log:  # the child keeps its own copy
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return process, path


def benchmark_json(script: str, args: list[str], seconds: float) -> dict[str, Any]:
    """What ``benchmarks/<script> ARGS --json`` printed, run in a process of its own; its
    error output, where it failed."""
    done = subprocess.run(
        [sys.executable, str(HERE / script), *args, "--json"],
        capture_output=True, text=True, timeout=max(1.0, seconds),
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout[done.stdout.index("{") :])


def checkpoint_stall(dry_run: bool) -> dict[str, Any]:
    """How long an epoch's checkpoints hold the training thread, written there or handed to
    the writer's thread (benchmarks/checkpoint_stall.py; resnet50's weights on the GPU)."""
    args = ["--arch", "resnet10t", "--rounds", "1"] if dry_run else ["--device", "cuda"]
    return benchmark_json("checkpoint_stall.py", args, 120)


def throughput(
    dry_run: bool,
    arch: str,
    precision: str,
    seconds_left: float,
    profile: bool = False,
    passes: int = 1,
    from_command: bool = False,
    side_by_side: bool = True,
) -> dict[str, Any]:
    """`bigbatch train` against the hand loop: issue 35's 3000 JPEGs (at 1500 an epoch was 10
    steps, and each loop's time the loader's first batches); with ``profile`` one more run of
    each under cProfile, and nothing else, says where bigbatch's host time goes (loader waits,
    reads, Python); with ``passes``, two epochs of the training images that many times over
    (the second epoch the steady state); with ``from_command``, one run of each in a process
    of its own: from its start to the first step and to the end. Without ``side_by_side``,
    the profiled or commanded runs alone, nothing timed side by side."""
    steady = ["--passes", str(passes), "--epochs", "2"] if passes > 1 else []
    args = (
        ["--arch", "resnet10t", "--size", "32", "--per-class", "8", "--batch", "8", "--micro",
         "8", "--epochs", "2", "--rounds", "1", "--limit-steps", "2"]
        if dry_run else
        ["--device", "cuda", "--precision", precision, "--arch", arch, "--size", "224",
         "--batch", "128", "--micro", "128", "--classes", "10", "--per-class", "300",
         "--stored-size", "256", "--format", "jpg", "--epochs", "3", "--rounds", "1",
         "--workers", "8"]
    ) + (["--profile"] if profile else []) + steady  # fmt: skip
    args += ["--from-command"] if from_command else []
    args += [] if side_by_side else ["--rounds", "0"]
    return benchmark_json("train_throughput.py", args, seconds_left)


def dry_jobs(
    jobs: list[tuple[str, Any]], out: dict[str, Any], left: Callable[[], float]
) -> list[tuple[str, Any]]:
    """The dry run's speed jobs: the ViT's run is resnet50's code with another model and the
    steady one's with more passes, so neither runs, and resnet50's takes two passes (the steady
    job's code path); its side-by-side, commanded and profiled runs are one process (each its
    own on a GPU, where each one's time box matters), the result filed under each name."""
    both = ("resnet50_fp16_command", "resnet50_fp16_profile")
    skipped = ("vit_base_bf16", "resnet50_fp16_steady", *both)

    def resnet50() -> dict[str, Any]:
        return throughput(True, "resnet50", "fp16", left(), True, passes=2, from_command=True)

    kept = [
        (name, resnet50 if name == "resnet50_fp16" else job)
        for name, job in jobs
        if name not in skipped
    ]
    return kept + [(name, lambda: out["resnet50_fp16"]) for name in both]


def speed(dry_run: bool, seconds: float, plan_file: Path | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    out: dict[str, Any] = {}

    def left() -> float:
        return deadline - time.monotonic()

    jobs: list[tuple[str, Any]] = [
        ("loaderless", lambda: loaderless(dry_run)),
        ("budget_train", lambda: budget_train(dry_run)),
        ("checkpoint_stall", lambda: checkpoint_stall(dry_run)),
        ("resnet50_fp16", lambda: throughput(dry_run, "resnet50", "fp16", left())),
        # On the H200 (2026-11-28) it took 140 s of this part's 165 and no loop was reached:
        # most of it the plan's tracing on the CPU, made beforehand now (waited for while a
        # minute of the box would be left after), and the model's random fills on the CPU,
        # made on the GPU now. What is left is its training (seconds).
        ("trainer_budget", lambda: trainer_budget(dry_run, plan_file, max(0.0, left() - 60))),
        # Steady state: an epoch of 19,200 images (the 2,400 training JPEGs 8 times over).
        ("resnet50_fp16_steady", lambda: throughput(dry_run, "resnet50", "fp16", left(), passes=8)),
        # The fixed costs as a user's command meets them: each loop in a process of its own.
        (
            "resnet50_fp16_command",
            lambda: throughput(
                dry_run, "resnet50", "fp16", left(), from_command=True, side_by_side=False
            ),
        ),
        ("vit_base_bf16", lambda: throughput(dry_run, "vit_base_patch16_224", "bf16", left())),
        # Last, where the time box allows: where each loop's host time goes.
        (
            "resnet50_fp16_profile",
            lambda: throughput(dry_run, "resnet50", "fp16", left(), True, side_by_side=False),
        ),
    ]
    if dry_run:
        jobs = dry_jobs(jobs, out, left)
    for name, job in jobs:
        if left() < (60 if name.endswith("_profile") and not dry_run else 0):
            out[name] = {"skipped": "out of time"}
            continue
        try:
            out[name] = job()
        except Exception as e:  # one job's failure is a result; the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# ---- the orchestrator ----


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory_mib": props.total_memory // MiB,
            "compute_capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        }
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        info["driver"] = smi.stdout.strip() or None
    return info


def results_dir(info: dict[str, Any], dry_run: bool) -> Path:
    if dry_run:
        return ROOT / "build" / "gpu-evidence-dry"
    gpu = re.sub(r"[^a-z0-9]+", "-", info["gpu"].lower()).strip("-")
    gpu = gpu.removeprefix("nvidia-")
    base = HERE / "results" / f"{gpu}-cuda{info['cuda']}-{info['date']}"
    # A finished run's folder (its summary written) is never written over: a second run that
    # day gets a folder of its own. One its time box cut is finished where it stopped.
    out, n = base, 1
    while (out / "summary.json").exists():
        n += 1
        out = base.with_name(f"{base.name}-run{n}")
    return out


class Parts:
    """Runs each part in its own process under its time box, keeping its log and status."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.status: dict[str, dict[str, Any]] = {}
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def run(self, name: str, cmd: list[str], seconds: float) -> None:
        t0 = time.monotonic()
        log = self.out / "logs" / f"{name}.log"
        with log.open("w") as f:
            try:
                done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=seconds,
                                      cwd=ROOT)  # fmt: skip
                state = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
            except subprocess.TimeoutExpired:
                state = f"out of time ({seconds:.0f} s)"
        self.status[name] = {"state": state, "seconds": round(time.monotonic() - t0, 1)}
        print(f"[gpu-evidence] {name}: {state} in {self.status[name]['seconds']} s", flush=True)


def card_tag(gpu: str) -> str:
    """The short name the committed traces' folders start with: ``h100`` for an "NVIDIA H100
    80GB HBM3"."""
    name = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).removeprefix("nvidia-")
    return name.split("-")[0]


def committed_traces(card: str) -> dict[str, Path]:
    """The matrix rows whose traces from this card are in the tests' data, by name: its
    ``<card>-torch<version>/`` folders, and for the H100 the first traces at the top."""
    root = ROOT / "tests" / "memory" / "data" / "gpu_truth"
    folders = [d for d in root.glob(f"{card}-*") if d.is_dir()] if card else []
    if card == "h100":
        folders.append(root)
    return {p.name.removesuffix(".json.gz"): p for d in folders for p in d.glob("*.json.gz")}


def committed(card: str) -> set[str]:
    """The names of :func:`committed_traces`."""
    return set(committed_traces(card))


def recording_order(rows: list[dict[str, Any]], done: set[str]) -> list[dict[str, Any]]:
    """The rows a card lacks first (a short time box records what the tests lack), then one
    language model's row whose trace is committed: recorded again, it checks that building
    such a model without its random fills (record_trace.model_and_optimizer) records the bytes
    the committed trace, made with them, did; then the rest (a trace recorded twice on one
    stack has matched to the byte)."""
    lacking = [r for r in rows if row_name(r) not in done]
    check = [r for r in rows if row_name(r) in done and r["kind"] == "hf"][:1]
    return lacking + check + [r for r in rows if row_name(r) in done and r not in check]


def same_as_committed(new: Path, old: Path) -> dict[str, int]:
    """A trace recorded again against its committed one: the bytes each peak moved."""
    import gzip

    peaks = []
    for path in (new, old):
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
        peaks.append((trace["max_allocated_bytes"], trace["max_reserved_bytes"]))
    return {
        "allocated_bytes_moved": peaks[0][0] - peaks[1][0],
        "reserved_bytes_moved": peaks[0][1] - peaks[1][1],
    }


class Recorder:
    """Each matrix row recorded in a process forked from a forkserver that imported torch and
    the model libraries once: the row's process starts CUDA afresh (the forkserver never does:
    ``PYTORCH_NVML_BASED_CUDA_CHECK`` keeps even an import's ``is_available()`` off CUDA), so
    its trace starts from an empty allocator as a process of its own would, without paying the
    imports again (on the H100, 17 rows took 44 s, most of a row's 2.6 s the imports). Where a
    forked row fails, the row is recorded in a new process as before; where it succeeds there,
    the fork was at fault and the rest are recorded in new processes too (``usable`` off)."""

    def __init__(self, dry_run: bool, threads: int | None = None) -> None:
        import multiprocessing

        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        self.dry_run, self.usable, self.threads = dry_run, True, threads
        self.context = multiprocessing.get_context("forkserver")
        # transformers and its Llama and Qwen2 modules too (1-3 s a language model's row):
        # none of them starts CUDA on import. Not peft: it imports bitsandbytes, which asks
        # CUDA for each card's capability and would leave every fork unable to use it.
        lm = [
            "transformers",
            *(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen2")),
        ]
        self.context.set_forkserver_preload(["torch", "timm", *lm, "record_trace"])

    def record(self, row: dict[str, Any], path: Path, seconds: float) -> dict[str, Any] | None:
        """None where the trace was written; else the error (and the recorder falls back)."""
        import record_trace

        process = self.context.Process(
            target=record_trace.record_to, args=(row, path, self.dry_run, self.threads)
        )
        process.start()
        process.join(seconds)
        if process.is_alive():
            process.kill()
            process.join()
            return {"error": "out of time"}
        if process.exitcode == 0 and path.exists():
            return None
        error = path.with_name(path.name + ".error")
        said = error.read_text() if error.exists() else f"exit code {process.exitcode}"
        print(
            f"[memory_matrix] a forked recording failed, again in a new process: {said}", flush=True
        )
        return {"error": said[-1500:]}


def memory_matrix(out: Path, dry_run: bool, seconds: float, card: str = "") -> dict[str, Any]:
    """Record each row on the GPU in its own process, one at a time, while the CPU predicts
    the rows in parallel; then pair them."""
    deadline = time.monotonic() + seconds
    rows = matrix(dry_run)
    known = committed_traces(card)
    rows = recording_order(rows, set(known))
    traces = out / "traces"
    traces.mkdir(exist_ok=True)
    cpu_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    flags = ["--dry-run"] if dry_run else []

    def predict(row: dict[str, Any]) -> dict[str, Any]:
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--part", "predict", "--row", json.dumps(row)],
                capture_output=True, text=True, env=cpu_env,
                timeout=max(1.0, deadline - time.monotonic()),
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": "out of time"}
        if done.returncode:
            return {"error": done.stderr[-1500:]}
        return json.loads(done.stdout.strip().splitlines()[-1])

    # The predictions run beside the recordings, two threads each; a recording gets the cores
    # they leave. A language model's row took 45-60 s on the H200, its steps 1-2 s: its random
    # weights, filled on the CPU, were 10-20 s of it on 2 cores here (record_trace now builds
    # it without them), its imports a few more (the forkserver has them now).
    workers = max(1, min(6, (os.cpu_count() or 2) // 3))
    threads = max(1, (os.cpu_count() or 2) - 2 * workers)
    forked = Recorder(dry_run, threads)

    def record(row: dict[str, Any]) -> dict[str, Any]:
        path = traces / f"{row_name(row)}.json.gz"
        if path.exists():  # a rerun finishes what an earlier run's time box cut
            return summarise(path)
        fork_failed = False
        if forked.usable:
            result = forked.record(row, path, max(1.0, min(90.0, deadline - time.monotonic())))
            if result is None:
                return summarise(path)
            if result["error"] == "out of time":
                return result
            fork_failed = True  # the row again, in a process of its own
        try:
            done = subprocess.run(
                [sys.executable, str(HERE / "record_trace.py"), json.dumps(row), str(path), *flags],
                capture_output=True, text=True, timeout=max(1.0, min(90.0, deadline - time.monotonic())),
                env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": "out of time"}
        if done.returncode:
            return {"error": done.stderr[-1500:]}  # the row's own failure: the next rows fork
        if fork_failed:  # a new process recorded what the fork could not: the fork's fault
            print("[memory_matrix] the fork was at fault: new processes from here", flush=True)
            forked.usable = False
        return summarise(path)

    def summarise(path: Path) -> dict[str, Any]:
        import gzip

        with gzip.open(path, "rt") as f:
            trace = json.load(f)
        stages = trace["process_used_mib_by_stage"]
        return {
            "allocated_mib": round(trace["max_allocated_bytes"] / MiB, 1),
            "reserved_mib": round(trace["max_reserved_bytes"] / MiB, 1),
            "process_mib": stages.get("after_two_steps"),
            "context_mib": stages.get("after_cudnn"),
            "optimizer_steps_skipped": trace.get("optimizer_steps_skipped", 0),
            "two_steps_seconds": trace.get("two_steps_seconds"),
            "seconds_by_stage": trace.get("seconds_by_stage"),
            "events": len(trace["events"]),
        }

    with ThreadPoolExecutor(max_workers=workers) as pool:
        predictions = [pool.submit(predict, r) for r in rows]
        measured = []
        for row in rows:
            if time.monotonic() >= deadline:
                measured.append({"error": "out of time"})
                continue
            t0 = time.monotonic()
            measured.append(record(row))
            # The row's whole time (the fork or process, the model, the trace's writing): on
            # the H200 a language model's row took 45-60 s where its two steps took 1-2.
            measured[-1]["row_seconds"] = round(time.monotonic() - t0, 1)
        predicted = [p.result() for p in predictions]

    def error(p: dict[str, Any], m: dict[str, Any], key: str) -> float | None:
        if p.get(key) is None or not m.get(key):
            return None
        return round(100 * (p[key] - m[key]) / m[key], 2)

    table = []
    for row, p, m in zip(rows, predicted, measured, strict=True):
        name = row_name(row)
        table.append({
            "name": name, "row": row, "predicted": p, "measured": m,
            "error_pct": {k: error(p, m, f"{k}_mib") for k in ("allocated", "reserved", "process")},
        })  # fmt: skip
        if name in known and "error" not in m:
            table[-1]["same_as_committed"] = same_as_committed(
                traces / f"{name}.json.gz", known[name]
            )
    done = [r for r in table if r["error_pct"]["reserved"] is not None]
    within = {
        f"{key}_within_{pct}pct": sum(
            1 for r in done if r["error_pct"][key] is not None and abs(r["error_pct"][key]) <= pct
        )
        for key in ("reserved", "process")
        for pct in (3, 5)
    }
    return {"rows": table, "rows_measured": len(done), "rows_total": len(rows), **within}


def summary_md(info: dict[str, Any], status: dict[str, Any], results: dict[str, Any]) -> str:
    lines = [
        f"# GPU evidence: {info.get('gpu', 'cpu (dry run)')}, {info['date']}",
        "",
        f"Driver {info.get('driver')}, CUDA {info.get('cuda')}, cuDNN {info.get('cudnn')}, "
        f"torch {info['torch']}, Python {info['python']}, {info['cpus']} CPUs. "
        "Made by `make gpu-evidence` (benchmarks/gpu_evidence.py).",
        "",
        "| part | state | seconds |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {k} | {v['state']} | {v['seconds']} |" for k, v in status.items()]
    mm = results.get("memory_matrix")
    if mm:
        lines += [
            "",
            f"## Memory matrix: {mm['rows_measured']} of {mm['rows_total']} rows measured; "
            f"reserved within 3 % on {mm['reserved_within_3pct']}, within 5 % on "
            f"{mm['reserved_within_5pct']}; process within 3 % on {mm['process_within_3pct']}",
            "",
            "| row | allocated MiB pred / meas | reserved MiB pred / meas (error) | process MiB pred / meas (error) |",
            "| --- | --- | --- | --- |",
        ]
        for r in mm["rows"]:
            p, m, e = r["predicted"], r["measured"], r["error_pct"]
            if "error" in m or "error" in p:
                lines.append(f"| {r['name']} | {(m.get('error') or p.get('error'))[:60]!r} | | |")
                continue
            lines.append(
                f"| {r['name']} | {p['allocated_mib']:,.0f} / {m['allocated_mib']:,.0f} "
                f"| {p['reserved_mib']:,.0f} / {m['reserved_mib']:,.0f} ({e['reserved']:+.1f} %) "
                f"| {p['process_mib']:,.0f} / {m['process_mib'] or 0:,.0f} "
                f"({e['process'] if e['process'] is not None else float('nan'):+.1f} %) |"
            )
        again = [
            (r["name"], r["same_as_committed"]) for r in mm["rows"] if "same_as_committed" in r
        ]
        if again:
            lines += ["", "Recorded again against the committed traces (bytes each peak moved):"]
            lines += [f"- {name}: allocated {d['allocated_bytes_moved']:+,}, reserved "
                      f"{d['reserved_bytes_moved']:+,}" for name, d in again]  # fmt: skip
    sp = results.get("speed") or {}
    for key in ("resnet50_fp16", "resnet50_fp16_steady", "vit_base_bf16"):
        r = sp.get(key) or {}
        if "ratio_vs_hand_loop" in r:
            steady = r.get("steady_ratio")
            lines += ["", f"Speed, {r['workload']}: images/s hand {r['images_per_s']['hand']}, "
                      f"bigbatch {r['images_per_s']['bigbatch']}; ratio per epoch "
                      f"{r['ratio_vs_hand_loop']:.3f} (after the first epoch "
                      f"{steady if steady is None else round(steady, 3)}), whole run "
                      f"{r['whole_run_ratio']:.3f}"]  # fmt: skip
            fraction = r.get("fraction_of_loaderless") or {}
            lines += [f"- last epoch as a fraction of the loader-less limit "
                      f"({r.get('loaderless_images_per_s')} images/s): hand "
                      f"{fraction.get('hand')}, bigbatch {fraction.get('bigbatch')}; to the "
                      f"first optimizer step: {r.get('first_step_seconds')} s"]  # fmt: skip
            # Its choice after the first epoch and, where it moved to the GPU, the verdict.
            lines += [f"- bigbatch's {line}" for line in r.get("decode_said", [])[:2]]
    command = (sp.get("resnet50_fp16_command") or {}).get("from_command")
    if command:
        h, b = command["hand"], command["bigbatch"]
        lines += [f"- from each command's start (its own process, imports included), resnet50: "
                  f"to the first optimizer step hand {h['to_first_step']} s, bigbatch "
                  f"{b['to_first_step']} s; to the end {h['to_end']} s against {b['to_end']} s "
                  f"(whole run {command['whole_run_ratio']})"]  # fmt: skip
    for who, prof in ((sp.get("resnet50_fp16_profile") or {}).get("profile") or {}).items():
        lines.append(f"- profiled resnet50, {who}: {prof['seconds']} s of host time; seconds "
                     f"under {prof.get('split_seconds')} (data_wait: waiting for batches)")  # fmt: skip
    if "images_per_s" in (sp.get("loaderless") or {}):
        lines += ["", f"Loader-less limit: {sp['loaderless']['images_per_s']} images/s "
                  f"({sp['loaderless']['workload']})"]  # fmt: skip
    bt = sp.get("budget_train") or {}
    if "max_reserved_mib" in bt:
        lines += ["", f"`bigbatch train` under a budget ({bt['workload']}): reserved "
                  f"{bt['max_reserved_mib']} MiB of {bt['budget_mib']} MiB, stayed under: "
                  f"{bt['stayed_under_budget']}, back-off events: {len(bt['backoff_events'])}"]  # fmt: skip
    tr = sp.get("trainer_budget") or {}
    if "max_reserved_mib" in tr:
        lines += ["", f"Trainer set from a plan ({tr['workload']}): micro-batch "
                  f"{tr['trainer_micro_batch']}, reserved {tr['max_reserved_mib']} MiB"
                  + (f" (allocated {tr['max_allocated_mib']} MiB, {tr['alloc_retries']} cache "
                     "releases at the cap)" if "max_allocated_mib" in tr else "")
                  + ", predicted "
                  f"{tr['predicted_peak_mib']} MiB, cap {tr['cap_mib']} MiB, stayed under: "
                  f"{tr['stayed_under_cap']}, refits and back-offs: "
                  f"{'; '.join(tr['backoffs']) or 'none'}"]  # fmt: skip
    if "eval_max_reserved_mib" in tr:
        lines += [f"Its evaluation, {tr['eval_batch']} sequences a pass: reserved "
                  f"{tr['eval_max_reserved_mib']} MiB, predicted {tr['eval_predicted_peak_mib']} "
                  f"MiB ({tr['eval_prediction_error']:+.1%})"]  # fmt: skip
    stall = results.get("checkpoint_stall") or sp.get("checkpoint_stall")
    stall = stall if stall and "stall_seconds" in stall else None
    if stall:
        lines += ["", f"Checkpoint stall ({stall['workload']}): inline "
                  f"{stall['stall_seconds']['inline']} s, on the writer's thread "
                  f"{stall['stall_seconds']['background']} s ({stall['stall_ratio']}x)"]  # fmt: skip
    dec = results.get("decode")
    if dec:
        lines += ["", f"Decoding ({dec['workload']}): {dec['images_per_s']} images/s, GPU / CPU "
                  f"workers {dec['gpu_over_cpu']}"]  # fmt: skip
    cu = results.get("cudnn_workspaces")
    if cu:
        lines += ["", f"cuDNN profile: {cu['signatures_done']} of {cu['signatures_total']} "
                  "signatures (cudnn-profile.json)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def orchestrate(args: argparse.Namespace) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device here: run on a machine with an NVIDIA GPU, or DRY=1",
              file=sys.stderr)  # fmt: skip
        return 2
    info = machine()
    out = args.out or results_dir(info, args.dry_run)
    out.mkdir(parents=True, exist_ok=True)
    parts = Parts(out)
    # The boxes below add up to 535 s on a GPU (the 9 minutes a session's device time leaves
    # after the machine's start). A dry run's are four times as long: it checks the code paths
    # on a CPU that other jobs may share (two test suites at once took one of the matrix's two
    # rows past its 37 s), and times nothing.
    seconds = args.seconds or (4 * 535.0 if args.dry_run else 535.0)
    scale = seconds / 535
    dry = ["--dry-run"] if args.dry_run else []
    me = [sys.executable, __file__, *dry, "--out", str(out)]
    card = card_tag(info.get("gpu", ""))
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/gpu",
                  "-p", "no:cacheprovider", "--timeout=90", f"--junitxml={out / 'tests-gpu.xml'}"]  # fmt: skip
    # Before (boxes of 480 s): on an H100 (398 s in all) the tests took 83 s (the budgeted
    # run failed at once; it trains for about 25 s), the cuDNN sweep's 599 signatures 29 s (its
    # 1126 now, the 3D U-Net's and EfficientNet's too, took 85 s on a warm machine: the ones
    # the model lacks come first), decoding 16 s, the matrix 143 s for 12 of its 24 rows (a row's
    # own process, CUDA's start and the model take 12 s; each row's trace is committed, the H100's
    # and the H200's alike, so the matrix now gets what is left), the speed part 120 s (resnet50's
    # loops take 40 s, the ViT's 75 s, then the profiled runs). The third H100 run (494 s):
    # tests 105 s for 12 (the ConvNeXt slope now measures b64 too: 135 s), sweep 946 of 1174
    # in 70 s, decoding 23 s, the matrix 3 rows in 56 s (45 s now, the rows the card lacks first),
    # speed 172 s (the profiled run skipped where under 60 s is left). The fourth (473 s): the
    # tests' 11 passed at their box's end (135 s), decoding ran out of its 25 s on a fresh
    # machine (24 s on a warm one), so both take 10 s of the sweep's: every signature it
    # sweeps is in the packaged profile now, and it sweeps any that is not first. The fifth
    # (447 s): every part passed but the sweep, which its box killed as in every run since the
    # first (its 45 s counted from after its imports and CUDA's start, and the last signature
    # begun ran on): it now counts from its process's start and begins no signature that one as
    # slow as its slowest would not finish. The sixth (438 s): the matrix measured 17 of its 24
    # rows in 44 s (2.6 s a row, most of it a new process's imports): its rows are forked from
    # a forkserver that imported them once now (Recorder), and it has 100 s for its 38 rows.
    # First, the imports every part makes, untimed by them: on a fresh machine (files not yet
    # in the page cache) MONAI's import alone took 22 s, and every part ran out of its box. A
    # dry run's files are in the page cache already (the tests imported them): it imports torch
    # and bigbatch to run the part's code, where MONAI's import took 25 s beside the tests
    # (TensorFlow's with it, through TensorBoard's writer).
    modules = (
        ("torch", "bigbatch")
        if args.dry_run
        else ("torch", "torchvision", "timm", "monai", "segmentation_models_pytorch", "bigbatch")
    )
    imports = (
        "import importlib, importlib.util\n"
        f"for m in {modules!r}:\n    importlib.util.find_spec(m) and importlib.import_module(m)"
    )
    plan: list[tuple[str, list[str], float]] = [
        ("imports", [sys.executable, "-c", imports], 30),
        ("gpu_tests", pytest_cmd, 145),
        (
            "cudnn_workspaces",
            [
                sys.executable,
                str(HERE / "cudnn_workspaces.py"),
                *dry,
                "--out",
                str(out / "cudnn-profile.json"),
                "--seconds",  # from its process's start: it ends itself inside its box
                str(50 * scale),
            ],
            55,
        ),
        ("decode", [*me, "--part", "decode"], 30),
        (
            "memory_matrix",
            [*me, "--part", "memory_matrix", "--part-seconds", str(92 * scale), "--card", card],
            100,
        ),
        ("speed", [*me, "--part", "speed", "--part-seconds", str(165 * scale)], 175),
    ]
    wanted = [p for p in plan if not args.only or p[0] in args.only.split(",")]
    planner = None
    for name, cmd, box in wanted:
        if planner is None and name != "imports" and "speed" in {p[0] for p in wanted}:
            planner, plan_file = start_planner(out, args.dry_run)  # after the cold imports
        if name == "speed" and planner is not None:
            cmd = [*cmd, "--trainer-plan", str(plan_file)]
        parts.run(name, cmd, box * scale)
    if planner is not None and planner.poll() is None:  # not waited for: the part planned
        planner.kill()
    write_summary(out, info, parts.status, args.dry_run)
    return 0 if all(s["state"] == "passed" for s in parts.status.values()) else 1


def write_summary(out: Path, info: dict[str, Any], status: dict[str, Any], dry_run: bool) -> None:
    """``summary.json`` and ``summary.md`` from the part files in ``out``, as they are now."""
    files = {"memory_matrix": "memory_matrix.json", "speed": "speed.json",
             "decode": "decode.json", "cudnn_workspaces": "cudnn-profile.json",
             "checkpoint_stall": "checkpoint_stall.json"}  # fmt: skip
    results = {
        name: json.loads((out / file).read_text())
        for name, file in files.items()
        if (out / file).exists()
    }
    summary = {
        "machine": info,
        "parts": status,
        "dry_run": dry_run,
        # Without the per-row and per-signature lists: those are in the parts' own files.
        "results": {
            name: {k: v for k, v in r.items() if k != "rows"} if isinstance(r, dict) else r
            for name, r in results.items()
        },
    }
    write_json(out / "summary.json", summary)
    atomic_write_text(out / "summary.md", summary_md(info, status, results))
    print((out / "summary.md").read_text())
    print(f"[gpu-evidence] results in {out}")


def summarize(out: Path) -> int:
    """The summary again after a part was run once more on its own (``--part NAME --out``,
    a follow-up call on the same machine): the machine and the parts' states are the
    first run's, the figures the part files' now."""
    summary_json = out / "summary.json"
    if not summary_json.exists():
        print(f"{summary_json} not found: --summarize takes a finished run's folder "
              "(one `make gpu-evidence` wrote)", file=sys.stderr)  # fmt: skip
        return 2
    first = json.loads(summary_json.read_text())
    write_summary(out, first["machine"], first["parts"], bool(first.get("dry_run")))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dry-run", action="store_true", help="no GPU: tiny workloads on the CPU")
    p.add_argument("--out", type=Path, help="the results folder (default: see above)")
    p.add_argument(
        "--seconds", type=float, help="all parts' time boxes together (535; a dry run's 2140)"
    )
    p.add_argument("--only", default="", help="parts to run, comma-separated")
    p.add_argument("--part", help=argparse.SUPPRESS)  # one part, in the process the box runs
    p.add_argument("--part-seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--card", default="", help=argparse.SUPPRESS)  # the traces' folder prefix
    p.add_argument("--trainer-plan", type=Path, help=argparse.SUPPRESS)  # start_planner's file
    p.add_argument(
        "--summarize",
        type=Path,
        metavar="DIR",
        help="rebuild DIR's summary.json and summary.md from its part files (after a part "
        "was run again into it), running nothing",
    )
    args = p.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if args.part == "predict":
        print(json.dumps(predict_row(json.loads(args.row))))
        return 0
    if args.part == "memory_matrix":
        write_json(args.out / "memory_matrix.json",
                   memory_matrix(args.out, args.dry_run, args.part_seconds, args.card))  # fmt: skip
        return 0
    if args.part == "speed":
        result = speed(args.dry_run, args.part_seconds, args.trainer_plan)
        write_json(args.out / "speed.json", result)
        return 1 if any("error" in v for v in result.values()) else 0
    if args.part == "decode":
        done = subprocess.run(
            [sys.executable, str(HERE / "gpu_decode.py"), "--json",
             *(["--dry-run"] if args.dry_run else [])],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        write_json(args.out / "decode.json", json.loads(done.stdout))
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
