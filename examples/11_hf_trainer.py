"""A standard Hugging Face Trainer script for a GPT-2 with exact accumulation: one line changes.

transformers' Trainer counts `labels[..., 1:]` for `num_items_in_batch` only for models that
declare a causal-LM loss_type; GPT-2 does not, so every update is scaled down by the one label
per sequence it over-counts. `shift_labels_collator` hands Trainer the shifted labels to count.
"""

import tempfile

import torch
import transformers

from bigbatch.integrations.hf import shift_labels_collator

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
model = transformers.GPT2LMHeadModel(config)
texts = [torch.randint(1, 100, (int(torch.randint(4, 32, ())),)) for _ in range(40)]
data = [{"input_ids": t, "labels": t.clone()} for t in texts]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence([i["input_ids"] for i in items], batch_first=True)
    labels = torch.nn.utils.rnn.pad_sequence(
        [i["labels"] for i in items], batch_first=True, padding_value=-100
    )
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long()}


with tempfile.TemporaryDirectory() as out:
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_train_epochs=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=shift_labels_collator(collate),  # bigbatch: instead of data_collator=collate
    )
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
print(f"optimizer steps: {trainer.state.global_step} (40 sequences = 10 micro-batches of 4)")
