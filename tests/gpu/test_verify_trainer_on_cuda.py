"""On a real NVIDIA GPU (`pytest -m cuda tests/gpu`): verify_trainer on a Trainer that trains a
LoRA model on the card, in float32 and under bf16 autocast: exact within the big batch's own
round-off at that precision, the trainer's gradients and random state as they were, and each
micro-batch's mean (the model given no count) fails the float32 check. Skipped where there is
no GPU (CI, where tests/integrations/test_hf*.py run the same on a CPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from bigbatch.integrations.hf import verify_trainer  # noqa: E402
from helpers import right_padded  # noqa: E402


def _rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        ids = torch.randint(1, 64, (int(torch.randint(4, 33, (), generator=g)),), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _trainer(tmp_path, bf16: bool):  # type: ignore[no-untyped-def]
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        bf16=bf16, report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    return transformers.Trainer(
        model=model, args=args, train_dataset=_rows(), data_collator=right_padded
    )


def test_verify_trainer_on_the_card_in_float32_and_bf16(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(tmp_path, bf16=False)
    assert next(trainer.model.parameters()).is_cuda
    rng = torch.cuda.get_rng_state()
    result = verify_trainer(trainer, micro_batches=[5, 3])
    assert result.passed and result.dtype == "float32", result
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.model_accepts_loss_kwargs = False
    mean = verify_trainer(trainer, micro_batches=[5, 3])
    assert not mean.passed and "loss / N" in mean.explanation
    autocast = verify_trainer(_trainer(tmp_path, bf16=True), micro_batches=[5, 3])
    assert autocast.passed and autocast.dtype == "bfloat16", autocast
