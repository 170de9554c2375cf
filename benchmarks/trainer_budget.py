"""A Hugging Face Trainer run set from a plan, under a budget: a language model from its config
(random weights), LoRA r=16 with checkpointing, planned by `bigbatch plan --hf`'s planner, its
micro-batch and accumulation set by `with_plan`, the allocator capped by `MemoryBudget` (which
measures the first steps and refits the micro-batch from them), OOM retried by
`train_with_backoff`. Reports the plan, the measured peak against the prediction and the cap,
and the refits and back-offs (`backoffs`: their lines). `make gpu-evidence` runs it, its plan
made beforehand on the CPU while other parts use the GPU (a minute or more of tracing:
`--plan-out`, then `--plan-in`); --dry-run: a tiny one on the CPU.

    python benchmarks/trainer_budget.py [--dry-run] [--json]
    python benchmarks/trainer_budget.py --plan-out plan.json   # no GPU needed
    python benchmarks/trainer_budget.py --plan-in plan.json --wait 120 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_matrix import HF_CONFIGS

from bigbatch.io import atomic_write_text

MiB = 2**20


def workload(dry_run: bool) -> tuple[str, int, int, str]:
    """(the model's HF_CONFIGS name, sequence length, sequences a step, budget)."""
    return ("tiny", 64, 8, "256MiB") if dry_run else ("qwen2.5-0.5b", 2048, 32, "12GiB")


def make_plan(dry_run: bool) -> Any:
    """The run's plan (bigbatch plan --hf's planner, for CUDA or a dry run's CPU)."""
    from bigbatch.memory.lm import LMSetup, plan_lm

    name, seq_len, batch, budget = workload(dry_run)
    config = plan_config(name)
    setup = LMSetup(seq_len=seq_len, lora_r=16, gradient_checkpointing=True)
    device, precision = ("cpu", "fp32") if dry_run else ("cuda", "bf16")
    return plan_lm(config, setup, batch, budget, device=device, precision=precision, overhead=0)


def read_plan(path: Path) -> Any:
    """The plan ``--plan-out`` saved (LMPlan.save) in ``path``; its planner's error raised."""
    from bigbatch.memory.lm import LMPlan

    said = json.loads(path.read_text())
    if "error" in said:
        raise ValueError(said["error"])
    return LMPlan.load(path)


def planned(dry_run: bool, plan_file: Path | None, wait_seconds: float) -> tuple[Any, str]:
    """The plan, and where it came from: ``plan_file`` (written by ``--plan-out`` in a
    process of its own, on the CPU while other parts used the GPU) once it is there, waiting
    up to ``wait_seconds``; else made here."""
    deadline = time.monotonic() + wait_seconds
    while plan_file is not None and time.monotonic() < deadline and not plan_file.exists():
        time.sleep(0.5)
    if plan_file is not None and plan_file.exists():
        try:
            return read_plan(plan_file), f"planned beforehand ({plan_file.name})"
        except ValueError as e:  # its planner failed: say so, plan here
            return make_plan(dry_run), f"planned here ({plan_file.name}: {str(e)[-300:]})"
    return make_plan(dry_run), "planned here"


def run(dry_run: bool, plan_file: Path | None = None, wait_seconds: float = 0.0) -> dict[str, Any]:
    import transformers

    from bigbatch.integrations.hf import MemoryBudget, train_with_backoff, with_plan
    from bigbatch.memory.lm import lm_factory

    name, seq_len, batch, budget = workload(dry_run)
    device = "cpu" if dry_run else "cuda"
    t0 = time.perf_counter()
    plan, source = planned(dry_run, plan_file, wait_seconds)
    plan_seconds = time.perf_counter() - t0
    config, setup = plan_config(name), plan.setup
    torch.manual_seed(0)
    with torch.device(device):  # its random fills on the GPU: 10-20 s on a CPU core
        model = lm_factory(config, setup)()
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(batch * 3):  # three optimizer steps of uneven sequences
        n = int(torch.randint(seq_len // 2, seq_len + 1, (), generator=g))
        ids = torch.randint(1, config.vocab_size, (n,), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(i["input_ids"]) for i in items)
        ids = torch.zeros(len(items), longest, dtype=torch.long)
        labels = torch.full((len(items), longest), -100)
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = item["input_ids"], item["labels"], 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    cap = plan.plan.budget_bytes  # the budget is the allocator's (overhead 0: no context in it)
    budget_cb = MemoryBudget(cap, plan=plan)  # measures the first steps, refits from them
    said: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, num_train_epochs=1, learning_rate=1e-4, report_to=[],
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
            use_cpu=dry_run, bf16=not dry_run, dataloader_num_workers=0,
        )  # fmt: skip
        args = with_plan(args, plan)  # and checkpointing on: the plan counts on it

        made: list[Any] = []

        def make(a: Any) -> Any:
            made.append(transformers.Trainer(
                model=model, args=a, train_dataset=data, data_collator=collate,
                callbacks=[budget_cb],
            ))  # fmt: skip
            return made[-1]

        if device == "cuda":  # what the fills left cached is not the run's
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        train_with_backoff(make, args, log=said.append)
        trained = _training_peaks(device)  # before evaluation resets them
        evaluated = evaluate(made[-1], plan, config.vocab_size, seq_len, device)
    out: dict[str, Any] = {
        "workload": f"{name}, LoRA r=16, checkpointing, {seq_len} tokens, batch {batch}, "
        f"budget {budget}",
        "plan": source,  # beforehand: on the CPU without the card (sm90's profile, 132 SMs)
        "plan_seconds": round(plan_seconds, 1),  # made here, or waited for
        "micro_batch": plan.micro_batch,
        "accumulation": plan.accumulation,
        "trainer_micro_batch": args.per_device_train_batch_size,  # the first; backoffs: changes
        "predicted_peak_mib": round(plan.peak_bytes / MiB, 1),
        "cap_mib": round(cap / MiB, 1),
        "logged": [  # MemoryBudget's lines: reserved, allocated, the need it refitted from
            {k.removeprefix("bigbatch/"): v for k, v in line.items() if k.startswith("bigbatch/")}
            for line in budget_cb.logged
        ],
        "measured_peak_mib": None
        if budget_cb.measured_bytes is None
        else round(budget_cb.measured_bytes / MiB, 1),
        "backoffs": said,
        **evaluated,
    }
    if trained:
        reserved = trained["max_reserved"]
        out["max_reserved_mib"] = round(reserved / MiB, 1)
        out["max_allocated_mib"] = round(trained["max_allocated"] / MiB, 1)
        # The allocator's cache given back at the cap before a request would have failed: the
        # reserved peak then says where the cap is, not what the steps needed.
        out["alloc_retries"] = trained["alloc_retries"]
        out["stayed_under_cap"] = reserved <= cap
        out["prediction_error"] = round((plan.peak_bytes - reserved) / reserved, 4)
    return out


def _training_peaks(device: str) -> dict[str, int]:
    """The allocator's peaks over the training run (CUDA; empty elsewhere)."""
    if device != "cuda":
        return {}
    return {
        "max_reserved": torch.cuda.max_memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "alloc_retries": int(torch.cuda.memory_stats().get("num_alloc_retries", 0)),
    }


def evaluate(trainer: Any, plan: Any, vocab: int, seq_len: int, device: str) -> dict[str, Any]:
    """Trainer's evaluation after the run, at the planned evaluation batch (with_plan's) and
    the planned length (the shape planned), the optimizer state still alive; on CUDA its
    reserved peak from an emptied cache (the evaluation alone) against the plan's."""
    g = torch.Generator().manual_seed(1)
    batch = trainer.args.per_device_eval_batch_size
    ids = [torch.randint(1, vocab, (seq_len,), generator=g) for _ in range(2 * batch)]
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    metrics = trainer.evaluate(eval_dataset=[{"input_ids": i, "labels": i.clone()} for i in ids])
    predicted = plan.eval_peak_bytes
    out: dict[str, Any] = {
        "eval_batch": batch,
        "eval_loss": round(float(metrics["eval_loss"]), 4),
        "eval_predicted_peak_mib": None if predicted is None else round(predicted / MiB, 1),
    }
    if device == "cuda" and predicted:
        reserved = torch.cuda.max_memory_reserved()
        out["eval_max_reserved_mib"] = round(reserved / MiB, 1)
        out["eval_prediction_error"] = round((predicted - reserved) / reserved, 4)
    return out


def plan_config(name: str) -> Any:
    """The transformers config of an HF_CONFIGS model."""
    import transformers

    values = dict(HF_CONFIGS[name])
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plan-out", type=Path, help="only plan, into this JSON file (no GPU needed)")
    p.add_argument("--plan-in", type=Path, help="the plan --plan-out wrote, waited for")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for --plan-in")
    args = p.parse_args()
    if args.plan_out:
        try:
            make_plan(args.dry_run).save(args.plan_out)
        except Exception as e:  # the run that waits for it plans itself, and says why
            said = {"error": f"{type(e).__name__}: {e}"[-1500:]}
            atomic_write_text(args.plan_out, json.dumps(said))  # whole: it is polled for
            raise
        return 0
    result = run(args.dry_run, args.plan_in, args.wait)
    print(json.dumps(result, indent=1) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
