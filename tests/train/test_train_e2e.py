"""train -> predict with TTA -> ensemble -> submission, on tiny generated folders; resume; bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import bigbatch
import bigbatch.train.run_dir as run_dir
import bigbatch.train.stepping as stepping
from bigbatch.cli.main import main
from bigbatch.train.config import ConfigError, load_config
from bigbatch.train.ensemble import run_ensemble
from bigbatch.train.loop import train
from bigbatch.train.tasks.classification.predict import (
    load_predictions,
    predict_folder,
    save_predictions,
)
from tiny_runs import base_overrides, write_images


def quiet(_: str) -> None:
    pass


@pytest.mark.slow
def test_train_writes_the_run_folder(image_folder: Path, tiny_model: str, tmp_path: Path) -> None:
    cfg = load_config(overrides=base_overrides(image_folder, tiny_model))
    lines: list[str] = []
    result = train(cfg, tmp_path / "run", log=lines.append)
    run = tmp_path / "run"
    # train.log: every line the run said, each after the time it was said.
    kept = (run / "train.log").read_text().splitlines()
    assert kept[0].split(" ", 2)[2].startswith(f"bigbatch {bigbatch.__version__}, torch ")
    assert [line.split(" ", 2)[2] for line in kept[1:]] == lines
    assert lines[0].startswith("device: cpu") and len(lines) > 2
    assert oct((run / "train.log").stat().st_mode & 0o777) == "0o644"
    for name in (
        "best.safetensors",
        "last.safetensors",
        "last.pt",
        "history.csv",
        "history.png",
        "plan.json",
        "config.json",
        "done.json",
    ):
        assert (run / name).is_file(), name
    assert len(result.history) == 2
    assert result.history[-1]["optimizer_steps"] == 2 * 2  # 24 training images / batch 12
    assert (run / "history.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((run / "plan.json").read_text())["micro_batch"] == 4


@pytest.mark.slow
def test_timm_model_and_planner(image_folder: Path, tmp_path: Path) -> None:
    cfg = load_config(
        overrides=[
            f"data={image_folder}",
            "arch=resnet10t",
            "size=32",
            "batch=12",
            "epochs=1",
            "mode=fine_tune",
            "freeze_epochs=1",
            "budget=4GiB",
            "device=cpu",
            "num_workers=0",
        ]
    )
    lines: list[str] = []
    result = train(cfg, tmp_path / "run", log=lines.append)
    assert any(line.startswith("plan: target batch 12") for line in lines)
    assert [r["phase"] for r in result.history] == ["frozen", "unfrozen"]


def test_predict_with_tta_and_files(image_folder: Path, tiny_model: str, tmp_path: Path) -> None:
    train(
        load_config(overrides=base_overrides(image_folder, tiny_model)), tmp_path / "run", log=quiet
    )
    write_images(tmp_path / "test", n_per_class=2, seed=5)
    pred = predict_folder(tmp_path / "run", tmp_path / "test", tta=3)
    assert pred.probs.shape == (6, 3)
    np.testing.assert_allclose(pred.probs.sum(axis=1), 1.0, rtol=1e-6)
    npz, csv_path = save_predictions(pred, tmp_path / "out" / "preds")
    again = load_predictions(npz)  # allow_pickle=False
    np.testing.assert_array_equal(again.probs, pred.probs)
    assert csv_path.read_text().splitlines()[0] == "file,label,confidence"
    one = predict_folder(tmp_path / "run", tmp_path / "test", tta=1)
    assert not np.allclose(one.probs, pred.probs)  # the flip and crops changed the average
    # Forward passes as its validation ran them: in the run's autocast (bf16 here, on the
    # CPU); a run trained in fp16 on a GPU, predicted on a CPU, computes in fp32 there.
    saved = tmp_path / "run" / "config.json"
    fp32 = json.loads(saved.read_text())
    for precision in ("bf16", "fp16"):
        saved.write_text(json.dumps(fp32 | {"precision": precision}))
        again = predict_folder(tmp_path / "run", tmp_path / "test", tta=1, device="cpu")
        if precision == "bf16":
            assert 0 < np.abs(again.probs - one.probs).max() < 0.05  # bfloat16's round-off
        else:
            np.testing.assert_array_equal(again.probs, one.probs)


def _unread(path: object) -> object:
    raise AssertionError(f"{path} was read")


@pytest.mark.slow
def test_resume_after_a_kill_gives_the_same_weights(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = [*base_overrides(image_folder, tiny_model), "epochs=3"]
    train(load_config(overrides=overrides), tmp_path / "full", log=quiet)

    calls = {"n": 0}
    real_run_window = stepping.run_window

    def killed(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 4:  # the second window of epoch 2
            raise KeyboardInterrupt
        return real_run_window(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stepping, "run_window", killed)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(overrides=overrides), tmp_path / "killed", log=quiet)
    monkeypatch.setattr(stepping, "run_window", real_run_window)
    assert not (tmp_path / "killed" / "done.json").exists()
    said = (tmp_path / "killed" / "train.log").read_text()
    assert said.endswith(" interrupted (Ctrl-C); finished epochs are kept for --resume\n")
    lines: list[str] = []
    result = train(
        load_config(overrides=overrides), tmp_path / "killed", resume=True, log=lines.append
    )
    assert any("resuming" in line and "after epoch 1" in line for line in lines)
    resumed_log = (tmp_path / "killed" / "train.log").read_text()
    assert resumed_log.startswith(said) and "resuming" in resumed_log[len(said) :]
    # Resumed again, finished: said at once, the same result, nothing planned or trained.
    lines.clear()
    again = train(
        load_config(overrides=overrides), tmp_path / "killed", resume=True, log=lines.append
    )
    assert lines == [f"{tmp_path / 'killed'} finished earlier (3 epoch(s), best valid_loss "
                     f"{result.best_metric:.4f}): nothing to resume"]  # fmt: skip
    assert again.history == result.history and again.best_metric == result.best_metric
    assert (tmp_path / "killed" / "train.log").read_text() == resumed_log
    # The history is in done.json: a finished run's rerun reads no checkpoint (a large model's
    # takes seconds); a done.json of bigbatch 0.1, without it, is read with last.pt's.
    done = tmp_path / "killed" / "done.json"
    summary = json.loads(done.read_text())
    assert summary["history"] == result.history and summary["epochs"] == 3
    real_load_state = run_dir.load_state
    monkeypatch.setattr(run_dir, "load_state", _unread)
    kept = train(load_config(overrides=overrides), tmp_path / "killed", resume=True, log=quiet)
    assert kept.history == result.history
    monkeypatch.setattr(run_dir, "load_state", real_load_state)
    done.write_text(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    again = train(load_config(overrides=overrides), tmp_path / "killed", resume=True, log=quiet)
    assert again.history == result.history
    done.write_text(json.dumps(summary | {"history": "3 epochs"}))
    with pytest.raises(ConfigError, match=r"done.json is not one bigbatch wrote \(its history"):
        train(load_config(overrides=overrides), tmp_path / "killed", resume=True, log=quiet)
    (tmp_path / "killed" / "done.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"done.json is not one bigbatch wrote .*: delete"):
        train(load_config(overrides=overrides), tmp_path / "killed", resume=True, log=quiet)
    assert [r["epoch"] for r in result.history] == [1, 2, 3]  # epoch 1 not redone
    full = load_file(tmp_path / "full" / "last.safetensors")
    resumed = load_file(tmp_path / "killed" / "last.safetensors")
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def test_run_folder_with_another_config_is_refused(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    train(
        load_config(overrides=base_overrides(image_folder, tiny_model)), tmp_path / "run", log=quiet
    )
    said = (tmp_path / "run" / "train.log").read_text()
    with pytest.raises(ConfigError, match=r"different config \(lr: 0.01 -> 0.5\)"):
        train(
            load_config(overrides=[*base_overrides(image_folder, tiny_model), "lr=0.5"]),
            tmp_path / "run",
            log=quiet,
        )
    with pytest.raises(ConfigError, match="--resume"):
        train(
            load_config(overrides=base_overrides(image_folder, tiny_model)),
            tmp_path / "run",
            log=quiet,
        )
    assert (tmp_path / "run" / "train.log").read_text() == said  # refused: the run's log kept


def test_model_that_cannot_take_the_size_fails_before_training(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    overrides = [*base_overrides(image_folder, "tinymodel:fixed_size"), "size=32"]
    with pytest.raises(ConfigError, match="cannot train on inputs of 3x32x32"):
        train(load_config(overrides=overrides), tmp_path / "run", log=quiet)
    assert not (tmp_path / "run" / "last.pt").exists()
    said = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert " error: " in said[-1] and "cannot train on inputs of 3x32x32" in said[-1]


def test_unknown_arch_suggests_names(image_folder: Path, tmp_path: Path) -> None:
    cfg = load_config(overrides=[f"data={image_folder}", "arch=resnet19", "num_workers=0"])
    with pytest.raises(ConfigError, match="did you mean resnet18"):
        train(cfg, tmp_path / "run", log=quiet)


@pytest.mark.slow
def test_ensemble_submission_and_skip_on_rerun(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    write_images(tmp_path / "test", n_per_class=2, seed=7)
    names = sorted(p.name for p in (tmp_path / "test").rglob("*.png"))
    (tmp_path / "sample_submission.csv").write_text(
        "image_id,label\n" + "\n".join(f"{n},x" for n in names) + "\n"
    )
    common = "\n".join(
        f"{key} = {value if value.replace('.', '').isdigit() else repr(value)}"
        for key, value in (o.split("=", 1) for o in base_overrides(image_folder, tiny_model))
    )
    (tmp_path / "exp.toml").write_text(
        f"[common]\n{common}\n\n"
        '[ensemble]\ntest = "test"\nsample_submission = "sample_submission.csv"\ntta = 2\n\n'
        '[[member]]\nname = "a"\nweight = 1.0\n\n'
        '[[member]]\nname = "b"\nlr = 0.02\nweight = 0.5\n'
    )
    lines: list[str] = []
    result = run_ensemble(tmp_path / "exp.toml", tmp_path / "out", log=lines.append)
    assert [s["member"] for s in result.scores] == ["a", "b", "ensemble"]
    assert result.submission is not None
    rows = result.submission.read_text().splitlines()
    assert rows[0] == "image_id,label" and len(rows) == 7
    assert {r.split(",")[1] for r in rows[1:]} <= {"red", "green", "blue"}
    assert (tmp_path / "out" / "scores.csv").is_file()
    lines.clear()
    run_ensemble(tmp_path / "exp.toml", tmp_path / "out", log=lines.append)
    assert sum("finished earlier (2 epoch(s), best valid_loss" in line for line in lines) == 2
    assert not any(line.lstrip().startswith(("plan:", "epoch")) for line in lines)
    # An edited member is refused, not its earlier run's predictions used.
    edited = (tmp_path / "exp.toml").read_text().replace("lr = 0.02", "lr = 0.05")
    (tmp_path / "exp.toml").write_text(edited)
    with pytest.raises(ConfigError, match=r"different config \(lr: 0.02 -> 0.05\)"):
        run_ensemble(tmp_path / "exp.toml", tmp_path / "out", log=lines.append)


def test_cli_train_and_predict(
    image_folder: Path, tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert (
        main(
            ["train", *base_overrides(image_folder, tiny_model), "--out", str(out), "--no-progress"]
        )
        == 0
    )
    assert "run folder" in capsys.readouterr().out
    assert main(["predict", str(out), str(image_folder), "--tta", "2"]) == 0
    assert (out / "predictions.npz").is_file()
    assert (
        main(["train", *base_overrides(image_folder, tiny_model), "epochs=0", "--out", str(out)])
        == 2
    )
    assert "epochs must be >= 1" in capsys.readouterr().err
    assert main(["predict", str(tmp_path / "nothing"), str(image_folder)]) == 2
    assert "not a bigbatch run folder" in capsys.readouterr().err


@pytest.mark.slow
def test_freeze_bn_keeps_running_statistics(image_folder: Path, tmp_path: Path) -> None:
    overrides = [f"data={image_folder}", "arch=resnet10t", "size=32", "batch=12", "micro_batch=4"]
    overrides += ["epochs=1", "mode=fit", "device=cpu", "num_workers=0", "freeze_bn=true"]
    lines: list[str] = []
    train(load_config(overrides=overrides), tmp_path / "run", log=lines.append)
    assert not any("BatchNorm" in line for line in lines)  # frozen: nothing inexact to report
    weights = load_file(tmp_path / "run" / "last.safetensors")
    means = [v for k, v in weights.items() if k.endswith("running_mean")]
    assert means and all(torch.equal(m, torch.zeros_like(m)) for m in means)


def test_progress_bar_shows_rate_and_plan(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from rich.console import Console

    # A terminal console, so the bar really renders (tests' stderr is not a terminal).
    screen = io.StringIO()
    monkeypatch.setattr(
        "rich.progress.get_console", lambda: Console(file=screen, force_terminal=True, width=150)
    )
    cfg = load_config(overrides=base_overrides(image_folder, tiny_model))
    with_bar = train(cfg, tmp_path / "bar", log=quiet, progress=True)
    without = train(cfg, tmp_path / "plain", log=quiet, progress=False)
    shown = screen.getvalue()
    assert "samples/s" in shown and "4 x 3" in shown  # rate, micro-batch x accumulation
    assert "peak RSS" in shown
    assert [r["train_loss"] for r in with_bar.history] == [r["train_loss"] for r in without.history]


def test_without_matplotlib_there_is_no_plot_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import bigbatch.train.report as report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(report, "_SAID", False)
    rows = [{"epoch": 1, "train_loss": 1.0}]
    with caplog.at_level(logging.WARNING, logger="bigbatch"):
        report.plot_history(rows, tmp_path / "a.png")
        report.plot_history(rows, tmp_path / "b.png")
    assert not (tmp_path / "a.png").exists()
    assert [r.message for r in caplog.records].count(
        "bigbatch: no history.png without matplotlib: pip install 'bigbatch[plot]' "
        "(history.csv holds the same numbers)"
    ) == 1


def test_epoch_files_are_written_off_the_training_thread_as_the_epoch_left_them(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoints, history.csv and history.png are written on the writer's thread while
    the next epoch trains, from copies taken at the epoch's end: epoch 1's files, held back
    here until epoch 2 has trained, still hold epoch 1's weights."""
    import threading

    import bigbatch.train.loop as loop
    import bigbatch.train.state as state_module
    from bigbatch.train.checkpoint import load_state

    at_epoch_end: list[dict[str, torch.Tensor]] = []
    epoch_2_trained = threading.Event()
    real_state, real_write = state_module.checkpoint_state, loop.write_epoch_files

    def checkpoint_state(core: torch.nn.Module, *args: object, **kwargs: object) -> object:
        at_epoch_end.append({k: v.clone() for k, v in core.state_dict().items()})
        if len(at_epoch_end) == 2:
            epoch_2_trained.set()
        return real_state(core, *args, **kwargs)  # type: ignore[arg-type]

    written: list[tuple[str, dict[str, torch.Tensor]]] = []

    def write_epoch_files(run_dir: Path, *args: object) -> None:
        if not written:  # epoch 1's files wait until epoch 2 has changed the live weights
            assert epoch_2_trained.wait(timeout=600)
        real_write(run_dir, *args)  # type: ignore[arg-type]
        written.append((threading.current_thread().name, load_state(run_dir / "last.pt")["model"]))

    monkeypatch.setattr(state_module, "checkpoint_state", checkpoint_state)
    monkeypatch.setattr(loop, "write_epoch_files", write_epoch_files)
    cfg = load_config(overrides=base_overrides(image_folder, tiny_model))
    train(cfg, tmp_path / "run", log=lambda _: None, progress=False)
    assert [name.startswith("bigbatch-files") for name, _ in written] == [True, True]
    for (_, saved), live in zip(written, at_epoch_end, strict=True):
        assert all(torch.equal(saved[k], live[k]) for k in live)
    assert not all(torch.equal(at_epoch_end[0][k], at_epoch_end[1][k]) for k in at_epoch_end[0])
    assert len((tmp_path / "run" / "history.csv").read_text().splitlines()) == 3  # written whole


def test_the_saved_config_toml_trains_the_same_run_again(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    cfg = load_config(overrides=[*base_overrides(image_folder, tiny_model), "epochs=1"])
    train(cfg, tmp_path / "run", log=lambda _: None, progress=False)
    again = load_config(tmp_path / "run" / "config.toml")
    assert again == cfg


def test_train_log_keeps_an_unforeseen_error_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash that is no bad input keeps its traceback in train.log, for the bug report; a
    run that said nothing (refused before its first line) writes no log; and a full disk while
    the error is written raises the run's own error, not the log's."""
    import errno

    from bigbatch.train.run_dir import RunLog

    with pytest.raises(RuntimeError), RunLog(tmp_path, quiet):
        raise RuntimeError("refused early")
    assert not (tmp_path / "train.log").exists()
    with pytest.raises(RuntimeError), RunLog(tmp_path, quiet) as log:
        log("epoch 1: train loss 0.5")
        raise RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR")
    said = (tmp_path / "train.log").read_text()
    assert " error:\nTraceback (most recent call last):" in said
    assert said.rstrip().endswith("RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR")

    def full(self: RunLog, text: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    with pytest.raises(RuntimeError, match="the run's own"), RunLog(tmp_path, quiet) as log:
        log("epoch 2: train loss 0.4")
        monkeypatch.setattr(RunLog, "_append", full)
        raise RuntimeError("the run's own")
