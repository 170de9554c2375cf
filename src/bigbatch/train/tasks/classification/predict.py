"""Class probabilities from a trained run, with test-time augmentation (TTA).

Pass 0 is the validation transform; pass 1 its horizontal flip; further passes use the training
augmentation with a fixed seed. Probabilities are averaged over passes. Saved as ``.npz`` (plain
arrays, read back with ``allow_pickle=False``) and a CSV of labels, both written atomically.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bigbatch.io import atomic_path, atomic_write_csv, check_writable
from bigbatch.train.config import ConfigError
from bigbatch.train.data import images_to_predict
from bigbatch.train.runtime import resolve_device
from bigbatch.train.tasks import EnsembleRequest, PredictRequest
from bigbatch.train.tasks.images import predict_images
from bigbatch.train.trained_run import TrainedRun

__all__ = [
    "Predictions",
    "ensemble_request",
    "load_predictions",
    "predict_files",
    "predict_folder",
    "predict_request",
    "save_predictions",
]


class Predictions:
    def __init__(self, files: list[str], probs: np.ndarray, classes: list[str]) -> None:
        self.files, self.probs, self.classes = files, probs, classes

    @property
    def labels(self) -> list[str]:
        return [self.classes[i] for i in self.probs.argmax(axis=1)]


def _open_run(run_dir: Path, checkpoint: str) -> tuple[TrainedRun, list[str]]:
    """The finished run and its classes (its ``task.json`` holds the image format and data
    config it trained with; older runs: 8-bit RGB, ImageNet's)."""
    run = TrainedRun.open(run_dir, checkpoint)
    try:
        classes = json.loads((run_dir / "classes.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{run_dir}/classes.json is missing or damaged: {exc}") from exc
    return run, classes


def predict_files(
    run_dir: str | Path,
    files: Sequence[Path],
    *,
    tta: int = 2,
    checkpoint: str = "best",
    device: str = "auto",
    batch_size: int | None = None,
    seed: int = 0,
    budget: str = "",
) -> Predictions:
    """Averaged class probabilities of ``files`` over ``tta`` passes (1 = no augmentation),
    ``batch_size`` images a forward pass (None: the run's planned validation batch, when it
    was planned on this kind of device, else 64); an OOM runs a batch again in smaller
    pieces. ``budget``: the batch planned under it instead (``bigbatch predict --budget``)."""

    if isinstance(tta, bool) or not isinstance(tta, int) or tta < 1:
        raise ConfigError(f"tta is a number of passes >= 1, got {tta!r}")
    dev = resolve_device(device, "--device")
    run, classes = _open_run(Path(run_dir), checkpoint)

    def probabilities(logits: torch.Tensor) -> np.ndarray:
        return torch.softmax(logits.float(), dim=1).cpu().double().numpy()

    probs = predict_images(
        run,
        len(classes),
        files,
        probabilities,
        tta=tta,
        device=dev,
        item_transform=run.config.options.item_transform,
        batch_size=batch_size,
        budget=budget,
        seed=seed,
    )
    return Predictions([str(f) for f in files], probs, classes)


def predict_folder(run_dir: str | Path, folder: str | Path, **kwargs: object) -> Predictions:
    """:func:`predict_files` on every image under ``folder``; the folder, the run and the
    images are checked before the model runs."""
    return predict_files(run_dir, images_to_predict(folder), **kwargs)  # type: ignore[arg-type]


def predict_request(request: PredictRequest) -> str:
    """``bigbatch predict`` on a classification run: probabilities (.npz) and labels (.csv) of
    every image under ``request.inputs``; the summary line."""
    request.refuse_options("classification")
    out = request.out or request.run_dir / "predictions"
    if out.is_dir():  # --out an existing folder: the files go inside it
        out = out / "predictions"
    check_writable(out.with_suffix(".npz"), "--out")
    pred = predict_folder(
        request.run_dir,
        request.inputs,
        tta=request.tta,
        checkpoint=request.checkpoint,
        device=request.device,
        budget=request.budget,
    )
    npz, csv_path = save_predictions(pred, out)
    return (
        f"{len(pred.files)} images, {request.tta} TTA pass(es): probabilities in {npz}, "
        f"labels in {csv_path}"
    )


def ensemble_request(request: EnsembleRequest) -> str:
    """``bigbatch ensemble RUN RUN ... --images DIR`` on classification runs: their class
    probabilities averaged (the runs must share their classes), saved as ``predict`` saves."""
    request.refuse_options("classification")
    out = request.out or Path("predictions")
    if out.is_dir():
        out = out / "predictions"
    check_writable(out.with_suffix(".npz"), "--out")
    files = images_to_predict(request.images)
    members = [
        predict_files(
            r,
            files,
            tta=request.tta,
            checkpoint=request.checkpoint,
            device=request.device,
            budget=request.budget,
        )
        for r in request.runs
    ]
    for run, member in zip(request.runs, members, strict=True):
        if member.classes != members[0].classes:
            raise ConfigError(
                f"{run} has classes {member.classes[:5]}, the first run {members[0].classes[:5]}: "
                "an ensemble averages runs of the same classes"
            )
    probs = np.mean([m.probs for m in members], axis=0)
    npz, csv_path = save_predictions(Predictions(members[0].files, probs, members[0].classes), out)
    return f"{len(members)} run(s) averaged over {len(files)} images: labels in {csv_path} ({npz})"


def save_predictions(pred: Predictions, out: str | Path) -> tuple[Path, Path]:
    """``out.npz`` (probs, files, classes) and ``out.csv`` (file, label, confidence)."""
    out = Path(out)
    npz, csv_path = out.with_suffix(".npz"), out.with_suffix(".csv")
    with atomic_path(npz) as tmp, open(tmp, "wb") as f:  # a file object: savez adds no suffix
        np.savez(
            f,
            probs=pred.probs,
            files=np.array(pred.files, dtype=str),
            classes=np.array(pred.classes, dtype=str),
        )
    atomic_write_csv(
        csv_path,
        ["file", "label", "confidence"],
        (
            [f, label, f"{p:.6f}"]
            for f, label, p in zip(pred.files, pred.labels, pred.probs.max(axis=1), strict=True)
        ),
    )
    return npz, csv_path


def load_predictions(path: str | Path) -> Predictions:
    with np.load(Path(path).with_suffix(".npz"), allow_pickle=False) as data:
        return Predictions(
            [str(f) for f in data["files"]], data["probs"], [str(c) for c in data["classes"]]
        )
