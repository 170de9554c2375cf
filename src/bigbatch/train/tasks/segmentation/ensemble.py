"""``bigbatch ensemble RUN RUN ... --images DIR`` on segmentation runs: their probabilities
averaged, then a mask per input (runs of image or volume folders) or, for runs trained on a
Kaggle RLE CSV, the per-class rules and one submission."""

from __future__ import annotations

from pathlib import Path

from bigbatch.train.config import ConfigError
from bigbatch.train.tasks import EnsembleRequest, read_task_info
from bigbatch.train.tasks.segmentation.predict import predict_masks
from bigbatch.train.tasks.segmentation.submit import write_submission

__all__ = ["ensemble_request"]


def ensemble_request(request: EnsembleRequest) -> str:
    """``bigbatch ensemble RUN RUN ... --images DIR`` on segmentation runs: their probabilities
    averaged, then, for runs trained on a Kaggle RLE CSV, the per-class rules and one
    submission; for runs of image or volume folders, a mask per input (``--out``/masks)."""
    rle = [bool(read_task_info(r).get("rle")) for r in request.runs]
    if any(rle) and not all(rle):
        raise ConfigError(
            "some of these runs were trained on a Kaggle RLE CSV and some on mask files: an "
            "ensemble averages runs of one kind"
        )
    if not all(rle):
        request.refuse_options("segmentation", ("patch", "overlap"))
        out = (request.out or Path(".")) / "masks"
        masks = predict_masks(
            request.runs,
            request.images,
            out,
            tta=request.tta,
            checkpoint=request.checkpoint,
            device=request.device,
            **request.options,
        )
        runs = len(request.runs)
        return f"{len(masks)} mask(s) of {runs} run(s), probabilities averaged: {out}"
    request.refuse_options("Kaggle RLE segmentation", ("mask_size",))
    target, rows, note = write_submission(
        request.runs,
        request.images,
        request.out or Path("submission.csv"),
        mask_size=str(request.options.get("mask_size", "")),
        tta=request.tta,
        checkpoint=request.checkpoint,
        device=request.device,
    )
    runs = len(request.runs)
    return f"submission of {runs} run(s), probabilities averaged: {rows} rows, {note}: {target}"
