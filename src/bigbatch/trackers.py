"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, each through its own library.

``bigbatch train log=tensorboard,wandb,mlflow`` opens them with :func:`open_trackers`; your own
loop can too, and :class:`WindowLog` hands them an :class:`~bigbatch.Accumulator`'s window
results (the exact window loss, the gradient norm, samples and tokens seen) without making the
device wait each step: it keeps the step results and reads their losses every ``every``
optimizer steps, one wait for all of them.

Offline by default: TensorBoard writes event files under the run folder, Weights & Biases runs
in offline mode (``WANDB_MODE=online`` or ``wandb sync`` to upload), MLflow keeps a local file
store in the run folder unless ``MLFLOW_TRACKING_URI`` names a server. A tracker that fails
mid-run (the network gone) is said once and dropped: training goes on, the run folder's files
are kept.

>>> log = WindowLog(lambda metrics, step: print(step, metrics), every=2)
>>> from bigbatch.accumulate import StepResult
>>> for s in (1, 2):
...     log.add(StepResult(s, 1, 8.0, None, False, _loss=0.5), samples=8)
1 {'loss': 0.5, 'samples_seen': 8.0}
2 {'loss': 0.5, 'samples_seen': 16.0}
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "IDS_FILE",
    "TRACKERS",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "Trackers",
    "WandbTracker",
    "WindowLog",
    "check_trackers",
    "open_trackers",
    "parse_trackers",
]

# name -> (the module to import, the extra that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
IDS_FILE = "trackers.json"  # the trackers' run ids, for a resumed run to continue them


class Tracker(Protocol):
    """What :class:`Trackers` asks of each tracker."""

    name: str
    run_id: str

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_event(self, text: str, step: int) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def parse_trackers(text: str) -> list[str]:
    """``log=``'s value as tracker names; ``none`` or empty: none.

    >>> parse_trackers("wandb, tensorboard"), parse_trackers("none")
    (['wandb', 'tensorboard'], [])
    """
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"log={text}: {', '.join(unknown)} is not a tracker bigbatch reports to; give any of "
            f"{', '.join(TRACKERS)} (comma-separated), or none"
        )
    return list(dict.fromkeys(names))


def check_trackers(names: list[str]) -> None:
    """Refuse, before any work, a tracker whose library is not installed (naming the extra).

    >>> check_trackers([])
    """
    for name in names:
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"log={name} needs {module}, which is not installed: "
                f"pip install 'bigbatch[{extra}]'"
            )


def _flat(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameters as one level (``plan.micro_batch``); lists and None as text."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _flat(value, f"{name}.")
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


class TensorBoardTracker:
    """TensorBoard's event files in ``folder`` (``SummaryWriter``): scalars by step, the
    parameters as hyper-parameters and as a text table. A resumed run appends to the folder.

    >>> import tempfile
    >>> tracker = TensorBoardTracker(Path(tempfile.mkdtemp()))
    >>> tracker.log_params({"lr": 0.1, "plan": {"micro_batch": 8}})
    >>> tracker.log_metrics({"loss": 0.5}, step=1)
    >>> tracker.close()
    """

    name = "tensorboard"

    def __init__(self, folder: Path, run_id: str = "") -> None:
        # torch's compiler first, and triton's library with it: the writer imports TensorFlow
        # where it is installed, and triton's library loaded after TensorFlow 2.21's crashed the
        # process (a segmentation fault at the first optimizer's construction, triton 3.8).
        import torch._dynamo  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = run_id or "tensorboard"
        self.writer = SummaryWriter(log_dir=str(folder))

    def log_params(self, params: dict[str, Any]) -> None:
        flat = _flat(params)
        table = "\n".join(f"| {k} | {v} |" for k, v in flat.items())
        self.writer.add_text("params", "| key | value |\n|---|---|\n" + table)
        # run_name ".": the hyper-parameters go into this run's folder, not a new one.
        self.writer.add_hparams(flat, {}, run_name=".")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_event(self, text: str, step: int) -> None:
        self.writer.add_text("events", text, step)

    def log_artifact(self, path: Path) -> None:
        """TensorBoard keeps no files: the run folder has them."""

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (``wandb.init``), offline unless ``WANDB_MODE`` says otherwise,
    its files under ``folder/wandb``; ``run_id`` resumes it. Project: ``WANDB_PROJECT`` or
    bigbatch.

    >>> import tempfile
    >>> tracker = WandbTracker(Path(tempfile.mkdtemp()))  # offline: nothing leaves the machine
    >>> tracker.log_metrics({"loss": 0.5}, step=1)
    >>> tracker.close()
    >>> tracker.mode, bool(tracker.run_id)  # `wandb sync` uploads it later
    ('offline', True)
    """

    name = "wandb"

    def __init__(self, folder: Path, run_id: str = "", run_name: str = "") -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(
            dir=str(folder),
            project=os.environ.get("WANDB_PROJECT", "bigbatch"),
            name=run_name or None,
            id=run_id or None,
            resume="allow",
            mode=self.mode,  # type: ignore[arg-type]
            settings=wandb.Settings(silent=True, console="off"),
            reinit="create_new",
        )
        self.run_id = self.run.id

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(_flat(params), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_event(self, text: str, step: int) -> None:
        self.run.log({"events": text}, step=step)

    def log_artifact(self, path: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"run-{self.run_id}", type="bigbatch-run")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


@contextlib.contextmanager
def _local_file_store() -> Iterator[None]:
    # MLflow >= 3.7 builds a local file store only when told to (its server is the future);
    # said for the store's construction only, not for the caller's process.
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


class MLflowTracker:
    """An MLflow run (``MlflowClient``): in ``MLFLOW_TRACKING_URI``'s server, else a local file
    store in ``folder``; experiment ``MLFLOW_EXPERIMENT_NAME`` or bigbatch; ``run_id`` resumes
    it. The store's URI is :attr:`tracking_uri` (``mlflow ui --backend-store-uri``).

    >>> import tempfile
    >>> tracker = MLflowTracker(Path(tempfile.mkdtemp()))
    >>> tracker.log_metrics({"loss": 0.5}, step=1)
    >>> tracker.close()
    >>> tracker.tracking_uri.startswith("file:")  # no MLFLOW_TRACKING_URI: a local store
    True
    """

    name = "mlflow"

    def __init__(self, folder: Path, run_id: str = "", run_name: str = "") -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or folder.resolve().as_uri()
        local = self.tracking_uri.startswith("file:")
        with _local_file_store() if local else contextlib.nullcontext():
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            if run_id:
                self.run_id = self.client.get_run(run_id).info.run_id
                self.client.update_run(run_id, status="RUNNING")
                return
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "bigbatch")
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment, run_name=run_name or None).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        flat = [Param(k, str(v)[:6000]) for k, v in _flat(params).items()]
        for i in range(0, len(flat), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=flat[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_event(self, text: str, step: int) -> None:
        self.events = getattr(self, "events", 0) + 1  # tags are keyed: one key an event
        self.client.set_tag(self.run_id, f"event.{self.events:04d}", f"step {step}: {text}")

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class Trackers:
    """Every open tracker, called together; one that raises is said once (``log``) and
    dropped, and the others and training go on.

    >>> Trackers([], print).log_metrics({"loss": 1.0}, step=1)  # none open: nothing to do
    """

    def __init__(self, trackers: list[Any], log: Callable[[str], None]) -> None:
        self.trackers, self.log = list(trackers), log

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, what: str, call: Callable[[Any], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # a tracker's failure never stops training
                self.trackers.remove(tracker)
                first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                self.log(
                    f"{tracker.name}: {what} failed ({type(exc).__name__}: {first}); no more "
                    "reports to it this run, training goes on and the run folder keeps "
                    "history.csv"
                )

    def log_params(self, params: dict[str, Any]) -> None:
        self._each("logging the parameters", lambda t: t.log_params(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        finite = {k: float(v) for k, v in metrics.items() if _number(v)}
        if finite:
            self._each("logging metrics", lambda t: t.log_metrics(finite, step))

    def log_event(self, text: str, step: int) -> None:
        self._each("logging an event", lambda t: t.log_event(text, step))

    def log_artifact(self, path: Path) -> None:
        if path.is_file():
            self._each(f"keeping {path.name}", lambda t: t.log_artifact(path))

    def close(self, failed: bool = False) -> None:
        self._each("closing the run", lambda t: t.close(failed))
        self.trackers = []

    def ids(self) -> dict[str, str]:
        return {t.name: t.run_id for t in self.trackers}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def open_trackers(
    names: list[str],
    folder: str | Path,
    *,
    run_name: str = "",
    resume: bool = False,
    log: Callable[[str], None] = print,
) -> Trackers:
    """Open ``names`` (see :data:`TRACKERS`) for the run in ``folder``: TensorBoard's events in
    ``folder/tensorboard``, W&B's files in ``folder/wandb``, MLflow's local store in
    ``folder/mlruns``. Their run ids are kept in ``folder/trackers.json``; with ``resume``,
    the same runs continue. A tracker that cannot open is said and left out.

    >>> import tempfile
    >>> trackers = open_trackers([], tempfile.mkdtemp())
    >>> bool(trackers)
    False
    """
    from bigbatch.io import atomic_write_text

    check_trackers(names)
    folder = Path(folder)
    ids_path = folder / IDS_FILE
    ids = json.loads(ids_path.read_text()) if resume and ids_path.is_file() else {}
    opened: list[Any] = []
    for name in names:
        try:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(folder / "tensorboard", ids.get(name, "")))
            elif name == "wandb":
                opened.append(WandbTracker(folder, ids.get(name, ""), run_name))
            else:
                opened.append(MLflowTracker(folder / "mlruns", ids.get(name, ""), run_name))
        except Exception as exc:  # a tracker's failure never stops training
            log(f"{name}: could not open the run ({type(exc).__name__}: {exc}); training goes on")
    trackers = Trackers(opened, log)
    if opened:
        atomic_write_text(ids_path, json.dumps(ids | trackers.ids()))
    return trackers


class WindowLog:
    """Hand an :class:`~bigbatch.Accumulator`'s window results to ``send(metrics, step)``
    (your tracker's ``log``), ``every`` optimizer steps at once: the step results are kept and
    their losses read together, so the device is waited for once per ``every`` steps, not each
    step. Each step's metrics: ``loss`` (the exact window mean), ``grad_norm`` (with clipping),
    ``samples_seen``, ``tokens_seen`` (with ``tokens=``) and any ``extra`` (the learning rate).

        log = WindowLog(lambda m, step: wandb.log(m, step=step), every=20)
        result = acc.step()
        log.add(result, samples=len(y), extra={"lr": scheduler.get_last_lr()[0]})
        ...
        log.flush()  # at the end (or before evaluation)

    >>> import torch
    >>> from bigbatch import Accumulator
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> log = WindowLog(lambda metrics, step: print(step, sorted(metrics)), every=2)
    >>> for _ in range(2):
    ...     acc.backward(model(torch.ones(4, 2)).mean(), count=4)
    ...     log.add(acc.step(), samples=4)
    1 ['loss', 'samples_seen']
    2 ['loss', 'samples_seen']
    """

    def __init__(self, send: Callable[[dict[str, float], int], None], *, every: int = 10):
        if every < 1:
            raise ValueError(f"every must be >= 1 optimizer step, got {every}")
        self.send, self.every = send, every
        self.samples_seen = self.tokens_seen = 0.0
        self._pending: list[tuple[Any, dict[str, float]]] = []

    def add(
        self,
        result: Any,
        *,
        samples: float = 0,
        tokens: float = 0,
        extra: dict[str, float] | None = None,
    ) -> None:
        """One optimizer step's :class:`~bigbatch.accumulate.StepResult` (skipped steps too:
        their samples were seen)."""
        self.samples_seen += samples
        self.tokens_seen += tokens
        seen = {"samples_seen": self.samples_seen}
        if self.tokens_seen:
            seen["tokens_seen"] = self.tokens_seen
        self._pending.append((result, seen | (extra or {})))
        if len(self._pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Read and send what is kept (the first loss read waits for the device once)."""
        pending, self._pending = self._pending, []
        for result, metrics in pending:
            if result.skipped:
                continue
            values = {"loss": result.loss}
            if result.grad_norm is not None:
                values["grad_norm"] = float(result.grad_norm)
            self.send(values | metrics, result.optimizer_step)
