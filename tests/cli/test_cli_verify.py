"""`bigbatch verify` from the command line, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bigbatch.cli.main import main


def test_builtin_cases_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--json", "--dtype", "float64"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["method"] for r in rows} == {"bigbatch", "naive", "cached", "plain"}
    for r in rows:
        assert {"case", "method", "dtype", "max_abs", "max_rel", "passed"} <= set(r)
        exact = r["method"] in ("bigbatch", "cached") or r["case"] == "equal"
        assert r["passed"] == exact, r
    # The coupled losses: gradient caching exact, plain accumulation another objective.
    coupled = {(r["case"], r["method"]): r for r in rows if r["method"] in ("cached", "plain")}
    assert {c for c, _ in coupled} == {"info_nce", "supcon", "batch_dice"}
    for case in ("info_nce", "supcon", "batch_dice"):
        assert coupled[(case, "cached")]["max_rel"] <= 1e-12
        assert coupled[(case, "plain")]["max_rel"] > 1e-3


def test_table_explains_the_naive_failures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "EXACT" in out and "loss / N" in out


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mymodel.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def model():
                torch.manual_seed(0)
                return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

            def plain():
                torch.manual_seed(0)
                return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))

            def data():
                g = torch.Generator().manual_seed(0)
                return torch.randn(20, 5, generator=g), torch.randint(0, 2, (20,), generator=g)

            def broken():
                raise RuntimeError("cannot build the model")
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_user_model_exact(user_module: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "verify",
                "--model",
                "mymodel:plain",
                "--data",
                "mymodel:data",
                "--micro",
                "8,8,4",
                "--naive",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "EXACT" in out and "DIFFERS" in out  # bigbatch exact; the naive row differs


def test_user_model_with_batchnorm_fails_and_explains(
    user_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--model", "mymodel:model", "--data", "mymodel:data", "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert all(not r["passed"] and "BatchNorm" in r["explanation"] for r in rows)
    # --eval turns BatchNorm statistics off: exact again.
    assert main(["verify", "--model", "mymodel:model", "--data", "mymodel:data", "--eval"]) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model", "mymodel:broken", "--data", "mymodel:data"],
            "raised RuntimeError: cannot build",
        ),
        (["--model", "mymodel:nothere", "--data", "mymodel:data"], "has no 'nothere'"),
        (["--model", "nomodule:model", "--data", "mymodel:data"], "importing 'nomodule' failed"),
        (["--model", "mymodel:model"], "needs --data"),
        (["--model", "mymodel:model", "--data", "mymodel:data", "--micro", "8,8"], "add up to 16"),
        (["--dtype", "float8"], "unknown 'float8'"),
    ],
)
def test_bad_input_is_one_clear_line(
    user_module: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bigbatch", "verify", "--dtype", "float64", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert len(json.loads(out)) == 10 + 6  # 5 cases x bigbatch/naive, 3 coupled x cached/plain


@pytest.fixture
def trainer_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A script's Trainer: a model of one's own whose loss is its batch's mean, over 10 rows."""
    pytest.importorskip("transformers")
    (tmp_path / "mytrainer.py").write_text(
        textwrap.dedent(
            """
            import torch
            import transformers

            class Mean(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    torch.manual_seed(0)
                    self.fc = torch.nn.Linear(3, 1).double()

                def forward(self, x, labels=None):
                    pred = self.fc(x).squeeze(-1)
                    if labels is None:  # under compute_loss_func, which takes the labels
                        return {"pred": pred}
                    return {"pred": pred, "loss": ((pred - labels) ** 2).mean()}

            def _rows():
                g = torch.Generator().manual_seed(0)
                return [{"x": torch.randn(3, generator=g).double(),
                         "labels": torch.randn((), generator=g).double()} for _ in range(10)]

            def _trainer(**kwargs):
                args = transformers.TrainingArguments(
                    "out", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    use_cpu=True, report_to=[])
                return transformers.Trainer(Mean(), args, train_dataset=_rows(), **kwargs)

            def mean():
                return _trainer()

            def summed():  # the sum over the window's count: what compute_loss_func must return
                def loss(outputs, labels, num_items_in_batch):
                    return ((outputs["pred"] - labels) ** 2).sum() / num_items_in_batch
                return _trainer(compute_loss_func=loss)

            def model():
                return Mean()
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_a_trainer_of_ones_own_is_verified_and_explained(
    trainer_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trainer divides the mean by the accumulation: DIFFERS, explained, exit 1; a loss over the
    window's count: EXACT, exit 0, over the window --micro sets."""
    assert main(["verify", "--trainer", "mytrainer:mean", "--json"]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["method"], row["micro_batch_counts"], row["passed"]) == ("trainer", [3, 1], False)
    assert "loss / N" in row["explanation"]
    assert main(["verify", "--trainer", "mytrainer:summed", "--micro", "3,3,4"]) == 0
    out = capsys.readouterr().out
    assert "Trainer" in out and "3,3,4" in out and "EXACT" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer", "mytrainer:mean", "--dtype", "float32"], "--dtype: --trainer brings its"),
        (["--trainer", "mytrainer:mean", "--model", "mytrainer:model"], "two commands"),
        (["--trainer", "mytrainer:model"], "returned Mean, not a transformers Trainer"),
        (["--trainer", "mytrainer:mean", "--micro", "4"], "is no window to accumulate"),
        (["--trainer", "mytrainer:mean", "--micro", "8,8"], "holds 10 rows"),
    ],
)
def test_a_trainer_the_command_cannot_verify_is_one_clear_line(
    trainer_module: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
