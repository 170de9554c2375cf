"""Hugging Face Trainer: exact for its own causal LMs (measured against the big batch); a model of
your own is not, and bigbatch's token_loss() makes it exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from reference import rel_err
from torch import nn

transformers = pytest.importorskip("transformers")
from bigbatch.integrations.hf import shift_labels_collator, token_loss  # noqa: E402

VOCAB, SEQ, N, BATCH, LR = 40, 12, 14, 4, 0.5


def sequences() -> list[dict[str, torch.Tensor]]:
    """14 sequences of 2..12 tokens: micro-batches of 4, 4, 4, 2 hold very different token counts."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(N):
        n = int(torch.randint(2, SEQ + 1, (), generator=g))
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest sequence: pad id 0, label -100, attention mask 0."""
    longest = max(len(i["input_ids"]) for i in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = item["input_ids"], item["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class TinyLM(nn.Module):
    """A model of one's own: next-token logits per position and, given labels, a mean token loss
    (labels arrive shifted by the caller, see shifted())."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return out


def shifted(items: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Next-token labels for TinyLM: label i is token i + 1, the last position is padding."""
    return [
        {"input_ids": i["input_ids"], "labels": torch.cat([i["labels"][1:], torch.tensor([-100])])}
        for i in items
    ]


def train(model: nn.Module, data: list, tmp_path, **trainer_kwargs) -> nn.Module:  # type: ignore[no-untyped-def]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=4,  # the whole epoch is one window: 4 + 4 + 4 + 2 sequences
        num_train_epochs=1,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer_kwargs.setdefault("data_collator", collate)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, **trainer_kwargs)
    trainer.train()
    return model


def big_batch(model: nn.Module, data: list, loss_of) -> nn.Module:  # type: ignore[no-untyped-def]
    """One SGD step on all 14 sequences at once, the mean over every real token."""
    batch = collate(data)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_of(model, batch).backward()
    opt.step()
    return model


def update_err(got: nn.Module, want: nn.Module, init: nn.Module) -> float:
    return rel_err(*(tuple(m.parameters()) for m in (got, want, init)))


@pytest.mark.slow
def test_gpt2_under_trainer_overcounts_and_shift_labels_collator_makes_it_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: deterministic
    )  # fmt: skip
    torch.manual_seed(0)
    init = transformers.GPT2LMHeadModel(config).double()
    data = sequences()

    def lm_loss(model, batch):  # type: ignore[no-untyped-def]
        return model(**batch).loss  # a mean over labels[..., 1:] != -100: the whole batch's

    want = big_batch(copy.deepcopy(init), data, lm_loss)
    # GPT-2 declares no causal-LM loss_type, so Trainer counts labels, not labels[..., 1:]: one
    # token per sequence too many, every update scaled down.
    plain = train(copy.deepcopy(init), data, tmp_path)
    assert update_err(plain, want, init) > 0.05
    fixed = train(copy.deepcopy(init), data, tmp_path, data_collator=shift_labels_collator(collate))
    assert update_err(fixed, want, init) < 1e-12


@pytest.mark.slow
def test_own_model_is_off_under_trainer_and_token_loss_makes_it_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    init = TinyLM().double()
    data = shifted(sequences())

    def mean_loss(model, batch):  # type: ignore[no-untyped-def]
        return model(batch["input_ids"], labels=batch["labels"])["loss"]

    want = big_batch(copy.deepcopy(init), data, mean_loss)
    # Trainer divides each micro-batch's mean by gradient_accumulation_steps: wrong here.
    plain = train(copy.deepcopy(init), data, tmp_path)
    assert update_err(plain, want, init) > 0.05
    fixed = train(copy.deepcopy(init), data, tmp_path, compute_loss_func=token_loss())
    assert update_err(fixed, want, init) < 1e-12


def test_token_loss_without_a_count_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="num_items_in_batch"):
        token_loss()({"logits": torch.zeros(1, 2, 3)}, torch.zeros(1, 2, dtype=torch.long), None)


def test_token_loss_on_a_causal_lms_output_with_unshifted_labels_is_refused() -> None:
    """Input-id labels used as they are would train the model to predict the current token."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=8, n_layer=1, n_head=2, use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config)
    batch = collate(sequences()[:2])
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with pytest.raises(ValueError, match=r"causal LM.s output .*labels_shifted=True"):
        token_loss()(out, batch["labels"], num_items_in_batch=10)
    # Labels the collator shifted already are accepted when said so.
    assert torch.isfinite(token_loss(labels_shifted=True)(out, batch["labels"], 10))
