"""Run by test_hf_llm.py under ``torchrun --nproc-per-node 2 --max-restarts 1`` (gloo, CPU): Trainer
(DDP across the ranks: accelerate applies FSDP on accelerators only) trains the peft LoRA model of
test_hf_llm.py set from a plan for 2 ranks (micro-batch 2, accumulation 3 a rank: the 12 sequences
are one step), then again with a mean per micro-batch and with each rank's own token count
(``average_tokens_across_devices=False``: the negative controls), then three AdamW steps (weight
decay 0.1) through ``train_with_backoff`` with rank 1 out of memory at micro-batch 2: it leaves the
sizes and raises, torchrun restarts both ranks, and they train at 1 x 6. Rank 0 saves each run's
trained adapters to ``argv[1]`` as it ends (a restarted script skips the runs saved)."""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_llm import LR, N, collate, plan_of, sequences, tiny_lora

from bigbatch.integrations.hf import train_with_backoff, with_plan

warnings.filterwarnings("ignore")


def train(
    out: Path, per_micro_batch_mean: bool, oom_rank: int | None = None, local_tokens: bool = False
) -> dict[str, object]:
    # The OOM run: three AdamW steps with weight decay (test_hf_llm.big_batch_adamw's).
    optim = {"optim": "adamw_torch", "weight_decay": 0.1, "learning_rate": LR / 50,
             "num_train_epochs": 3} if oom_rank is not None else {}  # fmt: skip
    args = transformers.TrainingArguments(
        **{"output_dir": str(out), "num_train_epochs": 1, "learning_rate": LR, "optim": "sgd",
           "lr_scheduler_type": "constant", "weight_decay": 0.0, "max_grad_norm": 0.0,
           "report_to": [], "save_strategy": "no", "logging_strategy": "no", "use_cpu": True,
           "disable_tqdm": True, "dataloader_num_workers": 0, **optim},
    )  # fmt: skip
    plan = plan_of(N, 2)
    plan.setup = type(plan.setup)(seq_len=plan.setup.seq_len, world_size=2)
    args = with_plan(args, plan)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 3)
    # Each rank's own token count (which with_plan refuses): the negative control's second.
    args.average_tokens_across_devices = not local_tokens
    made = []

    def make(a: transformers.TrainingArguments) -> transformers.Trainer:
        model = copy.deepcopy(tiny_lora())
        if oom_rank == int(os.environ["RANK"]):
            model.register_forward_pre_hook(out_of_memory_above_one, with_kwargs=True)
        trainer = transformers.Trainer(
            model=model, args=a, train_dataset=sequences(), data_collator=collate,
        )  # fmt: skip
        trainer.model_accepts_loss_kwargs = not per_micro_batch_mean
        made.append(trainer)
        return trainer

    train_with_backoff(make, args)
    trainer = made[-1]
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    # The frozen base: no gradient made, every weight as it was.
    start = dict(tiny_lora().named_parameters())
    frozen_kept = all(
        p.grad is None and torch.equal(p, start[n])
        for n, p in trainer.model.named_parameters()
        if not p.requires_grad
    )
    adapters = {n.split("base_model.", 1)[-1]: p.detach().clone() for n, p in trained.items()}
    return {"adapters": adapters, "frozen_kept": frozen_kept}


def out_of_memory_above_one(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:  # type: ignore[type-arg]
    if kwargs["input_ids"].shape[0] > 1:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated on one rank)")


if __name__ == "__main__":
    out = Path(sys.argv[1])
    runs = {
        "planned": (False, None, False),
        "mean": (True, None, False),
        "local_tokens": (False, None, True),
        "oom": (False, 1, False),
    }
    for name, (mean, oom_rank, local_tokens) in runs.items():
        if (out / f"{name}.pt").exists():  # saved before torchrun restarted this script
            continue
        trained = train(out / name, mean, oom_rank, local_tokens)
        if int(os.environ["RANK"]) == 0:
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            torch.save({**trained, "restarts": restarts}, out / f"{name}.pt")
