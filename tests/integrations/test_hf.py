"""Hugging Face Trainer: exact for its own causal LMs (measured against the big batch); a model of
your own is not, and bigbatch's token_loss() makes it exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from reference import rel_err
from torch import nn

from helpers import right_padded as collate

transformers = pytest.importorskip("transformers")
from bigbatch.integrations.hf import (  # noqa: E402
    shift_labels_collator,
    token_loss,
    verify_trainer,
)

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


def trainer_of(model: nn.Module, data: list, tmp_path, cls=None, **kwargs):  # type: ignore[no-untyped-def]
    """A Trainer taking the rows in order (the epoch is one window of 4 + 4 + 4 + 2), SGD."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=4, num_train_epochs=1, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, train_sampling_strategy="sequential",
    )  # fmt: skip
    kwargs.setdefault("data_collator", collate)
    return (cls or transformers.Trainer)(model=model, args=args, train_dataset=data, **kwargs)


def tiny_gpt2(dropout: float = 0.0, dtype: torch.dtype = torch.float64) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=dropout, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def test_verify_trainer_measures_the_update_trainer_makes_and_keeps_the_trainer_as_it_was(  # type: ignore[no-untyped-def]
    tmp_path,
) -> None:
    """A model of one's own with a mean loss: verify_trainer's difference is the one the
    trained update shows against the big batch's (SGD: the update is -lr x the gradient), it
    names loss / N and token_loss, and the trainer's gradients, modes and RNG are untouched;
    with token_loss() it passes at 1e-12."""
    from bigbatch.verify import compare_gradients

    init, data = TinyLM().double(), shifted(sequences())
    trainer = trainer_of(copy.deepcopy(init), data, tmp_path)
    trainer.model.eval()
    rng = torch.get_rng_state()
    result = verify_trainer(trainer, micro_batches=[4, 4, 4, 2])  # the epoch train() runs
    assert not result.passed and result.micro_batch_counts == [4, 4, 4, 2]
    assert result.method == "trainer" and result.dtype == "float64" and result.roundoff < 1e-15
    assert "loss / N" in result.explanation and "token_loss()" in result.explanation
    assert torch.equal(torch.get_rng_state(), rng) and not trainer.model.training
    assert all(p.grad is None for p in trainer.model.parameters())

    def grads(model: nn.Module) -> dict[str, torch.Tensor]:
        params = dict(init.named_parameters())
        return {n: (params[n] - p).detach() / LR for n, p in model.named_parameters()}

    trainer.train()
    want = big_batch(copy.deepcopy(init), data, lambda m, b: m(**b)["loss"])
    _, trained_rel, _ = compare_gradients(grads(trainer.model), grads(want))
    assert result.max_rel == pytest.approx(trained_rel, rel=1e-9) and trained_rel > 0.05
    exact = trainer_of(copy.deepcopy(init), data, tmp_path, compute_loss_func=token_loss())
    fixed = verify_trainer(exact, micro_batches=[4, 4, 4, 2])
    assert fixed.passed and fixed.max_rel < 1e-12 and fixed.explanation == ""
    assert fixed.micro_batch_counts == [sum(int(i["labels"].ne(-100).sum()) for i in data[a:a + n])
                                        for a, n in ((0, 4), (4, 4), (8, 4), (12, 2))]  # fmt: skip


class MeanLossTrainer(transformers.Trainer):  # type: ignore[misc]
    """A compute_loss of one's own that returns each micro-batch's mean."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        return model(**inputs).loss


def test_verify_trainer_explains_gpt2s_count_a_compute_loss_of_ones_own_and_dropout(  # type: ignore[no-untyped-def]
    tmp_path,
) -> None:
    """GPT-2 in float64: counted one token per sequence too many (shift_labels_collator named),
    exact with the collator; a compute_loss returning the micro-batch's mean is named; dropout
    is named, and measured to be the whole difference with it in eval mode."""
    data, shifting = sequences(), shift_labels_collator(collate)
    plain = verify_trainer(trainer_of(tiny_gpt2(), data, tmp_path))
    assert not plain.passed and "shift_labels_collator" in plain.explanation
    fixed = verify_trainer(trainer_of(tiny_gpt2(), data, tmp_path, data_collator=shifting))
    assert fixed.passed and fixed.max_rel < 1e-12
    own = trainer_of(tiny_gpt2(), data, tmp_path, MeanLossTrainer, data_collator=shifting)
    mean = verify_trainer(own, micro_batches=[5, 3])
    assert not mean.passed and mean.micro_batch_counts[1] < mean.micro_batch_counts[0]
    assert mean.explanation.startswith("MeanLossTrainer.compute_loss is your own")
    noisy = trainer_of(tiny_gpt2(dropout=0.1), data, tmp_path, data_collator=shifting)
    dropped = verify_trainer(noisy)
    assert not dropped.passed and "2 dropout layer(s)" in dropped.explanation
    assert "so they explain the difference" in dropped.explanation


def test_verify_trainer_in_float32_judges_by_the_big_batchs_own_round_off(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """float32: the exact run passes within the big batch's round-off (measured in reverse
    order), and the miscount fails the same check."""
    data, shifting = sequences(), shift_labels_collator(collate)
    fixed = verify_trainer(
        trainer_of(tiny_gpt2(dtype=torch.float32), data, tmp_path, data_collator=shifting)
    )
    assert fixed.dtype == "float32" and fixed.passed and fixed.tolerance < 1e-4
    plain = verify_trainer(trainer_of(tiny_gpt2(dtype=torch.float32), data, tmp_path))
    assert not plain.passed and plain.max_rel > 100 * plain.tolerance


def test_verify_trainer_refuses_a_window_it_cannot_run() -> None:
    from types import SimpleNamespace

    from bigbatch.integrations.hf_verify import _first_rows, _window_sizes

    args = SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=1,
                           world_size=1)  # fmt: skip
    assert _window_sizes(args, None) == [1, 1]
    with pytest.raises(ValueError, match=r"^verify_trainer runs in one process, .* torchrun"):
        _window_sizes(SimpleNamespace(**{**vars(args), "world_size": 2}), None)
    for sizes in ([4], [3, 0]):
        with pytest.raises(ValueError, match=r"is no window to accumulate: .*=\[4, 4, 2\]$"):
            _window_sizes(args, sizes)
    with pytest.raises(ValueError, match=r"holds 3 rows .* takes 5: .*micro_batches=\[1, 2\]$"):
        _first_rows([1, 2, 3], 5)
    assert _first_rows(iter(range(9)), 2) == [0, 1]
