"""Hugging Face Transformers: the right count for token losses in ``Trainer`` and your own loop.

- **Your own loop**: a causal LM called with ``labels=`` shifts them inside and predicts
  ``labels[..., 1:]``: ``acc.backward(out.loss, labels=labels, shift=True)``.
- **``Trainer`` with a Transformers causal LM**: transformers >= 4.46 passes the window's token
  count (``num_items_in_batch``) to the model's loss, but counts ``labels[..., 1:]`` only when
  the model declares a causal-LM ``loss_type``. GPT-2 (``GPT2LMHeadModel``) and other models
  whose class name does not end in ``ForCausalLM`` leave it unset (transformers warns
  "loss_type=None ... unrecognized"): Trainer then counts one label per sequence too many and
  every update is scaled down (by 12.8 % in ``tests/integrations/test_hf.py``). Wrap the
  collator: ``Trainer(..., data_collator=shift_labels_collator(collator))`` adds the shifted
  labels as ``shift_labels``, which Trainer counts and the model's loss uses as they are.
- **``Trainer`` with a model of your own** whose forward returns a mean loss: ``Trainer`` cannot
  pass it the window's count, so it divides each micro-batch's mean by
  ``gradient_accumulation_steps``, which is wrong as soon as micro-batches hold different numbers
  of tokens. Give ``Trainer`` the loss instead: ``Trainer(..., compute_loss_func=token_loss())``
  sums the token losses and divides by the window's count.
- **A plan for Trainer and TRL**: :func:`with_plan` sets ``per_device_train_batch_size`` and
  ``gradient_accumulation_steps`` of ``TrainingArguments`` (or TRL's ``SFTConfig``) from
  ``bigbatch plan --hf``'s plan (:func:`bigbatch.memory.lm.plan_lm`) for the global batch
  asked, which they never change; :class:`MemoryBudget` caps CUDA's allocator at the budget,
  measures the first steps and refits the micro-batch from them (Trainer's is fixed for a run:
  it stops at a checkpoint); :func:`train_with_backoff` goes on from there at the new sizes, and
  retries an out-of-memory run at half the micro-batch and twice the accumulation from
  Trainer's last checkpoint, the same update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bigbatch.integrations import require
from bigbatch.integrations.hf_budget import (
    MemoryBudget,
    check_evaluation_held,
    check_trainer,
    refit_sizes,
    step_need_bytes,
    train_with_backoff,
)
from bigbatch.integrations.hf_model_check import check_plan_matches
from bigbatch.integrations.hf_plan import (
    model_arguments,
    quantization_arguments,
    trainer_arguments,
    trainer_batch_sizes,
    with_plan,
)
from bigbatch.integrations.hf_verify import verify_trainer

require("transformers", "hf")

__all__ = [
    "MemoryBudget",
    "check_evaluation_held",
    "check_plan_matches",
    "check_trainer",
    "model_arguments",
    "quantization_arguments",
    "refit_sizes",
    "shift_labels_collator",
    "step_need_bytes",
    "token_loss",
    "train_with_backoff",
    "trainer_arguments",
    "trainer_batch_sizes",
    "verify_trainer",
    "with_plan",
]


def token_loss(
    *, ignore_index: int = -100, logits_key: str = "logits", labels_shifted: bool = False
) -> Callable[[Any, torch.Tensor, Any], torch.Tensor]:
    """A ``compute_loss_func`` for ``Trainer``: token cross-entropy summed over the micro-batch
    and divided by the window's label count (``num_items_in_batch``), so the accumulated gradient
    equals the big batch's whatever the padding.

    Labels are used as they come (no shift): a model of your own that predicts the next token
    should get labels already shifted by its collator, because ``Trainer`` counts shifted labels
    only for Transformers' own causal-LM losses. On a Transformers causal LM's output (a
    ``...CausalLM...`` output class), whose usual labels are the input ids, unshifted labels
    would train it to predict the current token: that is refused unless you say the collator
    shifted them (``labels_shifted=True``). Such a model computes the right loss itself: drop
    ``compute_loss_func`` and see ``shift_labels_collator``.

    >>> loss = token_loss()
    >>> logits = torch.zeros(1, 3, 5); labels = torch.tensor([[1, 2, -100]])
    >>> round(float(loss({"logits": logits}, labels, num_items_in_batch=4)), 4)  # 2 of 4 tokens
    0.8047
    """

    def compute_loss(
        outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        if labels is None:
            raise ValueError(
                "token_loss got no labels: the batches need a 'labels' entry (ignore_index for "
                "padding)"
            )
        if num_items_in_batch is None:
            raise ValueError(
                "Trainer passed no num_items_in_batch, so the window's token count is unknown: "
                "use transformers >= 4.46 and give the batches a 'labels' entry"
            )
        if not labels_shifted and "CausalLM" in type(outputs).__name__:
            raise ValueError(
                f"token_loss got a causal LM's output ({type(outputs).__name__}) and uses labels "
                "as they are, so input-id labels would train it to predict the current token. "
                "Drop compute_loss_func (the model's own loss shifts and counts right; wrap the "
                "collator with shift_labels_collator for models without a loss_type), or shift "
                "the labels in your collator and pass token_loss(labels_shifted=True)"
            )
        logits = outputs[logits_key] if isinstance(outputs, dict) else outputs[0]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # a sum over many tokens: not in half precision
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1).to(logits.device),
            ignore_index=ignore_index,
            reduction="sum",
        )
        return total / num_items_in_batch

    return compute_loss


def shift_labels_collator(
    collator: Callable[[list[Any]], dict[str, Any]], *, ignore_index: int = -100
) -> Callable[[list[Any]], dict[str, Any]]:
    """Wrap a ``Trainer`` collator so each batch also carries ``shift_labels``: the labels a
    causal LM predicts (``labels[..., 1:]``, padded with ``ignore_index``). Trainer counts them
    for ``num_items_in_batch`` and Transformers' causal-LM loss uses them instead of shifting.

    >>> collate = shift_labels_collator(lambda items: {"labels": torch.tensor(items)})
    >>> collate([[5, 6, 7]])["shift_labels"].tolist()
    [[6, 7, -100]]
    """

    def collate(items: list[Any]) -> dict[str, Any]:
        batch = collator(items)
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor):
            raise ValueError(
                "shift_labels_collator needs batches with a 'labels' tensor (the collator "
                f"returned {sorted(batch)})"
            )
        pad = torch.full_like(labels[..., :1], ignore_index)
        batch["shift_labels"] = torch.cat([labels[..., 1:], pad], dim=-1)
        return batch

    # What it wraps stays visible (inspect.unwrap's convention): check_trainer judges the
    # collator underneath, whose rows (padded or one per micro-batch) are the step's shape.
    collate.__wrapped__ = collator  # type: ignore[attr-defined]
    return collate
