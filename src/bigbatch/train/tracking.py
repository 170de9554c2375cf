"""What ``bigbatch train log=...`` sends to the trackers (:mod:`bigbatch.trackers`), from
rank 0: the config and the plan as parameters, the loss and learning rate per optimizer step
(read every :data:`EVERY_STEPS` steps, one device wait for all), each epoch's history row at
its optimizer step with the samples seen, the OOM back-off's and the refit's events, and at the
end the measured peak and the run's files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigbatch.io import atomic_write_text
from bigbatch.trackers import IDS_FILE, Trackers, WindowLog, open_trackers, parse_trackers

__all__ = ["EVERY_STEPS", "RunReport", "report_files", "start_report"]

EVERY_STEPS = 10  # optimizer steps between reads of the per-step losses


class RunReport:
    """The trackers of one run and where it stands (samples seen, events already sent)."""

    def __init__(self, trackers: Trackers, folder: Path, resume: bool = False) -> None:
        self.trackers, self.folder = trackers, folder
        # trackers.json as open_trackers left it: the runs' ids, and samples_seen kept beside
        path = folder / IDS_FILE
        self.ids: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        self.events_sent = 0
        self.last_step = 0  # trackers take steps in order (W&B drops an earlier one)
        self.closed = False
        self.window_log = WindowLog(self._send_step, every=EVERY_STEPS)
        if resume:  # the samples the run had seen when it stopped
            self.window_log.samples_seen = float(self.ids.get("samples_seen", 0))

    def _send_step(self, metrics: dict[str, float], step: int) -> None:
        self.trackers.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step)

    def window(self, result: Any, samples: float, lr: float) -> None:
        """One optimizer step's result (its loss is read with the next :data:`EVERY_STEPS`)."""
        self.window_log.add(result, samples=samples, extra={"lr": lr})

    def epoch(self, row: dict[str, Any], events: list[Any], decode: Any = None) -> None:
        """An epoch's history row (validation metrics, ``train_loss``, ``lr``, micro-batch)
        at its optimizer step with the samples seen and where the images were decoded
        (``decode_on_gpu``: ``decode=auto`` may move there after the first epoch), and the
        back-off's new events."""
        self.window_log.flush()  # its steps come before the epoch's: steps only go up
        step = self.last_step = int(row["optimizer_steps"])
        seen = self.window_log.samples_seen
        values = {k: v for k, v in row.items() if k != "phase"} | {"samples_seen": seen}
        if decode is not None:
            values["decode_on_gpu"] = int(bool(decode.on_device))
        self.trackers.log_metrics(values, step)
        for event in events[self.events_sent :]:
            self.trackers.log_event(
                f"micro-batch {event.old} -> {event.new} ({event.reason}) at optimizer step "
                f"{event.optimizer_step}",
                event.optimizer_step,
            )
        self.events_sent = len(events)
        self.ids["samples_seen"] = seen
        atomic_write_text(self.folder / IDS_FILE, json.dumps(self.ids))

    def finish(self, artifacts: list[Path]) -> None:
        """The measured peak beside the predicted one, the run's files, and the runs closed."""
        plan_path = self.folder / "plan.json"
        plan = json.loads(plan_path.read_text()) if plan_path.is_file() else {}
        peaks = {
            f"memory/{k}": plan[k]
            for k in ("predicted_peak_bytes", "measured_peak_bytes")
            if isinstance(plan.get(k), int | float)
        }
        if peaks:
            self.trackers.log_metrics(peaks, self.last_step)
        for path in artifacts:
            self.trackers.log_artifact(path)
        self.close()

    def close(self, failed: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.trackers.close(failed)


def start_report(
    cfg: Any, folder: Path, resume: bool, log: Callable[[str], None]
) -> RunReport | None:
    """Open the trackers ``cfg.log`` names for the run in ``folder`` (continuing their runs
    when ``resume``) and send the config and the plan (``plan.json``) as parameters; None for
    ``log=none``."""
    wanted = parse_trackers(cfg.log)
    if not wanted:
        return None
    plan_path = folder / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.is_file() else {}
    params = cfg.to_dict() | {"plan": plan}
    trackers = open_trackers(wanted, folder, run_name=folder.name, resume=resume, log=log)
    report = RunReport(trackers, folder, resume)
    if not resume:
        trackers.log_params(params)
    if trackers:
        log(f"reporting to {', '.join(t.name for t in trackers.trackers)} ({_where(trackers)})")
    return report


def _where(trackers: Trackers) -> str:
    places = []
    for t in trackers.trackers:
        if t.name == "mlflow":
            places.append(f"MLflow at {t.tracking_uri}")
        elif t.name == "wandb":
            places.append(f"W&B run {t.run_id}, {t.mode}")
        else:
            places.append("TensorBoard: tensorboard --logdir <run>/tensorboard")
    return "; ".join(places)


def report_files(folder: Path, checkpoint: bool) -> list[Path]:
    """The run's files the trackers keep at its end: the history (CSV and plot), the plan,
    the run's log, and with ``log_checkpoint`` the best weights."""
    names = ["history.csv", "history.png", "plan.json", "train.log"]
    names += ["best.safetensors"] if checkpoint else []
    return [folder / n for n in names if (folder / n).is_file()]
