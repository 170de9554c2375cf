"""Language models under Trainer and TRL, set from a plan: a peft LoRA model trained exactly over
uneven token counts (float64, against one big batch), Trainer's per-micro-batch mean as the
negative control, the OOM back-off that keeps the update, and TRL's SFTTrainer."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf import collate  # noqa: E402  (right-padded: pad id 0, label -100, mask 0)

from bigbatch.integrations import hf_plan  # noqa: E402
from bigbatch.integrations.hf import (  # noqa: E402
    MemoryBudget,
    check_evaluation_held,
    check_plan_matches,
    check_trainer,
    model_arguments,
    quantization_arguments,
    shift_labels_collator,
    train_with_backoff,
    trainer_arguments,
    trainer_batch_sizes,
    verify_trainer,
    with_plan,
)
from bigbatch.memory.lm import (  # noqa: E402
    LMPlan,
    LMSetup,
    lm_spec_at,
    lora_config,
    plan_lm,
)
from bigbatch.memory.lm_model import enable_checkpointing  # noqa: E402
from bigbatch.memory.measure import profiled_peak  # noqa: E402
from bigbatch.memory.meta import build_on_meta  # noqa: E402
from bigbatch.memory.step import make_inputs, run_step_loss  # noqa: E402

VOCAB, SEQ, N, LR = 48, 10, 12, 0.5


def tiny_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip


def tiny_lora(r: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_config()).double()
    lora = peft.LoraConfig(r=r, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(base, lora)


def sequences() -> list[dict[str, torch.Tensor]]:
    """12 sequences of 2..10 tokens: micro-batches hold very different token counts."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(N):
        ids = torch.randint(
            1, VOCAB, (int(torch.randint(2, SEQ + 1, (), generator=g)),), generator=g
        )
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def trained(args_dir, micro: int, steps: int, **kwargs):  # type: ignore[no-untyped-def]
    settings = {"num_train_epochs": 1, "learning_rate": LR, "optim": "sgd", "weight_decay": 0.0}
    return transformers.TrainingArguments(
        output_dir=str(args_dir), per_device_train_batch_size=micro,
        gradient_accumulation_steps=steps, lr_scheduler_type="constant", max_grad_norm=0.0,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, **(settings | kwargs),
    )  # fmt: skip


def trainer_for(model, data, extra_callbacks=()):  # type: ignore[no-untyped-def]
    def make(args):  # type: ignore[no-untyped-def]
        return transformers.Trainer(
            model=model, args=args, train_dataset=data, data_collator=collate,
            callbacks=list(extra_callbacks),
        )  # fmt: skip

    return make


def big_batch(model, data):  # type: ignore[no-untyped-def]
    """One SGD step on all sequences at once: the mean over every predicted token."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    model(**collate(data)).loss.backward()
    opt.step()
    return model


def big_batch_adamw(model, data, steps: int, smoothing: float = 0.0):  # type: ignore[no-untyped-def]
    """``steps`` AdamW steps (decoupled weight decay 0.1, Trainer's betas and eps) on all the
    sequences at once: Trainer's run over ``steps`` epochs of one window each; with
    ``smoothing``, the loss is transformers' LabelSmoother's mean over every predicted token."""
    from transformers.trainer_pt_utils import LabelSmoother

    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR / 50, weight_decay=0.1,
        betas=(0.9, 0.999), eps=1e-8,
    )  # fmt: skip
    for _ in range(steps):
        batch = collate(data)
        if smoothing:
            labels = batch.pop("labels")
            LabelSmoother(smoothing)(model(**batch), labels, shift_labels=True).backward()
        else:
            model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def update_err(got, want, init) -> float:  # type: ignore[no-untyped-def]
    trio = [
        (g, w, i)
        for g, w, i in zip(got.parameters(), want.parameters(), init.parameters(), strict=True)
        if i.requires_grad
    ]
    num = max(float((g - w).detach().abs().max()) for g, w, _ in trio)
    return num / max(float((w - i).detach().abs().max()) for _, w, i in trio)


def plan_of(global_batch: int, max_micro: int, **setup):  # type: ignore[no-untyped-def]
    """A plan as bigbatch.memory.lm.plan_lm returns it, as far as with_plan reads it."""
    return SimpleNamespace(
        global_batch=global_batch,
        setup=LMSetup(seq_len=SEQ, **setup),
        plan=SimpleNamespace(max_micro_batch=max_micro),
    )


@pytest.mark.slow
def test_lora_under_trainer_set_from_a_plan_is_exact_and_a_mean_per_micro_batch_is_not(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    init, data = tiny_lora(), sequences()
    want = big_batch(copy.deepcopy(init), data)
    args = with_plan(trained(tmp_path, 12, 1), plan_of(N, 5))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 3)
    got = copy.deepcopy(init)
    trainer_for(got, data)(args).train()
    assert update_err(got, want, init) < 1e-12
    # The negative control: each micro-batch's mean divided by the accumulation (Trainer's
    # way for a model it cannot pass the window's count to).
    plain = copy.deepcopy(init)
    trainer = trainer_for(plain, data)(args)
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    assert update_err(plain, want, init) > 0.02


@pytest.mark.slow
def test_lora_under_trainer_with_adamw_and_weight_decay_over_steps_is_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The real optimizer over more than one step: Trainer's AdamW with weight decay, three
    epochs of one window each, against three big-batch steps; every adapter tensor compared,
    and the frozen base (no gradient) left exactly as it was."""
    init, data = tiny_lora(), sequences()
    want = big_batch_adamw(copy.deepcopy(init), data, steps=3)
    adamw = {"optim": "adamw_torch", "weight_decay": 0.1, "learning_rate": LR / 50,
             "num_train_epochs": 3}  # fmt: skip

    def run(per_micro_batch_mean: bool):  # type: ignore[no-untyped-def]
        model = copy.deepcopy(init)
        args = with_plan(trained(tmp_path, 12, 1, **adamw), plan_of(N, 5))
        trainer = trainer_for(model, data)(args)
        trainer.model_accepts_loss_kwargs = not per_micro_batch_mean
        trainer.train()
        return model

    got = run(False)
    assert update_err(got, want, init) < 1e-12
    for g, i in zip(got.parameters(), init.parameters(), strict=True):
        if not i.requires_grad:
            assert g.grad is None and torch.equal(g, i)
    assert update_err(run(True), want, init) > 0.02  # a mean per micro-batch: not the update


class _OutOfMemoryAbove(transformers.TrainerCallback):  # type: ignore[misc]
    """A card too small for micro-batches over ``largest``: the first step runs out."""

    def __init__(self, largest: int) -> None:
        self.largest = largest

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if args.per_device_train_batch_size > self.largest:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.slow
def test_backoff_after_out_of_memory_keeps_the_update(tmp_path) -> None:  # type: ignore[no-untyped-def]
    init, data = tiny_lora(), sequences()
    want = big_batch(copy.deepcopy(init), data)
    got = copy.deepcopy(init)
    said: list[str] = []
    budget = MemoryBudget(2**40, steps=1)
    make = trainer_for(got, data, [_OutOfMemoryAbove(3), budget])
    train_with_backoff(make, trained(tmp_path, 12, 1), log=said.append)
    assert said == [
        "out of memory at micro-batch 12: again at 6 x 2 accumulation, the same global batch",
        "out of memory at micro-batch 6: again at 3 x 4 accumulation, the same global batch",
    ]
    assert update_err(got, want, init) < 1e-12
    assert budget.measured_bytes is not None and budget.measured_bytes > 0  # the CPU's peak RSS


@pytest.mark.slow
@pytest.mark.parametrize(
    ("measured", "card", "sizes"),
    [(700, None, (6, 2)), (2100, None, (3, 4)), (1400, (2500, 900), (3, 4))],
    ids=["grows", "shrinks", "shrinks-for-nccl"],
)
def test_the_first_steps_measured_refit_trainer_and_keep_the_update(
    tmp_path, monkeypatch, measured: int, card: tuple[int, int] | None, sizes: tuple[int, int]
) -> None:  # type: ignore[no-untyped-def]
    """A CUDA step measured at half its prediction (or over the usable memory, or as predicted
    on a card whose NCCL communicators hold 650 bytes more than the plan kept out) after the
    first optimizer step: Trainer stops at a checkpoint and goes on at the refitted micro-batch, and
    AdamW's three steps equal three big-batch steps (every adapter tensor, < 1e-12; the frozen
    base untouched, with no gradient). The same refitted run with a mean per micro-batch
    (the control) is off by more than 2 %."""
    import bigbatch.device

    # The plan's predictions: 1000 + 100 bytes a sequence, 2000 usable of a 2500-byte card
    # (250 of context, a 10 % margin); micro-batch 4 x 3.
    curve = SimpleNamespace(curve=[(1, 1100), (4, 1400)], usable_bytes=2000, max_micro_batch=4,
                            budget_bytes=2500, overhead_bytes=250)  # fmt: skip
    plan = SimpleNamespace(global_batch=N, setup=LMSetup(seq_len=SEQ), plan=curve,
                           per_rank_extra_bytes=0, peak_bytes=1400)  # fmt: skip
    monkeypatch.setattr(bigbatch.device, "peak_memory_bytes", lambda device: (measured, False))
    monkeypatch.setattr(bigbatch.device, "card_memory", lambda device: card)
    init, data = tiny_lora(), sequences()
    want = big_batch_adamw(copy.deepcopy(init), data, steps=3)
    adamw = {"optim": "adamw_torch", "weight_decay": 0.1, "learning_rate": LR / 50,
             "num_train_epochs": 3}  # fmt: skip

    def run(folder, per_micro_batch_mean: bool):  # type: ignore[no-untyped-def]
        args = with_plan(trained(folder, 12, 1, **adamw), plan)
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 3)
        model, said = copy.deepcopy(init), []
        budget = MemoryBudget(2**40, steps=1, plan=plan)
        build = trainer_for(model, data, [budget])

        def make(a):  # type: ignore[no-untyped-def]
            trainer = build(a)
            trainer.model_accepts_loss_kwargs = not per_micro_batch_mean
            return trainer

        train_with_backoff(make, args, log=said.append)
        assert said == [
            f"memory measured at micro-batch 4: on at {sizes[0]} x {sizes[1]} accumulation "
            "from the checkpoint, the same global batch"
        ]
        assert (folder / "checkpoint-1").is_dir() and budget.refit is None
        return model

    got = run(tmp_path / "exact", False)
    assert update_err(got, want, init) < 1e-12
    for g, i in zip(got.parameters(), init.parameters(), strict=True):
        if not i.requires_grad:
            assert g.grad is None and torch.equal(g, i)
    assert update_err(run(tmp_path / "mean", True), want, init) > 0.02


@pytest.mark.parametrize(
    ("allocated", "refit"),
    [(1130, None), (None, (3, 4)), (500, None)],
    ids=["allocated", "reserved-only", "allocated-far-under"],
)
def test_a_reserved_peak_climbed_by_changing_lengths_is_not_read_as_need(
    monkeypatch, allocated: int | None, refit: tuple[int, int] | None
) -> None:  # type: ignore[no-untyped-def]
    """Micro-batches of changing lengths left the allocator's reserved peak at 2100 bytes, over
    the 2000 usable, while the allocated peak (1130) is what the plan predicted for its step
    (1120 allocated, 1400 reserved): the step needs 1412 in the plan's terms and the sizes stay.
    The control: with the reserved peak alone (no allocated one), the refit shrinks. Far under
    (500 allocated: a need of 625), it does not grow, since the reserved peak is not."""
    import bigbatch.device

    prediction = SimpleNamespace(allocated_bytes=1120, planning_bytes=1400)
    curve = SimpleNamespace(curve=[(1, 1100), (4, 1400)], usable_bytes=2000, max_micro_batch=4,
                            budget_bytes=2500, overhead_bytes=250, prediction=prediction)  # fmt: skip
    plan = SimpleNamespace(plan=curve, per_rank_extra_bytes=0, peak_bytes=1400)
    monkeypatch.setattr(bigbatch.device, "peak_memory_bytes", lambda device: (2100, False))
    monkeypatch.setattr(bigbatch.device, "peak_allocated_bytes", lambda device: allocated)
    monkeypatch.setattr(bigbatch.device, "card_memory", lambda device: None)
    budget = MemoryBudget(2**40, steps=1, plan=plan)
    args = SimpleNamespace(device=torch.device("cpu"), per_device_train_batch_size=4,
                           gradient_accumulation_steps=3)  # fmt: skip
    state, control = SimpleNamespace(global_step=1, log_history=[]), SimpleNamespace()
    budget.on_step_end(args, state, control)
    assert budget.refit == refit
    logged = state.log_history[-1]
    assert logged["bigbatch/step_need_bytes"] == {1130: 1412, None: 2100, 500: 625}[allocated]


@pytest.mark.slow
def test_backoff_when_building_the_trainer_runs_out_of_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An OOM before any Trainer exists (moving the model to the card) backs off too."""
    said: list[str] = []

    def make(args):  # type: ignore[no-untyped-def]
        if args.per_device_train_batch_size > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        raise ValueError("built at micro-batch 1")

    args = SimpleNamespace(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3
    )
    with pytest.raises(ValueError, match="built at micro-batch 1"):
        train_with_backoff(make, args, log=said.append)
    assert [line.split(":")[0] for line in said] == [
        "out of memory at micro-batch 4",
        "out of memory at micro-batch 2",
    ]


def test_the_sizes_a_rank_left_are_resumed_only_for_the_same_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bigbatch-sizes.json (left by a rank out of memory under torchrun) sets the sizes a
    relaunched run starts at, without growing back; a file of another global batch or number
    of ranks is another run's and is left alone."""

    sizes = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 6,
             "world_size": 2, "out_of_memory_at": 4}  # fmt: skip
    (tmp_path / "bigbatch-sizes.json").write_text(json.dumps(sizes))
    budget = MemoryBudget(2**40)
    seen: list[tuple[int, int, bool]] = []

    class Trainer:  # records the sizes it was built with
        def __init__(self, args):  # type: ignore[no-untyped-def]
            self.callback_handler = SimpleNamespace(callbacks=[budget])
            a = args
            seen.append((a.per_device_train_batch_size, a.gradient_accumulation_steps, False))

        def train(self, resume_from_checkpoint=None):  # type: ignore[no-untyped-def]
            seen[-1] = (*seen[-1][:2], budget.checked)

    def args(micro: int, steps: int, world: int = 2) -> SimpleNamespace:
        return SimpleNamespace(per_device_train_batch_size=micro, gradient_accumulation_steps=steps,
                               output_dir=str(tmp_path), world_size=world)  # fmt: skip

    said: list[str] = []
    train_with_backoff(Trainer, args(4, 3), log=said.append)
    assert seen == [(2, 6, True)] and said[0].startswith("resuming at 2 x 6 accumulation")
    assert not (tmp_path / "bigbatch-sizes.json").exists()  # spent once the run is done
    (tmp_path / "bigbatch-sizes.json").write_text(json.dumps(sizes))
    budget.checked = False
    for other in (args(4, 4), args(4, 3, world=4)):  # another global batch, other ranks
        train_with_backoff(Trainer, other, log=said.append)
    assert seen[1:] == [(4, 4, False), (4, 3, False)] and len(said) == 1


def test_backoff_reraises_what_is_not_out_of_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def make(args):  # type: ignore[no-untyped-def]
        raise ValueError("a bad dataset")

    with pytest.raises(ValueError, match="a bad dataset"):
        train_with_backoff(make, SimpleNamespace(output_dir=str(tmp_path)))


@pytest.mark.slow
def test_out_of_memory_while_evaluating_halves_the_evaluation_batch_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An OOM raised inside Trainer's evaluation loop (Trainer's default of 8 sequences a
    forward pass, say) is retried from the last checkpoint at half the evaluation batch, the
    training micro-batch and accumulation unchanged; at 1 it is raised. One in training
    still halves the micro-batch."""

    class Trainer:  # out of memory training over 4 sequences, evaluating over args.fits
        def __init__(self, args):  # type: ignore[no-untyped-def]
            self.args = args

        def evaluation_loop(self) -> None:
            if self.args.per_device_eval_batch_size > self.args.fits:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        def train(self, resume_from_checkpoint=None):  # type: ignore[no-untyped-def]
            if self.args.per_device_train_batch_size > 4:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            self.evaluation_loop()
            a = self.args
            return (
                a.per_device_train_batch_size,
                a.gradient_accumulation_steps,
                a.per_device_eval_batch_size,
            )

    def args(micro: int, eval_batch: int, fits: int = 2) -> SimpleNamespace:
        return SimpleNamespace(per_device_train_batch_size=micro, gradient_accumulation_steps=2,
                               per_device_eval_batch_size=eval_batch, fits=fits,
                               output_dir=str(tmp_path))  # fmt: skip

    said: list[str] = []
    assert train_with_backoff(Trainer, args(4, 8), log=said.append) == (4, 2, 2)
    assert said == [
        "out of memory evaluating 8 sequences a forward pass: again at 4 from the last "
        "checkpoint, training's sizes unchanged",
        "out of memory evaluating 4 sequences a forward pass: again at 2 from the last "
        "checkpoint, training's sizes unchanged",
    ]
    assert train_with_backoff(Trainer, args(8, 2), log=said.append) == (4, 4, 2)
    assert said[-1].startswith("out of memory at micro-batch 8: again at 4 x 4")
    with pytest.raises(torch.OutOfMemoryError):
        train_with_backoff(Trainer, args(4, 2, fits=0), log=said.append)
    assert said[-1].startswith("out of memory evaluating 2 sequences a forward pass: again at 1")


def test_an_evaluation_keeping_every_passs_logits_past_the_plan_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With compute_metrics, Trainer keeps every evaluation pass's logits on the card until the
    evaluation ends (a Qwen2.5's 152,064-token vocabulary here): past the room the plan leaves
    beside evaluating, train_with_backoff refuses it in one line before training (halving the
    evaluation batch would not shrink them). Each setting that keeps them off the card, a
    plan with room for them, and no evaluation at all are let be; eval_accumulation_steps over
    1 is counted as the passes' logits it keeps."""
    room = 2**20
    plan = SimpleNamespace(setup=LMSetup(seq_len=SEQ), vocab=152_064, global_batch=N,
                           plan=SimpleNamespace(max_micro_batch=4), usable_bytes=2**30,
                           eval_peak_bytes=2**30 - room, peak_bytes=2**30 - 2 * room)  # fmt: skip

    def make(args):  # type: ignore[no-untyped-def]
        return transformers.Trainer(
            model=tiny_lora(), args=args, train_dataset=sequences(), eval_dataset=sequences(),
            data_collator=collate, compute_metrics=lambda p, compute_result=True: {},
            callbacks=[MemoryBudget(2**30, plan=plan)],
        )  # fmt: skip

    args = trained(tmp_path, 2, 6, eval_strategy="steps", eval_steps=1)
    why = (r"^Trainer keeps every evaluation pass's logits on the card until evaluation ends "
           r"\(compute_metrics\): 12 sequences x 10 tokens x 152,064 vocabulary = 69.6 MiB, twice "
           r"that as it concatenates them, past the 1.0 MiB the plan leaves beside evaluating: "
           r"set eval_accumulation_steps=1 \(each pass's logits to the CPU\), or reduce them in "
           r"preprocess_logits_for_metrics \(logits.argmax\(-1\)\)$")  # fmt: skip
    with pytest.raises(ValueError, match=why):
        train_with_backoff(make, args, log=pytest.fail)
    for fixed in ({"eval_accumulation_steps": 1}, {"batch_eval_metrics": True},
                  {"prediction_loss_only": True}):  # fmt: skip
        check_evaluation_held(make(dataclasses.replace(args, **fixed)), plan)
    trainer = make(args)
    trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
    check_evaluation_held(trainer, plan)
    roomy = SimpleNamespace(**{**vars(plan), "eval_peak_bytes": 2**30 - 150 * 2**20})
    check_evaluation_held(make(args), roomy)
    check_evaluation_held(make(trained(tmp_path, 2, 6)), plan)  # eval_strategy "no"
    # eval_accumulation_steps over 1 keeps that many passes' logits on the card: counted so.
    some = SimpleNamespace(**{**vars(plan), "eval_peak_bytes": 2**30 - 100 * 2**20})
    passes = dataclasses.replace(args, per_device_eval_batch_size=2, eval_accumulation_steps=3)
    with pytest.raises(ValueError, match=r"^Trainer keeps 3 evaluation passes' logits on the "
                                         r"card at a time \(compute_metrics, eval_accumulation_"
                                         r"steps=3\): 6 sequences x 10 tokens x 152,064 "
                                         r"vocabulary = 34.8 MiB, twice that"):  # fmt: skip
        check_evaluation_held(make(passes), plan)
    check_evaluation_held(make(passes), some)  # 69.6 MiB of 100
    with pytest.raises(ValueError, match=r"^Trainer keeps every evaluation pass's logits .* = "
                                         r"69.6 MiB, twice that"):  # fmt: skip
        check_evaluation_held(make(args), some)  # all 12 sequences: 139.2 MiB of 100


def test_logits_trainer_keeps_under_mixed_precision_are_float32(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """accelerate hands a mixed-precision forward's 16-bit outputs back in float32, so Trainer
    keeps bf16 weights' logits in float32 under bf16=True (in bf16 without it): the logits
    check_evaluation_held counts are twice as wide under a bf16 plan as under an fp32 plan of
    bf16 weights."""
    seen = []

    def record(logits, labels):  # type: ignore[no-untyped-def]
        seen.append(logits.dtype)
        return logits

    for bf16 in (True, False):
        args = trained(tmp_path, 2, 1, bf16=bf16, per_device_eval_batch_size=4)
        trainer = transformers.Trainer(
            model=transformers.LlamaForCausalLM(tiny_config()).bfloat16(), args=args,
            eval_dataset=sequences()[:4], data_collator=collate,
            compute_metrics=lambda p: {}, preprocess_logits_for_metrics=record,
        )  # fmt: skip
        trainer.evaluate()
    assert seen == [torch.float32, torch.bfloat16]
    plan = SimpleNamespace(setup=LMSetup(seq_len=SEQ), vocab=152_064, usable_bytes=2**30,
                           eval_peak_bytes=2**30 - 2**20, peak_bytes=2**30,
                           weights_dtype="bfloat16")  # fmt: skip
    trainer = transformers.Trainer(
        model=tiny_lora(), args=trained(tmp_path, 2, 6, eval_strategy="steps"),
        eval_dataset=sequences(), compute_metrics=lambda p: {},
    )  # fmt: skip
    held = {}
    for precision in ("bf16", "fp32"):
        plan.plan = SimpleNamespace(prediction=SimpleNamespace(precision=precision))
        with pytest.raises(ValueError, match=r"vocabulary = ") as said:
            check_evaluation_held(trainer, plan)
        held[precision] = str(said.value).split(" = ")[1].split(",")[0]
    assert held == {"bf16": "69.6 MiB", "fp32": "34.8 MiB"}


@pytest.mark.slow
def test_sft_trainers_evaluation_with_compute_metrics_makes_the_logits_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TRL's SFTTrainer trains and evaluates through its fused LM head, but with compute_metrics
    it makes each pass's whole logits in a forward pass more, and keeps them as Trainer does:
    refused as Trainer's, and under a plan of its fused head (--loss trl), whose evaluation
    batch holds no logits at all, whatever keeps them off the card; without compute_metrics,
    let be."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    if not hasattr(pytest.importorskip("trl.trainer.utils"), "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head")
    plan = SimpleNamespace(setup=LMSetup(seq_len=SEQ), vocab=152_064, usable_bytes=2**30,
                           eval_peak_bytes=2**30 - 2**20, peak_bytes=2**30)  # fmt: skip
    fused = SimpleNamespace(**{**vars(plan), "setup": LMSetup(seq_len=SEQ, loss="trl")})
    data = datasets.Dataset.from_list([{"input_ids": i["input_ids"].tolist()} for i in sequences()])
    shapes: list[tuple[int, ...]] = []

    def metrics(p, compute_result=True):  # type: ignore[no-untyped-def]
        predictions = p.predictions if isinstance(p.predictions, tuple) else (p.predictions,)
        shapes.extend(x.shape for x in predictions)
        return {}

    def sft(compute_metrics=metrics, **extra):  # type: ignore[no-untyped-def]
        config = trl.SFTConfig(
            output_dir=str(tmp_path), eval_strategy="steps", eval_steps=1, use_cpu=True,
            bf16=False, max_length=None, report_to=[], disable_tqdm=True,
            dataloader_num_workers=0, **extra,
        )  # fmt: skip
        return trl.SFTTrainer(model=tiny_lora(), args=config, train_dataset=data,
                              eval_dataset=data, processing_class=tokenizer(),
                              compute_metrics=compute_metrics)  # fmt: skip

    with warnings.catch_warnings():  # TRL's deprecation of the logits it makes for metrics
        warnings.simplefilter("ignore", FutureWarning)
        sft().evaluate()
    assert shapes == [(N, SEQ - 1, VOCAB)]  # the whole logits, each sequence's
    with pytest.raises(ValueError, match=r"^Trainer keeps every evaluation pass's logits"):
        check_evaluation_held(sft(), plan)
    with pytest.raises(ValueError, match=r"^the plan traces SFTTrainer's evaluation through its "
                       r"fused LM head, .*: drop compute_metrics \(SFTTrainer logs its "
                       r"mean_token_accuracy itself\), or plan with --loss model$"):  # fmt: skip
        check_evaluation_held(sft(eval_accumulation_steps=1), fused)
    check_evaluation_held(sft(compute_metrics=None), fused)


@pytest.mark.slow
def test_sft_trainers_compute_loss_func_takes_the_whole_logits_refused_under_a_fused_plan(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    """SFTTrainer given compute_loss_func hands it the model's whole logits (measured: one
    micro-batch's [sequences, tokens, vocabulary]), which a plan of its fused LM head (--loss
    trl) never holds: check_trainer, and train_with_backoff before a step, refuse it in one
    line; without the function, or under a plan of the model's own loss, let be."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    if not hasattr(pytest.importorskip("trl.trainer.utils"), "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head")
    fused = SimpleNamespace(setup=LMSetup(seq_len=SEQ, loss="trl"), peak_bytes=2**30)
    whole = SimpleNamespace(**{**vars(fused), "setup": LMSetup(seq_len=SEQ)})
    data = datasets.Dataset.from_list([{"input_ids": i["input_ids"].tolist()} for i in sequences()])
    shapes: list[tuple[int, ...]] = []

    def loss(outputs, labels, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        shapes.append(tuple(outputs.logits.shape))
        return outputs.logits.sum() * 0

    def sft(compute_loss_func=loss, callbacks=()):  # type: ignore[no-untyped-def]
        config = trl.SFTConfig(
            output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True,
            bf16=False, max_length=None, report_to=[], disable_tqdm=True, save_strategy="no",
            dataloader_num_workers=0,
        )  # fmt: skip
        with warnings.catch_warnings():  # TRL's deprecation of compute_loss_func
            warnings.simplefilter("ignore", FutureWarning)
            return trl.SFTTrainer(model=tiny_lora(), args=config, train_dataset=data,
                                  processing_class=tokenizer(), callbacks=list(callbacks),
                                  compute_loss_func=compute_loss_func)  # fmt: skip

    sft().train()
    assert len(shapes) == 1 and shapes[0][0] == 4 and shapes[0][2] == VOCAB  # the whole logits
    said = (r"^the plan traces SFTTrainer's fused LM head, and a trainer given compute_loss_func "
            r"hands that function the model's whole logits .*: drop compute_loss_func .*, or plan "
            r"with --loss model$")  # fmt: skip
    with pytest.raises(ValueError, match=said):
        check_trainer(sft(), fused)
    budget = MemoryBudget(2**40, plan=fused)
    with pytest.raises(ValueError, match=said):
        train_with_backoff(lambda args: sft(callbacks=[budget]), sft(None).args)
    assert len(shapes) == 1  # refused before a step
    check_trainer(sft(compute_loss_func=None), fused)
    check_trainer(sft(), whole)


def test_a_subclass_computing_its_own_loss_under_a_fused_plan_is_named(caplog, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Trainer subclass's own compute_loss under a plan of TRL's fused LM head: whether it
    calls the model with fused_lm_head=True (else the model makes its whole logits, which the
    plan does not hold) only running it shows, so check_trainer names the class and the fix;
    without an override, or under a plan of the model's own loss, it says nothing.
    train_with_backoff says it once, not again at each smaller micro-batch."""

    class OwnLoss:  # a subclass of SFTTrainer, as check_trainer sees one
        args = SimpleNamespace()
        compute_loss_func = None

        def compute_loss(self, model, inputs, **kwargs):  # type: ignore[no-untyped-def]
            return model(**inputs).logits.sum()

    fused = SimpleNamespace(setup=LMSetup(seq_len=SEQ, loss="trl"), peak_bytes=2**30)
    whole = SimpleNamespace(**{**vars(fused), "setup": LMSetup(seq_len=SEQ)})
    with caplog.at_level(logging.WARNING, logger="bigbatch"):
        check_trainer(OwnLoss(), whole)
        check_trainer(SimpleNamespace(args=SimpleNamespace(), compute_loss_func=None), fused)
        assert caplog.messages == []
        check_trainer(OwnLoss(), fused)
    assert caplog.messages == [
        "the plan traces SFTTrainer's fused LM head, and OwnLoss overrides compute_loss: a model "
        "called there without fused_lm_head=True makes its whole logits, which the plan's "
        "micro-batch would not hold; compute the loss with super().compute_loss(...), or plan "
        "with --loss model"
    ]
    budget = MemoryBudget(2**40, plan=fused)

    class Backed(OwnLoss):  # out of memory over 2 sequences a micro-batch
        callback_handler = SimpleNamespace(callbacks=[budget])

        def __init__(self, args):  # type: ignore[no-untyped-def]
            self.args = args

        def train(self, resume_from_checkpoint=None):  # type: ignore[no-untyped-def]
            if self.args.per_device_train_batch_size > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return self.args.per_device_train_batch_size

    args = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1,
                           output_dir=str(tmp_path / "run"))  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bigbatch"):
        assert train_with_backoff(Backed, args, log=lambda line: None) == 2  # three tries
    assert [m.split(":")[0] for m in caplog.messages] == [
        "the plan traces SFTTrainer's fused LM head, and OwnLoss overrides compute_loss"
    ]


def test_a_plan_of_the_models_loss_for_sft_trainer_says_what_its_fused_head_frees(
    monkeypatch, caplog
) -> None:  # type: ignore[no-untyped-def]
    """A plan of the model's own loss holds for SFTTrainer, whose fused LM head makes none of
    its logits: where they are a tenth of the peak or more, MemoryBudget says so as training
    begins, with the fix (--loss trl); not for Trainer's arguments, SFTTrainer's smoothed loss
    (the whole logits), logits under a tenth, or a TRL without that head."""
    import logging

    import bigbatch.memory.lm_setup as lm_module

    trl = pytest.importorskip("trl")
    if not hasattr(pytest.importorskip("trl.trainer.utils"), "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head")
    sft = {"output_dir": "unused", "use_cpu": True, "bf16": False, "report_to": []}

    def said(args, frees: int = 3 * 2**30) -> list[str]:  # type: ignore[no-untyped-def]
        plan = SimpleNamespace(setup=LMSetup(SEQ), peak_bytes=2**34,
                               logits_a_fused_head_frees=lambda: frees)  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bigbatch"):
            MemoryBudget(2**40, plan=plan).on_train_begin(args, None, None)
        return [r.getMessage() for r in caplog.records]

    assert said(trl.SFTConfig(**sft)) == [
        "the plan holds 3.00 GiB of logits that SFTTrainer's own loss, through its fused LM "
        'head, never makes: it fits, with that much unused; plan with --loss trl (loss="trl" in '
        "Python) to give the micro-batch that room"
    ]
    assert said(SimpleNamespace(device=torch.device("cpu"), bf16=False)) == []  # Trainer's
    assert said(trl.SFTConfig(**sft, label_smoothing_factor=0.1)) == []
    assert said(trl.SFTConfig(**sft), frees=0) == []
    monkeypatch.setattr(lm_module, "_fused_lm_head", lambda: None)
    assert said(trl.SFTConfig(**sft)) == []


def test_kernels_the_plan_did_not_trace_are_said_when_training_begins(caplog) -> None:  # type: ignore[no-untyped-def]
    """torch_compile (Inductor's kernels) and use_liger_kernel (Liger's) run other kernels than
    the plan traced: MemoryBudget under a plan says so as training begins, naming what holds
    them (the first steps' measurement); eager transformers layers, or no plan, say nothing."""
    import logging

    plan = SimpleNamespace(setup=LMSetup(SEQ), peak_bytes=2**30)
    for flags, budget, said in [
        ({"torch_compile": True}, MemoryBudget(2**40, plan=plan), "torch_compile=True"),
        ({"torch_compile": True, "use_liger_kernel": True}, MemoryBudget(2**40, plan=plan),
         "torch_compile=True and use_liger_kernel=True"),
        ({}, MemoryBudget(2**40, plan=plan), None),
        ({"use_liger_kernel": True}, MemoryBudget(2**40), None),
    ]:  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bigbatch"):
            args = SimpleNamespace(device=torch.device("cpu"), bf16=False, **flags)
            budget.on_train_begin(args, None, None)
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ([] if said is None else [
            f"{said} runs other kernels than the plan traced (transformers' own layers, eager), "
            "whose memory it does not model: MemoryBudget's measurement of the first steps "
            "refits the micro-batch to what they hold (on a GPU)"
        ])  # fmt: skip


def test_a_rank_out_of_memory_evaluating_hands_the_halved_evaluation_batch_over(
    tmp_path,
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """Under torchrun a rank out of memory in Trainer's evaluation cannot retry alone (the
    others wait in a collective): it leaves the halved evaluation batch, training's sizes
    unchanged, in bigbatch-sizes.json and raises; relaunched, every rank evaluates at it and
    training's micro-batch may still grow (nothing shrank it)."""

    import torch.distributed as dist

    import bigbatch.distributed

    monkeypatch.setattr(bigbatch.distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    budget = MemoryBudget(2**40)

    class Trainer:  # out of memory evaluating over 4 sequences
        def __init__(self, args):  # type: ignore[no-untyped-def]
            self.args, self.callback_handler = args, SimpleNamespace(callbacks=[budget])

        def evaluation_loop(self) -> None:
            if self.args.per_device_eval_batch_size > 4:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        def train(self, resume_from_checkpoint=None):  # type: ignore[no-untyped-def]
            self.evaluation_loop()
            a = self.args
            return a.per_device_train_batch_size, a.per_device_eval_batch_size, budget.checked

    def args() -> SimpleNamespace:
        return SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=3,
                               per_device_eval_batch_size=8, world_size=2,
                               output_dir=str(tmp_path))  # fmt: skip

    said: list[str] = []
    with pytest.raises(torch.OutOfMemoryError):
        train_with_backoff(Trainer, args(), log=said.append)
    sizes = json.loads((tmp_path / "bigbatch-sizes.json").read_text())
    assert sizes["per_device_eval_batch_size"] == 4 and sizes["evaluation_out_of_memory_at"] == 8
    assert (sizes["per_device_train_batch_size"], sizes["gradient_accumulation_steps"]) == (4, 3)
    assert said[-1].startswith(
        "out of memory evaluating 8 sequences a forward pass on rank 1 of 2: the others wait"
    )
    assert "resumes at evaluation batch 4, training's sizes unchanged" in said[-1]
    assert train_with_backoff(Trainer, args(), log=said.append) == (4, 4, False)
    assert said[-1].startswith("resuming at evaluation batch 4: a rank ran out of memory at "
                               "evaluation batch 8")  # fmt: skip
    assert not (tmp_path / "bigbatch-sizes.json").exists()  # spent: the run is done


def test_a_second_restart_names_both_causes(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under torchrun, out of memory in training (restart 1) and then in evaluation (restart
    2): the sizes file the second leaves keeps the first's cause, and the relaunch names both."""

    import torch.distributed as dist

    import bigbatch.distributed

    monkeypatch.setattr(bigbatch.distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)

    class Trainer:  # out of memory training over 2 sequences, evaluating over 4
        def __init__(self, args):  # type: ignore[no-untyped-def]
            self.args, self.callback_handler = args, SimpleNamespace(callbacks=[])

        def evaluation_loop(self) -> None:
            if self.args.per_device_eval_batch_size > 4:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        def train(self, resume_from_checkpoint=None):  # type: ignore[no-untyped-def]
            if self.args.per_device_train_batch_size > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            self.evaluation_loop()
            return "trained"

    def args() -> SimpleNamespace:
        return SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=3,
                               per_device_eval_batch_size=8, world_size=2,
                               output_dir=str(tmp_path))  # fmt: skip

    said: list[str] = []
    for _ in range(2):  # two relaunches by torchrun, each process raising
        with pytest.raises(torch.OutOfMemoryError):
            train_with_backoff(Trainer, args(), log=said.append)
    sizes = json.loads((tmp_path / "bigbatch-sizes.json").read_text())
    assert (sizes["out_of_memory_at"], sizes["evaluation_out_of_memory_at"]) == (4, 8)
    assert train_with_backoff(Trainer, args(), log=said.append) == "trained"
    assert said[-1].startswith(
        "resuming at 2 x 6 accumulation, the same global batch and evaluation batch 4: a rank "
        "ran out of memory at micro-batch 4 and evaluation batch 8"
    ), said[-1]


def test_trainer_batch_sizes_keep_the_global_batch() -> None:
    for global_batch, largest, ranks in [(64, 6, 2), (12, 5, 1), (7, 3, 1), (32, 64, 4)]:
        micro, steps = trainer_batch_sizes(global_batch, largest, ranks)
        assert micro <= largest and micro * steps * ranks == global_batch
    with pytest.raises(ValueError, match="multiple of 4"):
        trainer_batch_sizes(30, 4, 4)


@pytest.mark.slow
def test_a_saved_plan_sets_trainer_and_another_fine_tunes_plan_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A plan saved where it was made (``bigbatch plan --hf ... --save``) and loaded where the
    model trains is the plan: it sets Trainer's sizes as the plan itself does, and a run under
    MemoryBudget with it trains. A model with other adapters (r=8 where the plan has r=4), in
    float64 where the plan has float32, or without the checkpointing the plan counted on, is
    refused when training begins, in one line with the fix, before any step; so is a plan
    for CUDA where the run trains on the CPU."""
    plan = plan_lm(tiny_config(), LMSetup(seq_len=SEQ, lora_r=4), N, "1GB", device="cpu",
                   precision="fp32", optimizer="sgd", overhead=0)  # fmt: skip
    loaded = LMPlan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan and (tmp_path / "plan.json").stat().st_mode & 0o777 == 0o644
    args = with_plan(trained(tmp_path, 1, 1), loaded)
    sizes = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    assert sizes == (plan.micro_batch, plan.accumulation) == (12, 1)
    assert plan.evaluation is not None and args.per_device_eval_batch_size == plan.evaluation.batch
    budget = MemoryBudget(2**40, steps=1, plan=loaded)
    trainer_for(tiny_lora().float(), sequences(), [budget])(args).train()  # float32, as planned
    assert budget.measured_bytes is not None

    with_checkpointing = dataclasses.replace(
        loaded, setup=LMSetup(SEQ, lora_r=4, gradient_checkpointing=True)
    )
    for model, refused, why in [
        (tiny_lora(r=8), loaded, "trains 1,024 parameters and this model 2,048: plan this"),
        (tiny_lora(), loaded,  # float64 weights: twice the plan's float32
         r"has 19.2 KiB of weights and this model 38.4 KiB: load it in the dtype planned"),
        (tiny_lora().float(), with_checkpointing,
         "counts on gradient checkpointing and this model runs without it: turn it on"),
    ]:  # fmt: skip
        trainer = trainer_for(model, sequences(), [MemoryBudget(2**40, plan=refused)])(args)
        with pytest.raises(ValueError, match=why) as raised:
            trainer.train()
        assert "\n" not in str(raised.value) and trainer.state.global_step == 0
    checkpointed = tiny_lora().float()
    enable_checkpointing(checkpointed)
    check_plan_matches(with_checkpointing, checkpointed)  # the same fine-tune: no refusal
    # with_plan turns Trainer's checkpointing on for a plan that counts on it: no refusal.
    on = with_plan(trained(tmp_path, 1, 1), with_checkpointing)
    assert on.activation_checkpointing and not args.activation_checkpointing
    budget = MemoryBudget(2**40, steps=1, plan=with_checkpointing)
    trainer_for(tiny_lora().float(), sequences(), [budget])(on).train()
    assert budget.measured_bytes is not None
    # Checkpointing by torch's wrappers, as accelerate's FSDP activation_checkpointing does.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    wrapped = tiny_lora().float()
    layer = type(wrapped.base_model.model.model.layers[0])
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, layer))
    check_plan_matches(with_checkpointing, wrapped)
    cuda_plan = dataclasses.replace(
        loaded, plan=dataclasses.replace(
            loaded.plan, prediction=dataclasses.replace(loaded.plan.prediction, device="cuda")
        ),
    )  # fmt: skip
    with pytest.raises(ValueError, match="is for cuda and this run trains on cpu: plan with"):
        check_plan_matches(cuda_plan, tiny_lora().float(), torch.device("cpu"))
    check_plan_matches(loaded, tiny_lora().float(), "cpu")
    # Another attention than the plan traced (SDPA, chosen as from_pretrained chooses): the
    # model's, recorded in its config, forwarded by peft.
    assert loaded.setup.attn == "sdpa"
    flash = dataclasses.replace(loaded, setup=LMSetup(SEQ, lora_r=4, attn="flash_attention_2"))
    eager = tiny_lora().float()
    eager.base_model.model.set_attn_implementation("eager")
    for refused, model, why in [
        (flash, tiny_lora().float(),
         r"traced flash_attention_2 attention and this model runs sdpa: load it with "
         r"attn_implementation='flash_attention_2' \(from_pretrained\(\.\.\., "
         r"\*\*model_arguments\(plan\)\) does\), or plan with --attn sdpa$"),
        (loaded, eager,
         r"traced sdpa attention and this model runs eager: .*, or plan with --attn eager$"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            check_plan_matches(refused, model, "cpu")
    # flash_attention_2 from the hub's kernels, as transformers loads it without flash-attn.
    kernel = tiny_lora().float()
    kernel.config._attn_implementation = "kernels-community/flash-attn2"
    check_plan_matches(flash, kernel, "cpu")
    # A T4's plan in fp16: a base loaded in bf16 weighs the same, and is refused by its dtype.
    fp16_plan = dataclasses.replace(loaded, setup=LMSetup(SEQ, lora_r=4, dtype="fp16"))
    with pytest.raises(ValueError, match=r"has fp16 weights and this model's are bfloat16: load "
                       r"it with from_pretrained\(\.\.\., dtype=torch.float16\), or plan with "
                       r"--dtype bf16"):  # fmt: skip
        check_plan_matches(fp16_plan, tiny_lora().to(torch.bfloat16), "cpu")
    check_plan_matches(fp16_plan, tiny_lora().half(), "cpu")  # peft's float32 adapters aside


def test_a_vision_language_models_text_attention_is_the_one_compared() -> None:
    """A vision-language model's language model runs the attention its ``text_config`` records,
    which ``set_attn_implementation`` sets apart from the model's (which still says sdpa): the
    plan's text-only step runs that one, and it is compared."""
    from bigbatch.integrations.hf_model_check import _check_attention

    config = transformers.Gemma3Config(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "vocab_size": 300},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4,
    )  # fmt: skip
    model = transformers.Gemma3ForConditionalGeneration._from_config(
        config, attn_implementation="sdpa"
    )
    plan = SimpleNamespace(setup=LMSetup(SEQ, attn="sdpa"))
    _check_attention(plan, model, "a plan")
    model.set_attn_implementation({"text_config": "eager"})
    assert model.config._attn_implementation == "sdpa"  # the model's own says nothing
    with pytest.raises(ValueError, match="traced sdpa attention and this model runs eager"):
        _check_attention(plan, model, "a plan")


@pytest.mark.slow
def test_the_model_a_qlora_plan_describes_loads_from_its_arguments_and_no_other(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``from_pretrained(..., **model_arguments(plan))`` and ``lora_config(plan.setup)`` build
    the fine-tune a (saved, loaded) QLoRA plan traced: bitsandbytes' 4-bit layers computing in
    the config's bf16, double-quantized, which check_plan_matches lets train. Loaded with
    BitsAndBytesConfig's default compute dtype (float32: every dequantized weight twice the
    plan's) or without double quantization (its default too), it refuses the model in one
    line naming model_arguments."""
    pytest.importorskip("bitsandbytes")
    config = tiny_config()
    config.dtype = "bfloat16"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    plan = plan_lm(config, LMSetup(seq_len=SEQ, lora_r=4, quant=4), 4, "1GB", device="cpu",
                   precision="bf16", overhead=0)  # fmt: skip
    loaded = LMPlan.load(plan.save(tmp_path / "plan.json"))
    kwargs = model_arguments(loaded)
    assert kwargs["dtype"] == torch.bfloat16 and kwargs["attn_implementation"] == "sdpa"
    assert kwargs["quantization_config"].bnb_4bit_compute_dtype == torch.bfloat16

    def qlora(**load):  # type: ignore[no-untyped-def]
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", **load)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return peft.get_peft_model(model, lora_config(loaded.setup))

    check_plan_matches(loaded, qlora(**kwargs), "cpu")
    default = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    with pytest.raises(ValueError, match=r"4-bit layers compute in bfloat16 and this model's "
                       r"compute in float32: load it with from_pretrained\(\.\.\., "
                       r"\*\*model_arguments\(plan\)\)"):  # fmt: skip
        check_plan_matches(loaded, qlora(quantization_config=default), "cpu")
    # Its scales in float32 (BitsAndBytesConfig's default): half a bit a weight, not an eighth.
    single = transformers.BitsAndBytesConfig(
        **(quantization_arguments(loaded) | {"bnb_4bit_use_double_quant": False})
    )
    with pytest.raises(ValueError, match=r"double-quantizes its 4-bit layers and 7 of this "
                       r"model's are not .*, or plan with --no-double-quant"):  # fmt: skip
        check_plan_matches(loaded, qlora(quantization_config=single), "cpu")
    no_double = dataclasses.replace(
        loaded, setup=dataclasses.replace(loaded.setup, double_quant=False)
    )
    check_plan_matches(no_double, qlora(quantization_config=single), "cpu")
    # Under FSDP2 the plan packs the 4-bit values in bf16, which FSDP2 shards; bitsandbytes'
    # uint8 (its default) would stay whole on each rank.
    ranks = dataclasses.replace(
        loaded,
        setup=dataclasses.replace(loaded.setup, world_size=2, fsdp=True, quant_storage="bf16"),
    )
    sharded = transformers.BitsAndBytesConfig(**quantization_arguments(ranks))
    assert sharded.bnb_4bit_quant_storage == torch.bfloat16
    check_plan_matches(ranks, qlora(quantization_config=sharded), "cpu")
    with pytest.raises(ValueError, match=r"packs its 4-bit weights in bf16, as FSDP2 shards "
                       r"them, and this model's are packed in uint8: load it with .*"
                       r"bnb_4bit_quant_storage=torch.bfloat16\)\)$"):  # fmt: skip
        check_plan_matches(ranks, qlora(**kwargs), "cpu")
    # A T4's plan (--dtype fp16) computes in fp16; LLM.int8 has no compute dtype to set.
    t4 = SimpleNamespace(setup=LMSetup(SEQ, lora_r=4, quant=4, dtype="fp16"), weights_dtype="")
    assert model_arguments(t4)["quantization_config"].bnb_4bit_compute_dtype == torch.float16
    assert quantization_arguments(t4)["bnb_4bit_compute_dtype"] == torch.float16
    int8 = model_arguments(SimpleNamespace(setup=LMSetup(SEQ, lora_r=4, quant=8)))
    assert int8["dtype"] == "auto" and int8["quantization_config"].load_in_8bit
    older = SimpleNamespace(setup=LMSetup(SEQ, lora_r=4, quant=4), weights_dtype="")
    with pytest.raises(ValueError, match=r"does not record the weights' dtype .*: plan again"):
        model_arguments(older)


@pytest.mark.slow
def test_a_plan_of_trls_preparation_is_the_model_sft_trainer_builds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``qlora_prep="trl"``: TRL's SFTTrainer given ``peft_config=lora_config(plan.setup)``
    and the 4-bit model ``model_arguments`` loads builds the model the plan traced, each
    parameter in the planned dtype (the base's other weights as loaded, the adapters in
    bfloat16), which check_plan_matches lets train; the model peft readies (float32 copies)
    is refused under that plan, and TRL's lighter model is let through under peft's."""
    pytest.importorskip("bitsandbytes")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    config = tiny_config()
    config.dtype = "bfloat16"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    setup = LMSetup(seq_len=SEQ, lora_r=4, quant=4, qlora_prep="trl")
    plan = plan_lm(config, setup, 4, "1GB", device="cpu", precision="bf16", overhead=0)
    data = datasets.Dataset.from_list([{"input_ids": i["input_ids"].tolist()} for i in sequences()])
    args = with_plan(
        trl.SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], bf16=True,
                      max_length=SEQ, save_strategy="no"),
        plan,
    )  # fmt: skip

    def loaded() -> torch.nn.Module:
        path = tmp_path / "model"
        return transformers.AutoModelForCausalLM.from_pretrained(path, **model_arguments(plan))

    budget = MemoryBudget(2**30, plan=plan)  # checks the model when training begins
    trainer = trl.SFTTrainer(model=loaded(), args=dataclasses.replace(args, max_steps=1),
                             train_dataset=data, processing_class=tokenizer(),
                             peft_config=lora_config(setup), callbacks=[budget])  # fmt: skip
    theirs = trainer.model
    traced = build_on_meta(lm_spec_at(config, plan.setup, precision="bf16")(1).model)

    def floats(model: torch.nn.Module) -> dict[tuple[str, bool], torch.dtype]:
        """Each floating parameter's dtype by name (the 4-bit packed weights aside)."""
        return {
            (n, p.requires_grad): p.dtype
            for n, p in model.named_parameters()
            if p.is_floating_point()
        }

    assert floats(theirs) == floats(traced)
    assert {p.dtype for p in theirs.parameters() if p.requires_grad} == {torch.bfloat16}
    trainer.train()
    assert budget.measured_bytes
    prepared = peft.prepare_model_for_kbit_training(loaded(), use_gradient_checkpointing=False)
    with pytest.raises(ValueError, match=r"as TRL's SFTTrainer does .* this model's adapters and "
                       r"other weights are float32, .* or plan with --qlora-prep peft$"):  # fmt: skip
        check_plan_matches(plan, peft.get_peft_model(prepared, lora_config(setup)), "cpu")
    peft_plan = dataclasses.replace(plan, setup=dataclasses.replace(setup, qlora_prep="peft"))
    check_plan_matches(peft_plan, theirs, "cpu")


def test_the_arguments_of_trls_other_trainers_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """DPO's preference pairs (and its reference model), GRPO's generations: steps a plan
    does not trace, refused in one line, where SFTConfig is set; a subclass of one's own too."""
    trl = pytest.importorskip("trl")
    common = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "report_to": []}
    sft = trl.SFTConfig(**common, max_length=SEQ)
    assert with_plan(sft, plan_of(N, 5)).per_device_train_batch_size == 4

    class MyDPOConfig(trl.DPOConfig):
        pass

    for args, kind in [(trl.DPOConfig(**common), "DPO"), (trl.GRPOConfig(**common), "GRPO"),
                       (MyDPOConfig(**common), "DPO")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"^these are the arguments of TRL's {kind} trainer "
                           rf"\({type(args).__name__}\), .* set this trainer's sizes yourself$"):  # fmt: skip
            with_plan(args, plan_of(N, 5))


def test_arguments_that_shard_otherwise_than_the_plan_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An FSDP2 plan's ranks hold a shard each: arguments without FSDP (DDP) would hold the
    whole model on each rank and run out of memory; FSDP where the plan has DDP's copies,
    FSDP's version 1, or weights kept gathered after each forward, is not what it traced.
    Each is refused in one line naming the fix."""

    def plan(**setup: Any) -> SimpleNamespace:
        return SimpleNamespace(global_batch=8, setup=LMSetup(SEQ, world_size=2, **setup),
                               plan=SimpleNamespace(max_micro_batch=4))  # fmt: skip

    base = {"world_size": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    with pytest.raises(ValueError, match=r"whole on each rank \(DDP\): set fsdp=True \(FSDP2"):
        with_plan(SimpleNamespace(**base), plan(fsdp=True))
    for fsdp in (True, "full_shard auto_wrap"):  # transformers 5's, and the older options
        sharded = SimpleNamespace(**base, fsdp=fsdp)
        assert with_plan(sharded, plan(fsdp=True)).per_device_train_batch_size == 4
    for kept in (
        {"fsdp": "shard_grad_op"},
        {"fsdp": True, "fsdp_config": {"reshard_after_forward": False}},
    ):
        with pytest.raises(ValueError, match=r"set fsdp_config=\{'reshard_after_forward': True\}$"):
            with_plan(SimpleNamespace(**base, **kept), plan(fsdp=True))
    assert with_plan(SimpleNamespace(**base), plan()).per_device_train_batch_size == 4
    with pytest.raises(ValueError, match=r"plan with --fsdp, or leave fsdp unset$"):
        with_plan(SimpleNamespace(**base, fsdp=["full_shard", "auto_wrap"]), plan())
    version_1 = SimpleNamespace(**base, fsdp="full_shard", fsdp_config={"version": 1})
    with pytest.raises(ValueError, match=r"run FSDP version 1: set fsdp_config=\{'version': 2\}"):
        with_plan(version_1, plan(fsdp=True))
    # transformers 4 ran version 1 where fsdp_config names none (5 runs FSDP2).
    unnamed = SimpleNamespace(**base, fsdp="full_shard", fsdp_config={})
    monkeypatch.setattr(hf_plan, "_transformers_major", lambda: 4)
    with pytest.raises(ValueError, match=r"run FSDP version 1: set fsdp_config"):
        with_plan(unnamed, plan(fsdp=True))
    named = SimpleNamespace(**base, fsdp="full_shard", fsdp_config={"fsdp_version": 2})
    assert with_plan(named, plan(fsdp=True)).per_device_train_batch_size == 4


@pytest.mark.slow
def test_arguments_with_another_precision_or_optimizer_than_the_plans_are_refused(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    """A plan traced with AdamW in bf16 holds for Trainer's AdamW (torch's, fused or not) in
    bf16 or fp16 (the same bytes), and for no other optimizer or precision: bitsandbytes'
    8-bit AdamW where the plan has torch's, an optimizer bigbatch does not plan, float32
    compute where the plan has autocast's bf16 (twice the activations) and the reverse. Each
    is refused in one line naming the fix, by with_plan and by MemoryBudget when training
    begins (arguments built without with_plan); trainer_arguments names the plan's. A plan
    traced with the fused AdamW holds for it alone: the multi-tensor one's update makes
    temporaries as large as the adapters that the fused one does not."""
    plan = plan_lm(tiny_config(), LMSetup(seq_len=SEQ, lora_r=4), N, "1GB", device="cpu",
                   precision="bf16", overhead=0)  # fmt: skip
    assert trainer_arguments(plan) == {
        "per_device_train_batch_size": N, "gradient_accumulation_steps": 1,
        "per_device_eval_batch_size": N, "bf16": True, "fp16": False,
        "optim": "adamw_torch_fused",  # Trainer's default, which the adamw plan holds for
    }  # fmt: skip
    fused = plan_lm(tiny_config(), LMSetup(seq_len=SEQ, lora_r=4), N, "1GB", device="cpu",
                    precision="bf16", optimizer="adamw_fused", overhead=0)  # fmt: skip
    assert trainer_arguments(fused)["optim"] == "adamw_torch_fused"
    foreach = SimpleNamespace(world_size=1, optim="adamw_torch", bf16=True, fp16=False,
                              per_device_train_batch_size=1, gradient_accumulation_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"traces the adamw_fused optimizer and these arguments "
                       r"train with optim='adamw_torch': set optim='adamw_torch_fused', or plan "
                       r"with --optimizer adamw$"):  # fmt: skip
        with_plan(foreach, fused)
    trainers_default = SimpleNamespace(**{**vars(foreach), "optim": "adamw_torch_fused"})
    assert with_plan(trainers_default, fused).per_device_train_batch_size == N
    model = tiny_lora().float()
    for settings in [{"bf16": True}, {"fp16": True}, {"bf16": True, "optim": "adamw_torch"}]:
        args = SimpleNamespace(world_size=1, optim="adamw_torch_fused", bf16=False, fp16=False,
                               per_device_train_batch_size=1, gradient_accumulation_steps=1)  # fmt: skip
        vars(args).update(settings)
        assert with_plan(args, plan).per_device_train_batch_size == N
        check_plan_matches(plan, model, "cpu", args)
    for settings, why in [
        ({"bf16": True, "optim": "adamw_8bit"}, "traces the adamw optimizer and these arguments "
         "train with optim='adamw_8bit': set optim='adamw_torch_fused', or plan with --optimizer "
         "adamw_8bit"),
        ({"bf16": True, "optim": "adafactor"}, "optim='adafactor': set optim='adamw_torch_fused' "
         r"\(bigbatch plans adamw_torch, "),
        ({}, "computes in bf16 and these arguments in fp32: set bf16=True \\(fp16=True on a "
         "card without bfloat16 units\\), or plan with --precision fp32"),
    ]:  # fmt: skip
        args = trained(tmp_path, 1, 1, **({"optim": "adamw_torch"} | settings))
        with pytest.raises(ValueError, match=why) as raised:
            with_plan(args, plan)
        assert "\n" not in str(raised.value)
        trainer = trainer_for(model, sequences(), [MemoryBudget(2**40, plan=plan)])(args)
        with pytest.raises(ValueError, match=why):
            trainer.train()
        assert trainer.state.global_step == 0
    # An evaluation batch over the plan's, where Trainer evaluates: refused when training
    # begins (with_plan sets the plan's).
    evaluates = SimpleNamespace(world_size=1, optim="adamw_torch", bf16=True, fp16=False,
                                eval_strategy="steps", per_device_eval_batch_size=2 * N)  # fmt: skip
    with pytest.raises(ValueError, match=f"per_device_eval_batch_size={2 * N} is over the plan's"):
        check_plan_matches(plan, model, "cpu", evaluates)
    check_plan_matches(
        plan, model, "cpu", SimpleNamespace(**{**vars(evaluates), "eval_strategy": "no"})
    )
    assert with_plan(evaluates, plan).per_device_eval_batch_size == N
    # Evaluation not planned (inside torchrun under FSDP2): at most the training micro-batch,
    # not Trainer's default of 8 (a smaller one asked for is kept).
    unplanned = dataclasses.replace(plan, evaluation=None)
    assert with_plan(evaluates, unplanned).per_device_eval_batch_size == N
    assert trainer_arguments(unplanned)["per_device_eval_batch_size"] == N
    one = SimpleNamespace(**{**vars(evaluates), "per_device_eval_batch_size": 1})
    assert with_plan(one, unplanned).per_device_eval_batch_size == 1
    fp32 = plan_lm(tiny_config(), LMSetup(seq_len=SEQ, lora_r=4), N, "1GB", device="cpu",
                   precision="fp32", optimizer="adam", overhead=0)  # fmt: skip
    args = SimpleNamespace(world_size=1, optim="adamw_torch", bf16=True, fp16=False)
    with pytest.raises(ValueError, match="optim='adamw_torch': plan with an optimizer Trainer"):
        with_plan(args, fp32)
    args.optim = None  # arguments without an optimizer (not Trainer's): the precision decides
    with pytest.raises(ValueError, match="in fp32 and these arguments in bf16: set bf16=False"):
        with_plan(args, fp32)


def test_with_plan_refuses_arguments_for_another_run() -> None:
    """Another number of ranks than the plan's, and TRL's max_length past its sequence length
    (SFTConfig's default 1024 for a plan of 10 tokens), or None (SFTTrainer then truncates
    nothing, and a sequence past the plan fits no micro-batch), are refused; max_length at or
    under it is not, nor None under padding_free without packing (TRL wants it there: its
    inputs come truncated), nor arguments without one (Trainer's: the user's data decides)."""
    args = SimpleNamespace(
        world_size=2, per_device_train_batch_size=1, gradient_accumulation_steps=1
    )
    with pytest.raises(ValueError, match="--world-size 2"):
        with_plan(args, plan_of(8, 4))
    args.world_size = 1
    for max_length in (None, SEQ, 1024):
        args.max_length = max_length
        if max_length == 1024:
            with pytest.raises(ValueError, match="max_length=1024 tokens, past the plan's 10: set"):
                with_plan(args, plan_of(8, 4))
        else:
            assert with_plan(args, plan_of(8, 4)).per_device_train_batch_size == 4
    trl = pytest.importorskip("trl")
    sft = trl.SFTConfig(output_dir="unused", use_cpu=True, bf16=False, report_to=[])
    with pytest.raises(ValueError, match=r"^these arguments set max_length=None, under which "
                       r"SFTTrainer truncates no sequence, .*: set max_length=10 \(a no-op for "
                       r"data within it\), or plan with --seq-len of the longest$"):  # fmt: skip
        with_plan(dataclasses.replace(sft, max_length=None), plan_of(8, 4))
    assert with_plan(dataclasses.replace(sft, max_length=SEQ), plan_of(8, 4)).max_length == SEQ
    # padding_free without packing, where TRL wants None (its inputs come truncated), under a
    # plan of one row a micro-batch (--packing).
    free = dataclasses.replace(sft, max_length=None, padding_free=True)
    assert with_plan(free, plan_of(8, 4, packing=True)).max_length is None


def test_sequences_in_one_row_under_a_plan_that_pads_them_are_refused() -> None:
    """TRL's padding_free, and its packing's bfd strategies that imply it, put a micro-batch's
    sequences in one row, whose attention mask spans the row (1.76x a padded micro-batch's
    peak at 8 sequences of 256 tokens, tests/memory/test_lm.py): refused under a plan that
    pads them, in the arguments and in a trainer's collator; a plan of one row holds for
    padded sequences, and TRL's wrapped packing (rows of max_length) is padded rows' shape.
    Under flash_attention_2 too (no mask, but its row, one long sequence to the allocator,
    reserved 5.46 GiB where its padded plan had 4.76, 2 x 4096 tokens on a small Llama)."""
    trl = pytest.importorskip("trl")
    sft = trl.SFTConfig(output_dir="unused", use_cpu=True, bf16=False, report_to=[], max_length=SEQ)
    padded, one_row = plan_of(8, 4), plan_of(8, 4, packing=True)
    flash = plan_of(8, 4, attn="flash_attention_2")
    for changes, said in (
        ({"padding_free": True}, "padding_free=True"),
        ({"packing": True}, "packing=True (its bfd strategy is padding-free)"),
    ):
        args = dataclasses.replace(sft, **changes)
        with pytest.raises(ValueError, match=re.escape(
            f"the plan (full fine-tune, 10 tokens, padded) pads each micro-batch's sequences and "
            f"these arguments put them in one row ({said}), another step than the plan traced: "
            "plan with "
            "--packing, or set packing=False and padding_free=False"
        )):  # fmt: skip
            with_plan(args, padded)
        assert with_plan(args, one_row).per_device_train_batch_size == 4
        with pytest.raises(ValueError, match="another step than the plan traced"):
            with_plan(args, flash)
    wrapped = dataclasses.replace(sft, packing=True, packing_strategy="wrapped")
    assert with_plan(wrapped, padded).per_device_train_batch_size == 4
    assert with_plan(sft, one_row).per_device_train_batch_size == 4  # bounded from above
    # A trainer's collator: transformers' flattening one, TRL's padding-free one, and the
    # first under shift_labels_collator (judged by what it wraps).
    flattening = transformers.DataCollatorWithFlattening()
    for collator, name in (
        (flattening, "DataCollatorWithFlattening"),
        (trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True),
         "DataCollatorForLanguageModeling"),
        (shift_labels_collator(flattening), "DataCollatorWithFlattening"),
    ):  # fmt: skip
        trainer = SimpleNamespace(args=sft, data_collator=collator, compute_loss_func=None)
        with pytest.raises(ValueError, match=f"this trainer's collator \\({name}"
                           r"\) puts them in one row, .*: plan with --packing, or pad them$"):  # fmt: skip
            check_trainer(trainer, padded)
        check_trainer(trainer, one_row)
        with pytest.raises(ValueError, match="another step than the plan traced"):
            check_trainer(trainer, flash)
    padding = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0)
    for collator in (padding, shift_labels_collator(padding)):
        check_trainer(SimpleNamespace(args=sft, data_collator=collator, compute_loss_func=None),
                      padded)  # fmt: skip


def test_arguments_that_change_the_global_batch_or_its_count_are_refused() -> None:
    """Trainer's auto_find_batch_size (on running out of memory, the loop again at 90 % of the
    micro-batch, the accumulation kept: another global batch), and over several ranks
    average_tokens_across_devices=False (each rank's own token count: another update, shown
    under torchrun by test_trainer_under_torchrun_is_exact_across_ranks_...): refused in one
    line naming the fix; on one rank the second changes nothing and is let be."""
    base = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    two_ranks = plan_of(8, 4)
    two_ranks.setup = LMSetup(SEQ, world_size=2)
    for extra, plan, why in [
        ({"world_size": 1, "auto_find_batch_size": True}, plan_of(8, 4),
         r"^these arguments set auto_find_batch_size=True, .*: set auto_find_batch_size=False "
         r"\(train_with_backoff halves the micro-batch and doubles the accumulation, the same "
         r"update\)$"),
        ({"world_size": 2, "average_tokens_across_devices": False}, two_ranks,
         r"^these arguments set average_tokens_across_devices=False over 2 ranks: .*: set "
         r"average_tokens_across_devices=True \(Trainer's default\)$"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            with_plan(SimpleNamespace(**base, **extra), plan)
    one_rank = SimpleNamespace(**base, world_size=1, average_tokens_across_devices=False)
    assert with_plan(one_rank, plan_of(8, 4)).per_device_train_batch_size == 4
    allowed = SimpleNamespace(**base, world_size=2, average_tokens_across_devices=True,
                              auto_find_batch_size=False)  # fmt: skip
    assert with_plan(allowed, two_ranks).gradient_accumulation_steps == 1


def test_a_plan_of_trls_fused_lm_head_holds_for_sft_trainers_own_loss_alone(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch
) -> None:
    """A plan with --loss trl traced SFTTrainer's fused LM head, never the whole logits: given
    Trainer's arguments (whose loss is the model's own, over the whole logits), SFTConfig's
    label smoothing where the plan has none (SFTTrainer then takes the whole logits), or a TRL
    without that head, with_plan refuses it in one line; SFTConfig as it comes takes it, and
    its smoothing where the plan traced it."""
    import bigbatch.memory.lm_setup as lm_module

    trl = pytest.importorskip("trl")
    plan = plan_of(8, 4)
    plan.setup = LMSetup(SEQ, loss="trl")
    args = SimpleNamespace(world_size=1, per_device_train_batch_size=1,
                           gradient_accumulation_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"^the plan traces TRL's fused LM head .* these are "
                       r"SimpleNamespace, .*: plan with --loss model, or train with TRL's "
                       r"SFTTrainer$"):  # fmt: skip
        with_plan(args, plan)
    sft = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "max_length": SEQ,
           "report_to": []}  # fmt: skip
    assert with_plan(trl.SFTConfig(**sft), plan).per_device_train_batch_size == 4
    with pytest.raises(ValueError, match=r"^these arguments smooth the labels \(label_smoothing_"
                                         r"factor=0.1\) and the plan does not: .*: plan with "
                                         r"--label-smoothing 0.1$"):  # fmt: skip
        with_plan(trl.SFTConfig(**sft, label_smoothing_factor=0.1), plan)
    # SFTTrainer smooths only its default loss (loss_type="nll"); planned with it, taken.
    with_plan(trl.SFTConfig(**sft, label_smoothing_factor=0.1, loss_type="dft"), plan)
    smoothed = SimpleNamespace(**{**vars(plan), "setup": LMSetup(SEQ, loss="trl",
                                                                 label_smoothing=0.1)})  # fmt: skip
    with_plan(trl.SFTConfig(**sft, label_smoothing_factor=0.1), smoothed)
    # Where the TRL that trains has no fused head (older than the planning machine's).
    monkeypatch.setattr(lm_module, "_fused_lm_head", lambda: None)
    with pytest.raises(ValueError, match=r"^--loss trl plans TRL's fused LM head, and TRL .* "
                                         r"over the whole logits: plan with --loss model"):  # fmt: skip
        with_plan(trl.SFTConfig(**sft), plan)


@pytest.mark.slow
def test_trainers_label_smoothing_set_from_a_plan_of_it_is_exact(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Trainer's LabelSmoother divides by the window's token count (transformers >= 5.15):
    under a plan with --label-smoothing the accumulated updates are the big batch's (AdamW
    with weight decay over three steps, every adapter tensor compared, the frozen base left
    without gradients and as it was); each micro-batch's mean divided by the accumulation (the
    smoother of older transformers), the negative control, is not. Arguments that smooth under
    a plan that did not, or the other way round, are refused in one line."""
    init, data = tiny_lora(), sequences()
    want = big_batch_adamw(copy.deepcopy(init), data, steps=3, smoothing=0.1)
    adamw = {"optim": "adamw_torch", "weight_decay": 0.1, "learning_rate": LR / 50,
             "num_train_epochs": 3, "label_smoothing_factor": 0.1}  # fmt: skip
    plan = plan_of(N, 5)
    with pytest.raises(ValueError, match=r"^these arguments smooth the labels .*: plan with "
                                         r"--label-smoothing 0.1$"):  # fmt: skip
        with_plan(trained(tmp_path, 12, 1, label_smoothing_factor=0.1), plan)
    plan.setup = LMSetup(SEQ, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"^the plan traces label smoothing \(0.1\) and these "
                                         r"arguments do not smooth: set label_smoothing_factor="
                                         r"0.1 .*, or plan without --label-smoothing$"):  # fmt: skip
        with_plan(trained(tmp_path, 12, 1), plan)
    args = with_plan(trained(tmp_path, 12, 1, **adamw), plan)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 3)

    def run(per_micro_batch_mean: bool = False):  # type: ignore[no-untyped-def]
        model = copy.deepcopy(init)
        trainer = trainer_for(model, data)(args)
        if per_micro_batch_mean:
            smoother = trainer.label_smoother

            def mean(outputs, labels, shift_labels=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
                return smoother(outputs, labels, shift_labels=shift_labels)

            trainer.label_smoother, trainer.model_accepts_loss_kwargs = mean, False
        trainer.train()
        return model

    got = run()
    assert update_err(got, want, init) < 1e-12
    for g, i in zip(got.parameters(), init.parameters(), strict=True):
        if not i.requires_grad:
            assert g.grad is None and torch.equal(g, i)
    assert update_err(run(per_micro_batch_mean=True), want, init) > 0.02
    # transformers before 5.15: the smoother divides each micro-batch by its own token count,
    # which no setting makes exact: refused; the step is still planned.
    from transformers.trainer_pt_utils import LabelSmoother

    import bigbatch.memory.lm_model as lm_module

    current = LabelSmoother.__call__

    def older(self, model_output, labels, shift_labels=False):  # type: ignore[no-untyped-def]
        return current(self, model_output, labels, shift_labels=shift_labels)

    monkeypatch.setattr(LabelSmoother, "__call__", older)
    with pytest.raises(ValueError, match=r"^these arguments smooth the labels \(label_smoothing_"
                                         r"factor=0.1\), and the LabelSmoother of transformers "
                                         r".* divides each micro-batch by its own token count, .*"
                                         r": pip install 'transformers>=5.15', or set "
                                         r"label_smoothing_factor=0$"):  # fmt: skip
        with_plan(trained(tmp_path, 12, 1, label_smoothing_factor=0.1), plan)
    lm_module._smoothed_step(copy.deepcopy(init), collate(data[:2])).backward()


@pytest.mark.slow
def test_a_label_smoothing_plan_allocates_what_trainer_and_sft_trainer_do(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With label_smoothing_factor Trainer takes the logits without the model's loss, handed
    back in float32 by accelerate, and smooths them outside autocast; SFTTrainer does the same,
    then runs its fused head without gradients for its metrics. A plan's step (--label-smoothing,
    with --loss trl for SFTTrainer) allocates what theirs does, to 1 % (on a CPU, under
    accelerate's bf16 autocast), as the plan of the model's own loss does for Trainer without
    smoothing; that plan is short of a smoothing Trainer's by more than 10 %."""
    config = transformers.LlamaConfig(
        vocab_size=8000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip

    def spec(**setup: Any) -> Any:
        return lm_spec_at(config, LMSetup(seq_len=128, **setup), device="cpu", precision="bf16")(2)

    plain = spec()
    spec_of = {"plain": plain, "model": spec(label_smoothing=0.1)}
    if hasattr(pytest.importorskip("trl.trainer.utils"), "add_fused_lm_head"):
        spec_of["trl"] = spec(loss="trl", label_smoothing=0.1)
    batch = make_inputs(spec_of["model"], "cpu")

    def peak(step) -> int:  # type: ignore[no-untyped-def]
        step()  # allocations made once (the first call's) are left out
        return profiled_peak(step)

    def planned(spec) -> int:  # type: ignore[no-untyped-def]
        model = spec.model()
        return peak(lambda: run_step_loss(spec, model, batch, "cpu").backward())

    def theirs(trainer) -> int:  # type: ignore[no-untyped-def]
        model = trainer.accelerator.prepare(trainer.model)
        tokens = (batch["labels"][..., 1:] != -100).sum()
        return peak(lambda: trainer.compute_loss(model, dict(batch), num_items_in_batch=tokens)
                    .backward())  # fmt: skip

    settings = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": True, "report_to": [],
                "label_smoothing_factor": 0.1}  # fmt: skip
    torch.manual_seed(0)
    trainer = transformers.Trainer(
        model=plain.model(), args=transformers.TrainingArguments(**settings)
    )
    measured = {"model": theirs(trainer)}
    unsmoothed = {**settings, "label_smoothing_factor": 0.0}  # the model's own loss
    trainer = transformers.Trainer(
        model=plain.model(), args=transformers.TrainingArguments(**unsmoothed)
    )
    measured["plain"] = theirs(trainer)
    if "trl" in spec_of:
        trl, datasets = pytest.importorskip("trl"), pytest.importorskip("datasets")
        data = datasets.Dataset.from_list([{"input_ids": [1, 2, 3]}])
        with warnings.catch_warnings():  # TRL's deprecation of label smoothing
            warnings.simplefilter("ignore", FutureWarning)
            sft = trl.SFTTrainer(model=plain.model(), args=trl.SFTConfig(**settings, max_length=None),
                                 train_dataset=data, processing_class=tokenizer())  # fmt: skip
            measured["trl"] = theirs(sft)
    predicted = {loss: planned(spec_of[loss]) for loss in measured}
    for loss, real in measured.items():
        assert abs(predicted[loss] - real) <= 0.01 * real, (loss, predicted[loss], real)
    assert predicted["plain"] < 0.9 * measured["model"]  # the plan without smoothing, for it


def test_with_plan_turns_checkpointing_on_as_the_plan_traced_it() -> None:
    """A plan that counts on checkpointing: transformers 5's activation_checkpointing; before
    it, gradient_checkpointing, non-reentrant as the plan traced it (the old default was
    reentrant) unless the arguments chose; arguments with it on already are left alone."""
    plan = plan_of(8, 4)
    plan.setup = LMSetup(SEQ, gradient_checkpointing=True)

    def args(**more: object) -> SimpleNamespace:
        return SimpleNamespace(
            world_size=1, per_device_train_batch_size=1, gradient_accumulation_steps=1, **more
        )

    assert with_plan(args(activation_checkpointing=False), plan).activation_checkpointing
    # Arguments of transformers 4, which has gradient_checkpointing alone.
    on = with_plan(args(gradient_checkpointing=False, gradient_checkpointing_kwargs=None), plan)
    assert on.gradient_checkpointing and on.gradient_checkpointing_kwargs == {
        "use_reentrant": False
    }
    chosen = {"use_reentrant": True}
    kept = with_plan(args(gradient_checkpointing=False, gradient_checkpointing_kwargs=chosen), plan)
    assert kept.gradient_checkpointing_kwargs is chosen


def tokenizer():  # type: ignore[no-untyped-def]
    """A word-level tokenizer of the vocabulary's ids, built here (no download); 0 pads."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    fast = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=fast, pad_token="t0", eos_token=f"t{VOCAB - 1}"
    )


@pytest.mark.slow
def test_sft_trainer_set_from_a_plan_is_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Padded and packed (``padding_free``). TRL computes the token log-probabilities in float32
    (its fused head), so its own big batch is off the float64 one by float32's round-off: the
    accumulated runs are judged against that."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    init, items = tiny_lora(), sequences()
    want = big_batch(copy.deepcopy(init), items)
    data = datasets.Dataset.from_list([{"input_ids": i["input_ids"].tolist()} for i in items])
    config = trl.SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=N, num_train_epochs=1,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, max_length=SEQ, bf16=False,
    )  # fmt: skip

    def run(args, per_micro_batch_mean: bool = False):  # type: ignore[no-untyped-def]
        model = copy.deepcopy(init)
        trainer = trl.SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer()
        )
        trainer.model_accepts_loss_kwargs = not per_micro_batch_mean
        trainer.train()
        return model

    round_off = update_err(run(config), want, init)  # one micro-batch of 12: TRL's big batch
    assert round_off < 1e-5
    planned = with_plan(config, plan_of(N, 5))
    assert (planned.per_device_train_batch_size, planned.gradient_accumulation_steps) == (4, 3)
    assert update_err(run(planned), want, init) < 10 * round_off
    assert update_err(run(planned, per_micro_batch_mean=True), want, init) > 0.02
    # Packed: each micro-batch's sequences in one row (position_ids restart, the first label of
    # each sequence ignored), against the same padded big batch.
    packed = dataclasses.replace(planned, padding_free=True, max_length=None)  # as TRL wants
    assert update_err(run(packed), want, init) < 10 * round_off
    assert update_err(run(packed, per_micro_batch_mean=True), want, init) > 0.02


def test_verify_trainer_names_a_configs_dropout_drawn_outside_dropout_modules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Llama's attention dropout is drawn in its attention function, no module to find: the
    big batch under another seed shows the step draws, and the explanation names the config's
    setting."""
    config = tiny_config()
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    trainer = trainer_for(model, sequences())(trained(tmp_path, micro=4, steps=3))
    result = verify_trainer(trainer)
    assert not result.passed
    assert result.explanation.startswith("The big batch differs from itself by ")
    assert "draws random numbers outside dropout modules" in result.explanation
    assert "the config sets attention_dropout=0.1)" in result.explanation


@pytest.mark.slow
def test_verify_trainer_on_sft_trainer_with_peft_padded_and_packed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SFTTrainer (its own loss and collator) over a float64 LoRA model, padded and packed: its
    fused LM head sums its tiles' products in float32 (packed, the window is 4e-8 from the big
    batch), so the window of 4 + 4 + 2 sequences is judged at float32's round-off and passes;
    each micro-batch's mean (the model given no count) fails the same check."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list([{"input_ids": i["input_ids"].tolist()} for i in sequences()])
    config = trl.SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3,
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, max_length=SEQ,
        bf16=False,
    )  # fmt: skip
    for args in (config, dataclasses.replace(config, padding_free=True, max_length=None)):
        trainer = trl.SFTTrainer(
            model=tiny_lora(), args=args, train_dataset=data, processing_class=tokenizer()
        )
        result = verify_trainer(trainer, micro_batches=[4, 4, 2])
        assert result.passed and result.case == "SFTTrainer", result
        assert result.dtype == "float32" and len(result.micro_batch_counts) == 3
        trainer.model_accepts_loss_kwargs = False
        mean = verify_trainer(trainer, micro_batches=[4, 4, 2])
        assert not mean.passed and mean.max_rel > 100 * mean.tolerance


@pytest.mark.slow
def test_trainer_under_torchrun_is_exact_across_ranks_and_one_ranks_oom_restarts_all(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    """Two CPU ranks (gloo), set from a plan for 2 ranks: Trainer counts the window's tokens over
    both ranks; the update equals one process's big batch over all 12 sequences, and with each
    rank's own count (average_tokens_across_devices=False, which with_plan refuses) it does
    not. (FSDP2 under
    Trainer needs accelerators: accelerate applies it on GPUs only.) When one rank alone runs
    out of memory, the others cannot be told in a collective: it leaves the halved sizes in the
    output folder and raises, torchrun restarts both, and three AdamW steps at 1 x 6 equal three
    big-batch steps; every run leaves the frozen base without a gradient, its weights as they
    were."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "hf_ranks_script.py"
    root = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root / 'src'}:{root / 'tests'}", OMP_NUM_THREADS="1")
    # Without it a restarted rank may read the first attempt's gloo addresses from the store
    # torchrun shares (pytorch/pytorch#135712): 6 restarts of 8 failed to connect here.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(script), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {
        n: torch.load(tmp_path / f"{n}.pt", weights_only=True)
        for n in ("planned", "mean", "local_tokens", "oom")
    }
    init, data = tiny_lora(), sequences()
    want = big_batch(copy.deepcopy(init), data)
    want_adamw = big_batch_adamw(copy.deepcopy(init), data, steps=3)

    def err(got: dict, want=want) -> float:  # type: ignore[no-untyped-def, type-arg]
        ref = {n.split("base_model.", 1)[-1]: p for n, p in want.named_parameters()}
        start = {n.split("base_model.", 1)[-1]: p for n, p in init.named_parameters()}
        num = max(float((got[n] - ref[n].detach()).abs().max()) for n in got)
        return num / max(float((ref[n] - start[n]).detach().abs().max()) for n in got)

    assert err(runs["planned"]["adapters"]) < 1e-12
    assert err(runs["mean"]["adapters"]) > 0.02
    # Each rank's own token count (average_tokens_across_devices=False): 1.5 % off.
    assert err(runs["local_tokens"]["adapters"]) > 1e-3
    assert runs["oom"]["restarts"] == 1 and err(runs["oom"]["adapters"], want_adamw) < 1e-12
    assert all(run["frozen_kept"] for run in runs.values())
    assert "out of memory at micro-batch 2 on rank 1 of 2" in done.stdout
    said = "resuming at 1 x 6 accumulation, the same global batch: a rank ran out of memory at "
    assert done.stdout.count(said + "micro-batch 2") == 2  # both ranks, from the file
    assert not (tmp_path / "oom" / "bigbatch-sizes.json").exists()  # spent: the run is done


def test_bf16_on_a_card_without_bfloat16_units_is_said_when_training_begins(
    monkeypatch, caplog
) -> None:  # type: ignore[no-untyped-def]
    """Trainer runs bf16=True on a T4 (torch says it supports bf16, by emulation): several
    times slower than fp16. MemoryBudget says so when training begins (simulated: no GPU in
    CI); fp16, or a card with bfloat16 units, says nothing."""
    import logging
    from types import SimpleNamespace

    import bigbatch.device

    budget = MemoryBudget(2**40)
    for bf16, emulated, said in [(True, True, 1), (False, True, 0), (True, False, 0)]:
        monkeypatch.setattr(bigbatch.device, "emulates_bf16", lambda device, e=emulated: e)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bigbatch"):
            args = SimpleNamespace(device=torch.device("cpu"), bf16=bf16)
            budget.on_train_begin(args, None, None)
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == said
        if said:
            assert warned[0].startswith("bf16=True on cpu, which has no bfloat16 units")
            assert "fp16=True (a plan with --precision fp16)" in warned[0]


def test_arguments_that_place_memory_otherwise_than_the_plan_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed's partitions, FSDP's shards on the host, activations on the host (TRL's
    activation_offloading, or checkpointed ones) and checkpointing only every n-th layer:
    Trainer would run each without a word under a
    plan that traced none of them (the last holds more than the plan's micro-batch fits).
    Each is refused in one line naming the fix, by with_plan and by MemoryBudget's check."""

    def plan(**setup: Any) -> SimpleNamespace:
        return SimpleNamespace(global_batch=8, setup=LMSetup(SEQ, **setup),
                               plan=SimpleNamespace(max_micro_batch=4))  # fmt: skip

    base = {"world_size": 1, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    every_2nd = {"every_n_layers": 2}
    for extra, why in [
        ({"deepspeed": "ds_zero3.json"}, r"^this run trains with DeepSpeed, .* config\)$"),
        ({"fsdp": "full_shard offload"}, r"offload FSDP's shards to the CPU .*: drop the offload$"),
        ({"fsdp": True, "fsdp_config": {"cpu_offload": True}}, r"FSDP's shards to the CPU"),
        ({"activation_checkpointing_kwargs": {"offload": True}}, r"activations to the host"),
        ({"activation_offloading": True},
         r"^these arguments offload the activations to the CPU \(SFTConfig activation_offloading"
         r"=True\), .*: drop activation_offloading$"),
        ({"activation_checkpointing_kwargs": every_2nd},
         r"^the plan checkpoints every decoder layer and these arguments one in 2 .*"
         r"drop every_n_layers$"),
        ({"gradient_checkpointing_kwargs": json.dumps(every_2nd)}, r"every_n_layers=2"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=why) as raised:
            with_plan(SimpleNamespace(**base, **extra), plan(gradient_checkpointing=True))
        assert "\n" not in str(raised.value)
    # Without checkpointing in the plan, checkpointing some layers holds less; settings of
    # what does not run (an offload without checkpointing, FSDP's config without FSDP) hold
    # nothing: let be.
    for extra in (
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": every_2nd},
        {"activation_checkpointing_kwargs": {"offload": True}},
        {"fsdp_config": {"cpu_offload": True}},
    ):
        assert with_plan(SimpleNamespace(**base, **extra), plan()).per_device_train_batch_size == 4
    # Trainer's own arguments, as a user writes them.
    args = trained(tmp_path, 1, 1, activation_checkpointing=True,
                   activation_checkpointing_kwargs=every_2nd)  # fmt: skip
    with pytest.raises(ValueError, match="every_n_layers=2"):
        with_plan(args, plan(gradient_checkpointing=True))


@pytest.mark.slow
def test_a_model_checkpointing_only_every_nth_layer_is_refused_under_a_plan_of_each() -> None:
    """transformers' ``every_n_layers`` keeps the other decoder layers' activations, which the
    plan's micro-batch does not fit: MemoryBudget's check refuses the model in one line, and
    takes the same model checkpointing every layer."""
    config = tiny_config()
    config.num_hidden_layers = 2
    setup = LMSetup(SEQ, lora_r=4, gradient_checkpointing=True)
    plan = plan_lm(config, setup, N, "1GB", device="cpu", precision="fp32", optimizer="sgd",
                   overhead=0)  # fmt: skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
    model.activation_checkpointing_enable(every_n_layers=2)
    with pytest.raises(ValueError, match=r"this model 1 of its 2 without \(every_n_layers\)"):
        check_plan_matches(plan, model)
    model.activation_checkpointing_enable()
    check_plan_matches(plan, model)


def test_accelerate_launchs_fsdp_and_deepspeed_are_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``accelerate launch`` with an FSDP config reaches Trainer through the environment, not
    the arguments: an FSDP2 plan is taken there (it was refused as DDP), and its version 1
    (accelerate's default), weights kept gathered, offloaded shards, or DeepSpeed named
    there are refused in one line naming the setting to change."""

    def plan(**setup: Any) -> SimpleNamespace:
        return SimpleNamespace(global_batch=8, setup=LMSetup(SEQ, world_size=2, **setup),
                               plan=SimpleNamespace(max_micro_batch=4))  # fmt: skip

    args = SimpleNamespace(world_size=2, per_device_train_batch_size=1,
                           gradient_accumulation_steps=1)  # fmt: skip
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match=r"^the plan traced FSDP2 and accelerate launch's FSDP "
                       r"settings run FSDP version 1: set fsdp_version: 2 there$"):  # fmt: skip
        with_plan(args, plan(fsdp=True))
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert with_plan(args, plan(fsdp=True)).per_device_train_batch_size == 4
    with pytest.raises(ValueError, match=r"shard it with FSDP: plan with --fsdp, or launch "):
        with_plan(args, plan())
    for name, value, why in [
        ("FSDP_RESHARD_AFTER_FORWARD", "false", r"set fsdp_reshard_after_forward: true there$"),
        ("FSDP_OFFLOAD_PARAMS", "true", r"^accelerate launch's FSDP settings offload FSDP's"),
        ("ACCELERATE_USE_DEEPSPEED", "true", r"^this run trains with DeepSpeed, "),
    ]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(ValueError, match=why):
                with_plan(args, plan(fsdp=True))
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with pytest.raises(ValueError, match=r"DeepSpeed, whose ZeRO partitions"):
        with_plan(SimpleNamespace(**vars(args), deepspeed_plugin=object()), plan())
