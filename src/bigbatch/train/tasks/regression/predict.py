"""Predictions of a trained regression run, in the targets' own units, with test-time
augmentation (pass 0 the validation transform, pass 1 its horizontal flip, further passes the
training augmentation, seeded), averaged over passes; an ensemble of runs averages their
predictions. Written as a CSV in the training CSV's layout (``file,target...``) and an ``.npz``,
both atomically."""

from __future__ import annotations

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

__all__ = ["ensemble_request", "predict_files", "predict_request", "save_values"]


def predict_files(
    run_dir: str | Path,
    files: Sequence[Path],
    *,
    tta: int = 2,
    checkpoint: str = "best",
    device: str = "auto",
    seed: int = 0,
    budget: str = "",
) -> tuple[np.ndarray, list[str]]:
    """``(values [files, targets], target names)``: the run's predictions of ``files`` in the
    targets' units, averaged over ``tta`` passes."""
    if isinstance(tta, bool) or not isinstance(tta, int) or tta < 1:
        raise ConfigError(f"tta is a number of passes >= 1, got {tta!r}")
    run = TrainedRun.open(run_dir, checkpoint, task="regression")
    targets = list(run.info["targets"])
    mean = torch.tensor(run.info["mean"], dtype=torch.float64)
    std = torch.tensor(run.info["std"], dtype=torch.float64)

    def values(outputs: torch.Tensor) -> np.ndarray:
        return (outputs.double().cpu() * std + mean).numpy()

    dev = resolve_device(device, "--device")
    rows = predict_images(
        run, len(targets), files, values, tta=tta, device=dev, budget=budget, seed=seed
    )
    return rows, targets


def save_values(
    files: Sequence[Path], values: np.ndarray, names: list[str], out: Path
) -> tuple[Path, Path]:
    """``out.csv`` (``file,target...``, the training CSV's layout, file names relative to
    nothing: their names) and ``out.npz`` (files, values, targets), atomically."""
    npz, csv_path = out.with_suffix(".npz"), out.with_suffix(".csv")
    with atomic_path(npz) as tmp, open(tmp, "wb") as f:
        np.savez(f, values=values, files=np.array([str(p) for p in files]), targets=np.array(names))
    atomic_write_csv(
        csv_path,
        ["file", *names],
        ([Path(f).name, *(f"{v:.6g}" for v in row)] for f, row in zip(files, values, strict=True)),
    )
    return npz, csv_path


def _out_path(out: Path | None, default: Path) -> Path:
    target = out or default
    if target.is_dir():
        target = target / "predictions"
    check_writable(target.with_suffix(".csv"), "--out")
    return target


def predict_request(request: PredictRequest) -> str:
    """``bigbatch predict`` on a regression run: every image under ``request.inputs``."""
    request.refuse_options("regression")
    out = _out_path(request.out, request.run_dir / "predictions")
    files = images_to_predict(request.inputs)
    values, names = predict_files(
        request.run_dir,
        files,
        tta=request.tta,
        checkpoint=request.checkpoint,
        device=request.device,
        budget=request.budget,
    )
    npz, csv_path = save_values(files, values, names, out)
    return (
        f"{len(files)} images, {request.tta} TTA pass(es): {', '.join(names)} in {csv_path} ({npz})"
    )


def ensemble_request(request: EnsembleRequest) -> str:
    """``bigbatch ensemble RUN RUN ... --images DIR`` on regression runs: their predictions
    averaged (the runs must predict the same targets)."""
    runs = list(request.runs)
    if not runs:
        raise ConfigError("an ensemble needs one or more run folders")
    files = images_to_predict(request.images)
    out = _out_path(request.out, Path("predictions"))
    total, names = np.zeros(0), list[str]()
    for i, run in enumerate(runs):
        values, these = predict_files(
            run,
            files,
            tta=request.tta,
            checkpoint=request.checkpoint,
            device=request.device,
            budget=request.budget,
        )
        if i and these != names:
            raise ConfigError(
                f"{run} predicts {', '.join(these)}, the first run {', '.join(names)}: an "
                "ensemble averages runs of the same targets"
            )
        names = these
        total = values if i == 0 else total + values
    npz, csv_path = save_values(files, total / len(runs), names, out)
    return f"{len(runs)} run(s) averaged over {len(files)} images: {csv_path} ({npz})"
