"""A LoRA fine-tune with Hugging Face's Trainer, its micro-batch and accumulation from a plan.

`bigbatch plan --hf CONFIG` does the planning from the command line; here the same from Python,
for a small Llama-shaped config (random weights: no download) and a CPU budget. The plan keeps
the global batch of 32 sequences and travels as a file (`plan.save`, `bigbatch plan --hf ...
--save`; `LMPlan.load` in the training job); `with_plan` sets Trainer to it;
`train_with_backoff` would retry an out-of-memory run at half the micro-batch, the same update.
"""

import tempfile
import warnings

import torch
import transformers

from bigbatch.integrations.hf import train_with_backoff, with_plan
from bigbatch.memory.lm import LMPlan, LMSetup, lm_factory, plan_lm

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=FutureWarning)
config = transformers.LlamaConfig(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
setup = LMSetup(seq_len=128, lora_r=8, gradient_checkpointing=True)

# 1. Plan: the largest micro-batch under the budget, and the accumulation for 32 sequences.
plan = plan_lm(config, setup, global_batch=32, budget="60MB", device="cpu", precision="fp32",
               overhead=0)  # fmt: skip
print(plan.summary())

# 2. The model as planned (peft's LoRA on transformers' model), and some uneven sequences.
torch.manual_seed(0)
model = lm_factory(config, setup)()
texts = [torch.randint(1, 1000, (int(torch.randint(32, 129, ())),)) for _ in range(64)]
data = [{"input_ids": t, "labels": t.clone()} for t in texts]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence([i["input_ids"] for i in items], batch_first=True)
    labels = torch.nn.utils.rnn.pad_sequence(
        [i["labels"] for i in items], batch_first=True, padding_value=-100
    )
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long()}


# 3. Trainer, set from the plan: micro-batch x accumulation = 32 sequences a step.
with tempfile.TemporaryDirectory() as out:
    args = transformers.TrainingArguments(
        output_dir=out, num_train_epochs=1, learning_rate=1e-3, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    plan = LMPlan.load(plan.save(f"{out}/plan.json"))  # as a training job elsewhere reads it
    args = with_plan(args, plan)
    print(
        f"Trainer: per_device_train_batch_size={args.per_device_train_batch_size}, "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps}"
    )

    def make_trainer(a: transformers.TrainingArguments) -> transformers.Trainer:
        return transformers.Trainer(model=model, args=a, train_dataset=data, data_collator=collate)

    result = train_with_backoff(make_trainer, args)
print(
    f"trained {result.global_step} optimizer steps of 32 sequences, loss {result.training_loss:.3f}"
)
