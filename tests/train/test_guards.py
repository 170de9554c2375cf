"""Guards of a training run: nothing silent, nothing late (issue 8).

Each test drives the real `train()` on tiny generated folders, so the guard is shown where a
user meets it: BatchNorm and a lone last sample, a diverging loss, no validation set, a locked
run folder, a budget that cannot hold the fixed micro-batch or exceeds the machine, progress
lines without a terminal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bigbatch.io import lock_folder
from bigbatch.train.checkpoint import load_state
from bigbatch.train.config import ConfigError, load_config
from bigbatch.train.loop import train
from bigbatch.train.state import TrainingDiverged
from tiny_runs import base_overrides, write_images


def quiet(_: str) -> None:
    pass


def _bn_model(tiny_model: str) -> str:
    return tiny_model.replace(":tiny", ":with_bn")


def test_batchnorm_cannot_train_on_a_lone_sample(tiny_model: str) -> None:
    """The failure the guard below prevents: a 1-sample micro-batch through BatchNorm1d."""
    import importlib

    model = importlib.import_module("tinymodel").with_bn(3).train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        model(torch.randn(1, 3, 16, 16))


@pytest.mark.parametrize("micro_batch", [4, 16])
def test_batchnorm_last_window_of_one_sample_joins_the_window_before(
    tiny_model: str, tmp_path: Path, micro_batch: int
) -> None:
    """33 training images in windows of 16 used to leave a last window of 1 that crashed at
    the end of epoch 1, every rerun alike. Now it joins the window before (17 samples), which
    is split so that no micro-batch holds one sample (4: 4,4,3,3,3; 16: 9,8)."""
    write_images(tmp_path / "train", n_per_class=11)
    write_images(tmp_path / "valid", n_per_class=2, seed=1)
    overrides = [
        *base_overrides(tmp_path / "train", _bn_model(tiny_model)),
        f"valid={tmp_path / 'valid'}",
        "batch=16",
        f"micro_batch={micro_batch}",
    ]
    lines: list[str] = []
    result = train(load_config(overrides=overrides), tmp_path / "run", log=lines.append)
    assert any("leave 1 for the last window" in line and "17 samples" in line for line in lines)
    assert result.history[-1]["optimizer_steps"] == 2 * 2  # 2 windows per epoch, not 3
    assert (tmp_path / "run" / "done.json").is_file()


def test_batchnorm_needs_two_samples(tiny_model: str, tmp_path: Path) -> None:
    write_images(tmp_path / "train", n_per_class=1)
    write_images(tmp_path / "valid", n_per_class=1, seed=1)
    base = [
        *base_overrides(tmp_path / "train", _bn_model(tiny_model)),
        f"valid={tmp_path / 'valid'}",
    ]
    with pytest.raises(ConfigError, match=r"BatchNorm cannot train on micro-batch 1.*micro_batch"):
        train(load_config(overrides=[*base, "micro_batch=1"]), tmp_path / "a", log=quiet)
    for folder in ("green", "blue"):  # one training image left
        (tmp_path / "train" / folder / f"{folder}_0.png").unlink()
        (tmp_path / "train" / folder).rmdir()
        (tmp_path / "valid" / folder / f"{folder}_0.png").unlink()
        (tmp_path / "valid" / folder).rmdir()
    with pytest.raises(ConfigError, match="at least 2 per window"):
        train(load_config(overrides=[*base, "micro_batch=2"]), tmp_path / "b", log=quiet)


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    model = tiny_model.replace(":tiny", ":diverges_in_epoch_2")
    cfg = load_config(overrides=base_overrides(image_folder, model))
    with pytest.raises(TrainingDiverged, match=r"loss became nan at epoch 2.*holds epoch 1"):
        train(cfg, tmp_path / "run", log=quiet)
    state = load_state(tmp_path / "run" / "last.pt")
    assert state["epoch"] == 0  # epoch 1, finite
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (tmp_path / "run" / "done.json").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_hyper_parameters_are_refused(value: str) -> None:
    for key in ("lr", "weight_decay"):
        with pytest.raises(ConfigError, match=f"{key} must be a finite number"):
            load_config(overrides=["data=x", f"{key}={value}"])


def test_no_validation_set_picks_best_by_train_loss(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    cfg = load_config(overrides=[*base_overrides(image_folder, tiny_model), "valid_pct=0"])
    lines: list[str] = []
    result = train(cfg, tmp_path / "run", log=lines.append)
    assert any("no validation set" in line for line in lines)
    assert all("valid_loss" not in row for row in result.history)
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    losses = [row["train_loss"] for row in result.history]
    assert best["train_loss"] == min(losses) and best["epoch"] == 1 + losses.index(min(losses))
    assert "nan" not in (tmp_path / "run" / "history.csv").read_text()


@pytest.mark.slow
def test_a_run_folder_in_use_is_refused_at_once(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    cfg = load_config(overrides=base_overrides(image_folder, tiny_model))
    with (
        lock_folder(tmp_path / "run", "run folder"),
        pytest.raises(ConfigError, match=r"in use by pid \d+"),
    ):
        train(cfg, tmp_path / "run", log=quiet)
    assert not (tmp_path / "run" / "config.json").exists()
    train(cfg, tmp_path / "run", log=quiet)  # free again once the other run ends


def test_out_that_is_a_file_fails_before_the_data_is_scanned(
    tiny_model: str, tmp_path: Path
) -> None:
    (tmp_path / "taken").write_text("x")
    cfg = load_config(overrides=base_overrides(tmp_path / "no-such-folder", tiny_model))
    with pytest.raises(ConfigError, match="is a file"):
        train(cfg, tmp_path / "taken", log=quiet)


@pytest.mark.slow
def test_fixed_micro_batch_is_checked_against_an_explicit_budget(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    base = [*base_overrides(image_folder, tiny_model), "overhead=0"]
    with pytest.raises(
        ConfigError, match=r"micro_batch=12 does not fit budget=300KiB.*set micro_batch=\d"
    ):
        train(
            load_config(overrides=[*base, "micro_batch=12", "budget=300KiB"]),
            tmp_path / "a",
            log=quiet,
        )
    lines: list[str] = []
    train(load_config(overrides=[*base, "budget=1GiB"]), tmp_path / "b", log=lines.append)
    assert any("micro-batch 4 (fixed) fits budget 1GiB" in line for line in lines)


@pytest.mark.slow
def test_a_tight_cpu_budget_has_training_return_freed_memory(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan with no room for glibc's heap to grow past the prediction: training gives freed
    memory back (recorded here: the real call would slow this test process for good)."""
    import bigbatch.train.planning as planning

    calls: list[str] = []
    monkeypatch.setattr(planning, "return_freed_cpu_memory", lambda: calls.append("x") or True)
    base = [*base_overrides(image_folder, tiny_model), "micro_batch=0", "epochs=1"]
    lines: list[str] = []
    train(
        load_config(overrides=[*base, "budget=1MiB", "overhead=256KiB"]),
        tmp_path / "tight",
        log=lines.append,
    )
    assert calls == ["x"]
    assert any("large CPU blocks now go back to the system" in line for line in lines), lines
    train(
        load_config(overrides=[*base, "budget=1GiB", "overhead=256KiB"]),
        tmp_path / "roomy",
        log=quiet,
    )
    assert calls == ["x"]  # the roomy plan leaves glibc's heap as it is


def test_a_budget_above_the_machine_memory_is_refused(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    overrides = [*base_overrides(image_folder, tiny_model), "micro_batch=0", "budget=64TiB"]
    with pytest.raises(ConfigError, match="more than all the memory this cpu has"):
        train(load_config(overrides=overrides), tmp_path / "run", log=quiet)


@pytest.mark.parametrize("budget", ["lots", "8XB", "-1GB"])
def test_an_unreadable_budget_fails_before_any_work(budget: str) -> None:
    with pytest.raises(ConfigError, match=f"budget='{budget}'"):
        load_config(overrides=["data=x", f"budget={budget}"])


def test_progress_lines_when_the_output_is_not_a_terminal(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    cfg = load_config(overrides=[*base_overrides(image_folder, tiny_model), "log_every=1e-9"])
    lines: list[str] = []
    train(cfg, tmp_path / "run", log=lines.append, progress=False)
    progress = [line for line in lines if "window" in line and "samples/s" in line]
    assert progress and progress[0].startswith("epoch 1/2 (all): window 1/2")


@pytest.mark.slow
def test_mode_auto_fits_random_weights_and_fine_tunes_given_weights(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    overrides = [*base_overrides(image_folder, tiny_model)]
    overrides.remove("mode=fit")
    lines: list[str] = []
    train(load_config(overrides=overrides), tmp_path / "a", log=lines.append)
    assert any("mode: fit (random weights" in line for line in lines)
    weights = tmp_path / "a" / "last.safetensors"
    lines.clear()
    result = train(
        load_config(overrides=[*overrides, f"weights={weights}"]), tmp_path / "b", log=lines.append
    )
    assert any("mode: fine_tune" in line for line in lines)
    assert [row["phase"] for row in result.history] == ["frozen", "unfrozen", "unfrozen"]


def test_sgd_trains_and_is_what_the_floor_message_offers(
    image_folder: Path, tiny_model: str, tmp_path: Path
) -> None:
    cfg = load_config(overrides=[*base_overrides(image_folder, tiny_model), "optimizer=sgd"])
    result = train(cfg, tmp_path / "run", log=quiet)
    assert result.history[-1]["optimizer_steps"] == 4
    with pytest.raises(ConfigError, match=r"optimizer=sgd in bigbatch train"):
        train(
            load_config(
                overrides=[
                    *base_overrides(image_folder, tiny_model),
                    "micro_batch=0",
                    "budget=1KiB",
                    "overhead=0",
                ]
            ),
            tmp_path / "floor",
            log=quiet,
        )


def test_a_folder_that_cannot_be_written_fails_first(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only place for the run folder (simulated: this suite runs as root in CI, where
    chmod does not stop writes) fails before the data is scanned, in one line."""
    import bigbatch.train.tasks.classification.task as classification

    real_mkdir = Path.mkdir

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        if self == tmp_path / "ro" / "run":
            raise PermissionError(13, "Permission denied", str(self))
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", read_only)
    scanned = []
    monkeypatch.setattr(classification, "prepare_data", lambda *a, **k: scanned.append(1))
    cfg = load_config(overrides=base_overrides(image_folder, tiny_model))
    with pytest.raises(ConfigError, match=r"cannot write to run folder .*permission denied"):
        train(cfg, tmp_path / "ro" / "run", log=quiet)
    assert not scanned


def test_threads_and_workers_are_chosen_recorded_and_kept_on_resume(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import bigbatch.train.stepping as stepping
    from bigbatch.train.runtime import resolve_threads

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = load_config(overrides=["data=x"])
    with monkeypatch.context() as m:
        m.setattr(os, "sched_getaffinity", lambda _: set(range(2)), raising=False)
        assert resolve_threads(auto, cpu) == (2, 0)  # small machine: load in-process
        m.setattr(os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
        assert resolve_threads(auto, cpu) == (6, 2)
        assert resolve_threads(load_config(overrides=["data=x", "threads=3"]), cpu) == (3, 2)
        # A GPU run: every core but one decodes and augments; the trainer keeps the last.
        assert resolve_threads(auto, cuda) == (1, 7)
        m.setattr(os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
        assert resolve_threads(auto, cuda) == (1, 15)
        assert resolve_threads(auto, cpu) == (12, 4)
        m.setattr(os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
        assert resolve_threads(auto, cuda) == (48, 16)
        m.setattr(os, "sched_getaffinity", lambda _: set(range(2)), raising=False)
        assert resolve_threads(auto, cuda) == (1, 1)
        # Under torchrun the local ranks share the cores.
        m.setattr(os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
        m.setenv("LOCAL_WORLD_SIZE", "2")
        assert resolve_threads(auto, cuda) == (1, 7)

    before = torch.get_num_threads()
    overrides = [*base_overrides(image_folder, tiny_model), "threads=1"]
    seen: list[int] = []
    real_run_window = stepping.run_window

    def killed(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        if len(seen) == 3:  # the first window of epoch 2
            raise KeyboardInterrupt
        return real_run_window(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stepping, "run_window", killed)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(overrides=overrides), tmp_path / "run", log=quiet)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["threads"], plan["num_workers"]) == (1, 0) and set(seen) == {1}
    assert torch.get_num_threads() == before  # the caller's setting is restored
    seen.clear()
    lines: list[str] = []
    overrides[-1] = "threads=2"  # not a training key: the resume keeps the run's own count
    train(load_config(overrides=overrides), tmp_path / "run", resume=True, log=lines.append)
    assert set(seen) == {1} and any("the run's own threads=1" in line for line in lines)


def test_channels_last_compile_and_cudnn_benchmark_are_applied_when_asked(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """channels_last=true trains with NHWC weights (inputs follow; auto: CUDA conv models only);
    compile=true hands the training model to torch.compile, checkpoints keep plain names;
    cudnn_benchmark=true holds torch.backends.cudnn.benchmark on while training (auto: on
    CUDA), plan.json says so, and the caller's setting is back after. (The compiler itself is
    not run here: it takes minutes on this CPU.)"""
    compiled: list[torch.nn.Module] = []
    benchmark: list[bool] = []

    def fake_compile(model: torch.nn.Module, **kwargs: object) -> torch.nn.Module:
        compiled.append(model)
        benchmark.append(torch.backends.cudnn.benchmark)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    overrides = [*base_overrides(image_folder, tiny_model), "channels_last=true", "compile=true"]
    overrides.append("cudnn_benchmark=true")
    assert not torch.backends.cudnn.benchmark
    train(load_config(overrides=overrides), tmp_path / "run", log=quiet)
    assert benchmark == [True] and not torch.backends.cudnn.benchmark
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["cudnn_benchmark"] is True
    assert len(compiled) == 1  # one training phase (mode=fit)
    conv = next(m for m in compiled[0].modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    from safetensors.torch import load_file

    assert not any("_orig_mod" in k for k in load_file(tmp_path / "run" / "last.safetensors"))
    cfg = load_config(overrides=["data=x"])
    assert cfg.channels_last == "auto" and not cfg.compile and cfg.cudnn_benchmark == "auto"
    with pytest.raises(ConfigError, match="cudnn_benchmark"):
        load_config(overrides=["data=x", "cudnn_benchmark=yes"])


@pytest.mark.slow
def test_the_loop_reads_the_loss_from_the_device_at_the_epochs_end_not_every_window(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a window's loss waits for the device: the loop keeps the results and reads them
    together (every 32 windows, at a checkpoint, at the epoch's end), and the epoch's exact mean
    is the same."""
    import bigbatch.train.stepping as stepping
    from bigbatch.accumulate import StepResult

    stepped = 0
    read_after: list[int] = []  # windows stepped when each loss was read
    real_run_window, real_loss = stepping.run_window, StepResult.loss

    def counted_window(*args: object, **kwargs: object) -> object:
        nonlocal stepped
        stepped += 1
        return real_run_window(*args, **kwargs)  # type: ignore[arg-type]

    def read(self: StepResult) -> float:
        read_after.append(stepped)
        return real_loss.fget(self)  # type: ignore[attr-defined, no-any-return]

    monkeypatch.setattr(stepping, "run_window", counted_window)
    monkeypatch.setattr(StepResult, "loss", property(read))
    overrides = [*base_overrides(image_folder, tiny_model), "batch=4", "valid_pct=0.25"]
    result = train(load_config(overrides=overrides), tmp_path / "run", log=quiet)
    per_epoch = stepped // 2
    assert per_epoch >= 3  # several windows an epoch
    assert sorted(set(read_after)) == [per_epoch, 2 * per_epoch]  # each epoch's end, once
    assert all(math.isfinite(row["train_loss"]) for row in result.history)
