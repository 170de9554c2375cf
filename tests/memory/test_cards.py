"""budget= a card's name: plan for a GPU you do not have (a Kaggle T4 from a laptop), its memory
as its driver reports it, its CUDA context kept out."""

from __future__ import annotations

import pytest
import torch

from bigbatch.cli.main import main
from bigbatch.memory.cards import CARDS, find_card
from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES
from bigbatch.memory.plan import DEFAULT_MARGIN, plan_under_budget, resolve_budget
from bigbatch.memory.step import StepSpec
from bigbatch.train.config import ConfigError, load_config

MiB = 2**20


@pytest.mark.parametrize("text", ["t4", "T4", "Kaggle T4", "kaggle_t4", "NVIDIA T4", "tesla-t4"])
def test_a_card_is_found_by_the_names_people_use(text: str) -> None:
    card = find_card(text)
    assert card is not None and card.key == "t4" and card.total_bytes == 15360 * MiB


def test_every_card_says_where_its_figures_come_from_and_names_are_unique() -> None:
    names = [n for c in CARDS for n in (c.key, *c.aliases)]
    assert len(names) == len(set(names))
    assert all(c.source and c.total_bytes > 8 * 2**30 for c in CARDS)
    assert {"t4", "p100", "l4", "a10g", "rtx3060", "rtx4090", "a100-40gb", "a100-80gb", "h100"} <= {
        c.key for c in CARDS
    }
    assert find_card("8GB") is None and find_card("auto") is None
    # Each its own compute capability: bf16 in hardware from Ampere (8.0), emulated before.
    assert all(c.compute_capability >= (6, 0) for c in CARDS)
    assert {c.key for c in CARDS if c.emulates_bf16} == {"t4", "p100", "v100-16gb", "v100-32gb"}
    assert [find_card(k).short_name for k in ("t4", "rtx4090", "h100")] == [
        "T4",
        "RTX 4090",
        "H100",
    ]  # type: ignore[union-attr]


def test_a_plan_for_a_card_keeps_its_context_out_of_its_memory() -> None:
    assert resolve_budget("t4", "cuda") == 15360 * MiB
    spec = lambda b: StepSpec(lambda: torch.nn.Linear(64, 10), (64,), b, device="cuda")  # noqa: E731
    plan = plan_under_budget(spec, 32, "t4", device="cuda")
    assert plan.budget_bytes == 15360 * MiB
    assert plan.usable_bytes == int(15360 * MiB * (1 - DEFAULT_MARGIN)) - CUDA_CONTEXT_BYTES


def test_a_card_on_the_cpu_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"is a GPU .* --device cuda"):
        resolve_budget("t4", "cpu")


def test_train_takes_a_card_and_refuses_a_name_that_is_none() -> None:
    assert load_config(overrides=["data=d", "budget=Kaggle T4"]).budget == "Kaggle T4"
    with pytest.raises(ConfigError, match=r"budget='t5' is no card's name .*--list-cards"):
        load_config(overrides=["data=d", "budget=t5"])


@pytest.mark.parametrize(
    ("text", "meant"),
    [("v100", "v100-16gb, v100-32gb"), ("H10", "h100"), ("rtx4080", "rtx3090, rtx4090")],
)
def test_a_name_close_to_cards_is_refused_naming_them_in_train_and_plan(
    text: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A V100 comes with 16 or 32 GB: the plan must not guess which.
    with pytest.raises(
        ConfigError, match=rf"budget='{text}' is no card's name .*did you mean {meant}"
    ):
        load_config(overrides=["data=d", f"budget={text}"])
    with pytest.raises(ValueError, match=f"did you mean {meant}"):
        resolve_budget(text, "cuda")
    argv = ["plan", "--hf", "gpt2", "--seq-len", "8", "--batch", "2", "--budget", text]
    assert main(argv) == 2  # before any config is looked for
    assert f"--budget '{text}' is no card's name" in capsys.readouterr().err
    # A size with a wrong unit keeps the size's own error.
    with pytest.raises(ValueError, match="cannot read the memory size '16 GX'"):
        resolve_budget("16 GX", "cuda")


@pytest.mark.slow
def test_the_command_plans_for_a_card_from_a_cpu_and_lists_the_cards(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--arch", "resnet10t", "--size", "64", "--batch", "32", "--budget", "t4"]
    assert main([*argv, "--device", "cuda", "--precision", "fp16"]) == 0
    out = capsys.readouterr()
    assert "card: NVIDIA T4 16 GB, 15.00 GiB" in out.err and "CUDA context 703 MiB" in out.err
    assert "budget 15.00 GiB on cuda" in out.out and "bfloat16" not in out.out
    # bf16 on a T4 is emulated: the plan holds, and says to train in fp16.
    assert main([*argv, "--device", "cuda", "--precision", "bf16"]) == 0
    out = capsys.readouterr()
    assert "note: the T4 (compute capability 7.5) has no bfloat16 units" in out.out
    assert out.out.rstrip().endswith("plan and train with --precision fp16")
    assert main(["plan", "--list-cards"]) == 0
    listed = capsys.readouterr().out
    assert "16-bit" in listed and "   fp16  t4, kaggle-t4" in listed
    assert all(c.name in listed and c.source in listed for c in CARDS)
