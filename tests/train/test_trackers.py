"""`bigbatch train log=tensorboard,wandb,mlflow` on a CPU, read back with each tracker's own
reader (TensorBoard's event accumulator, MLflow's client on its local store, W&B's offline
transaction log decoded with its protobuf records): the history's metrics, the plan's figures
as parameters, a resumed run continuing the same tracker runs, a tracker that fails mid-run not
stopping training, a missing library refused before training."""

from __future__ import annotations

import csv
import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest

import bigbatch.train.stepping as stepping
from bigbatch.train.config import ConfigError, load_config
from bigbatch.train.loop import train
from tiny_runs import base_overrides

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ALL = "log=tensorboard,wandb,mlflow"


def history(run: Path) -> list[dict[str, str]]:
    with open(run / "history.csv") as f:
        return list(csv.DictReader(f))


def tensorboard_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def mlflow_run(run: Path) -> Any:
    from mlflow.tracking import MlflowClient

    from bigbatch.trackers import _local_file_store

    ids = json.loads((run / "trackers.json").read_text())
    with _local_file_store():  # MLflow's client on the run's local store
        return MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri()), ids["mlflow"]


def wandb_records(run: Path) -> list[Any]:
    """Every record of the run's offline W&B transaction logs (a LevelDB-style log of W&B's
    own protobuf ``Record`` messages), in order."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, block, pending = path.read_bytes(), 7, 32768, b""
        while pos + 7 <= len(data):
            left = block - pos % block
            length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
            if left < 7 or (length == 0 and kind == 0):
                pos += left  # the block's padding
                continue
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):  # a whole record, or its last piece
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append(record)
    return records


def wandb_history(records: list[Any], key: str) -> list[tuple[int, float]]:
    out = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            if key in items:
                out.append((int(items["_step"]), float(items[key])))
    return out


@pytest.mark.slow
def test_every_tracker_gets_the_history_and_the_plan(image_folder: Path, tiny_model: str, tmp_path: Path) -> None:  # fmt: skip
    run = tmp_path / "run"
    lines: list[str] = []
    train(
        load_config(
            overrides=[*base_overrides(image_folder, tiny_model), ALL, "log_checkpoint=true"]
        ),
        run,
        log=lines.append,
    )
    rows = history(run)
    steps = [int(r["optimizer_steps"]) for r in rows]
    losses = [float(r["valid_loss"]) for r in rows]
    assert any(line.startswith("reporting to tensorboard, wandb, mlflow") for line in lines)
    # TensorBoard: the epoch metrics at their optimizer steps, the per-step loss and rate.
    tb = tensorboard_scalars(run, "valid_loss")
    assert [s for s, _ in tb] == steps and [v for _, v in tb] == pytest.approx(losses, rel=1e-6)
    assert len(tensorboard_scalars(run, "train/loss")) == steps[-1]  # every optimizer step
    assert tensorboard_scalars(run, "samples_seen")[-1][1] == 2 * 24  # 2 epochs of 24 images
    assert [v for _, v in tensorboard_scalars(run, "decode_on_gpu")] == [0, 0]  # a CPU run
    # MLflow: the same metrics, the plan as parameters, the files.
    client, run_id = mlflow_run(run)
    got = [(m.step, m.value) for m in client.get_metric_history(run_id, "valid_loss")]
    assert got == [(s, pytest.approx(v, rel=1e-9)) for s, v in zip(steps, losses, strict=True)]
    params = client.get_run(run_id).data.params
    assert params["plan.micro_batch"] == "4" and params["batch"] == "12"
    assert client.get_run(run_id).info.status == "FINISHED"
    kept = {a.path for a in client.list_artifacts(run_id)}
    assert {"history.csv", "history.png", "plan.json", "train.log", "best.safetensors"} <= kept
    # W&B: the same metrics in its offline run, the config.
    records = wandb_records(run)
    assert [
        (s, pytest.approx(v, rel=1e-9)) for s, v in wandb_history(records, "valid_loss")
    ] == list(zip(steps, losses, strict=True))
    config = {
        i.key or "/".join(i.nested_key): i.value_json
        for r in records
        if r.HasField("config")
        for i in r.config.update
    }
    assert json.loads(config["plan.micro_batch"]) == 4


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_tracker_runs(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    overrides = [*base_overrides(image_folder, tiny_model), ALL]
    calls = {"n": 0}
    real = stepping.run_window

    def killed(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:  # epoch 2's second window
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(stepping, "run_window", killed)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(overrides=overrides), run, log=lambda _: None)
    monkeypatch.setattr(stepping, "run_window", real)
    ids = json.loads((run / "trackers.json").read_text())
    client, run_id = mlflow_run(run)
    assert client.get_run(run_id).info.status == "FAILED"  # the killed run ended as failed
    train(load_config(overrides=overrides), run, resume=True, log=lambda _: None)
    after = json.loads((run / "trackers.json").read_text())
    assert {k: after[k] for k in ("wandb", "mlflow")} == {k: ids[k] for k in ("wandb", "mlflow")}
    steps = [int(r["optimizer_steps"]) for r in history(run)]
    got = client.get_metric_history(run_id, "valid_loss")
    assert [m.step for m in got] == steps  # epoch 1 from the first run, epoch 2 resumed
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [s for s, _ in wandb_history(wandb_records(run), "valid_loss")] == steps
    assert [s for s, _ in tensorboard_scalars(run, "valid_loss")] == steps


def test_a_tracker_failing_mid_run_does_not_stop_training(
    image_folder: Path, tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bigbatch.trackers import MLflowTracker

    def gone(self: Any, metrics: Any, step: int) -> None:
        raise ConnectionError("Max retries exceeded with url: /api/2.0/mlflow/runs/log-batch")

    monkeypatch.setattr(MLflowTracker, "log_metrics", gone)
    run, lines = tmp_path / "run", []
    overrides = [*base_overrides(image_folder, tiny_model), "log=mlflow,tensorboard"]
    train(load_config(overrides=overrides), run, log=lines.append)
    said = [line for line in lines if line.startswith("mlflow:")]
    assert len(said) == 1 and "training goes on" in said[0]  # said once
    assert (run / "done.json").exists() and len(history(run)) == 2
    assert len(tensorboard_scalars(run, "valid_loss")) == 2  # the others keep reporting


def test_a_missing_tracker_library_is_refused_before_training(monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"log=wandb needs wandb.*pip install 'bigbatch\[wandb\]'"
    ):
        load_config(overrides=["data=x", "log=tensorboard,wandb"]).validate()
    with pytest.raises(ConfigError, match="comet is not a tracker"):
        load_config(overrides=["data=x", "log=comet"]).validate()
    # The best weights kept where no tracker stores files: refused, not ignored.
    for log in ("none", "tensorboard"):
        with pytest.raises(ConfigError, match=f"log={log} reports to neither: add log=wandb"):
            load_config(overrides=["data=x", f"log={log}", "log_checkpoint=true"])


def test_window_log_waits_for_the_device_once_per_flush() -> None:
    """The losses of the kept steps are read at the flush, not as each step is added."""
    from bigbatch.accumulate import StepResult
    from bigbatch.trackers import WindowLog

    reads: list[int] = []
    sent: list[tuple[int, dict[str, float]]] = []
    log = WindowLog(lambda m, step: sent.append((step, m)), every=3)

    def step(n: int) -> StepResult:
        return StepResult(n, 2, 8.0, 1.5, False, _loss=lambda: reads.append(n) or 0.25)

    for n in (1, 2):
        log.add(step(n), samples=8, tokens=100)
    assert reads == [] and sent == []
    log.add(step(3), samples=8, tokens=100)
    assert reads == [1, 2, 3]
    assert sent[-1] == (
        3,
        {"loss": 0.25, "grad_norm": 1.5, "samples_seen": 24.0, "tokens_seen": 300.0},
    )


def test_the_peaks_go_at_the_last_step(tmp_path: Path) -> None:
    """Trackers take steps in order: the run's peaks at its last optimizer step, not at 0."""
    from bigbatch.trackers import Trackers
    from bigbatch.train.tracking import RunReport

    sent: list[tuple[dict[str, float], int]] = []

    class Recorder:
        name, run_id = "recorder", "r"

        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            sent.append((metrics, step))

        def log_event(self, text: str, step: int) -> None: ...

        def close(self, failed: bool = False) -> None: ...

    (tmp_path / "plan.json").write_text(
        json.dumps({"predicted_peak_bytes": 100, "measured_peak_bytes": 120})
    )
    report = RunReport(Trackers([Recorder()], print), tmp_path)
    report.epoch({"epoch": 1, "phase": "fit", "train_loss": 0.5, "optimizer_steps": 7}, [])
    report.finish([])
    assert sent[-1] == (
        {"memory/predicted_peak_bytes": 100.0, "memory/measured_peak_bytes": 120.0},
        7,
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not (importlib.util.find_spec("tensorflow") and importlib.util.find_spec("triton")),
    reason="the crash needs TensorFlow and triton both installed",
)
def test_a_tensorboard_tracker_opened_before_the_optimizer_does_not_crash_the_process(
    tmp_path: Path,
) -> None:
    """Where TensorFlow is installed (Kaggle's images, this venv), the TensorBoard writer
    imports it; triton's library loaded after TensorFlow 2.21's (at the first optimizer's
    construction, through torch's compiler) ended the process with a segmentation fault. The
    tracker loads the compiler first: a script in the order a user writes it runs to its end."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from bigbatch.trackers import TensorBoardTracker\n"
        "tracker = TensorBoardTracker(Path(sys.argv[1]))\n"
        "torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n"
        "tracker.log_metrics({'loss': 0.5}, step=1)\n"
        "tracker.close()\n"
        "print('ran to its end')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "ran to its end" in done.stdout, done.stderr[-2000:]
