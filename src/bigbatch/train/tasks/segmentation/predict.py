"""Masks from a trained segmentation run: MONAI's sliding-window inference, test-time flips,
autocast, and masks written in each input's own geometry.

Every input is checked before the first mask is written: readable, finite, the run's channel
count and dimensionality, and no two inputs writing the same mask (``a.png`` and ``a.jpg``).
A 2D image is predicted whole at the run's size and the mask resized back. A volume goes through
the run's preprocessing (orientation and ``spacing`` resampling, foreground z-scoring), is
predicted in overlapping windows of the training patch size (``patch`` to change it) blended
with Gaussian weights, and its probabilities are resampled back to the input's grid. Masks are
PNG label maps for images (0/255 when the run learned 0/255 masks), ``.npy`` for ``.npy``
volumes, NIfTI with the input's affine and header for NIfTI volumes; each file atomically.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bigbatch.backoff import EvalBackoff
from bigbatch.io import atomic_path, check_writable
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.data import IMAGE_SUFFIXES, DataError, images_to_predict, read_csv_rows
from bigbatch.train.runtime import resolve_device
from bigbatch.train.tasks import PredictRequest, planned_eval_batch, read_task_info
from bigbatch.train.tasks.base import inference_placement
from bigbatch.train.tasks.segmentation.data import (
    VOLUME_SUFFIXES,
    VolumeRecipe,
    image_input,
    preprocess,
    read_case,
    stem,
    to_meta,
    volume_suffix,
)
from bigbatch.train.tasks.segmentation.task import (
    build_seg_model,
    seg_settings,
    sliding_window_fitting,
)
from bigbatch.train.tasks.segmentation.tta import Probabilities, tta_flips, with_tta
from bigbatch.train.trained_run import TrainedRun

__all__ = ["predict_masks", "predict_request"]


Case = tuple[Path, ...]  # one case's files: an image, a volume, or a volume's modalities


def _inputs(source: Path, dims: int) -> tuple[list[Case], Path]:
    """The cases under a folder (one file each), or listed in a CSV's ``image`` column (a
    volume's modalities separated by ';', as in training); and the root their names are
    relative to."""
    if source.suffix.lower() == ".csv" and source.is_file():
        rows = read_csv_rows(source)
        header = [h.strip().lower() for h in rows[0]] if rows else []
        if "image" not in header:
            raise DataError(f"{source} needs an image column (a mask column is not needed)")
        at = header.index("image")
        cases = []
        for line, row in enumerate(rows[1:], start=2):
            cell = row[at] if at < len(row) else ""
            case = tuple(source.parent / p.strip() for p in cell.split(";") if p.strip())
            missing = [f for f in case if not f.is_file()]
            if not case or missing:
                raise DataError(
                    f"{source}, line {line}: {missing[0] if missing else 'no image'} does not exist"
                )
            cases.append(case)
        return cases, source.parent
    if dims == 2:
        return [(f,) for f in images_to_predict(source)], source  # every image readable
    if not source.is_dir():
        raise DataError(f"{source} is not a folder of volumes (or a CSV of cases) to predict")
    files = sorted(
        p for p in source.rglob("*") if p.is_file() and volume_suffix(p) in VOLUME_SUFFIXES
    )
    if not files:
        images = [p for p in source.rglob("*") if volume_suffix(p) in IMAGE_SUFFIXES]
        hint = f" (it holds 2D images, e.g. {images[0].name}, but this run segments volumes)"
        raise DataError(f"{source} holds no volumes (.npy, .nii, .nii.gz){hint if images else ''}")
    return [(f,) for f in files], source


def _target(case: Case, root: Path, out: Path) -> Path:
    """Where a case's mask goes: its file's place under ``out``; for a case of several
    modality files, the name they share (``case_001_t1.nii.gz``, ``case_001_t2.nii.gz`` ->
    ``case_001.nii.gz``)."""
    first = case[0]
    target = out / first.relative_to(root)
    if volume_suffix(first) in IMAGE_SUFFIXES:
        return target.with_suffix(".png")
    if len(case) > 1:
        shared = os.path.commonprefix([stem(f) for f in case]).rstrip("_-. ") or stem(first)
        target = target.with_name(shared + volume_suffix(first))
    return target


def _check_inputs(cases: list[Case], root: Path, out: Path, dims: int, channels: int) -> None:
    """Everything that would stop prediction half-way, before the first mask is written."""
    check_writable(out / "probe", "--out")
    seen: dict[Path, Path] = {}
    for case in cases:
        target = _target(case, root, out)
        if target in seen:
            raise DataError(
                f"{seen[target].name} and {case[0].name} would both write {target}: rename one"
            )
        seen[target] = case[0]
    for case in cases:
        found = read_case(case, dims).array.shape[0]  # readable and finite, or DataError
        if found != channels:
            raise DataError(f"{case[0]} has {found} channel(s); the run was trained on {channels}")


def predict_request(request: PredictRequest) -> str:
    """``bigbatch predict`` on a segmentation run: a mask for every image or volume under
    ``request.inputs`` (options ``patch``, ``overlap``), or, for a run trained on a Kaggle RLE
    CSV, the submission CSV (option ``mask_size``); the summary line."""
    try:
        info = read_task_info(request.run_dir)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if info.get("rle"):
        from bigbatch.train.tasks.segmentation.submit import write_submission

        request.refuse_options("Kaggle RLE segmentation", ("mask_size",))
        target, rows, note = write_submission(
            [request.run_dir],
            request.inputs,
            request.out or request.run_dir / "submission.csv",
            mask_size=str(request.options.get("mask_size", "")),
            tta=request.tta,
            checkpoint=request.checkpoint,
            device=request.device,
        )
        return f"submission: {rows} rows, {request.tta} TTA pass(es) (flips), {note}: {target}"
    request.refuse_options("segmentation", ("patch", "overlap"))
    out = request.out or request.run_dir / "masks"
    masks = predict_masks(
        request.run_dir,
        request.inputs,
        out,
        tta=request.tta,
        checkpoint=request.checkpoint,
        device=request.device,
        **request.options,
    )
    return f"{len(masks)} mask(s), {request.tta} TTA pass(es) (flips): {out}"


def predict_masks(
    run_dir: str | Path | Sequence[str | Path],
    folder: str | Path,
    out: str | Path,
    *,
    tta: int = 2,
    checkpoint: str = "best",
    device: str = "auto",
    patch: int = 0,
    overlap: float = 0.5,
) -> list[Path]:
    """Write a mask for every image or volume under ``folder`` (or case listed in a CSV's
    ``image`` column) into ``out``; return their paths. Several runs (an ensemble) average
    their probabilities before the mask is taken.

    Volumes are predicted in overlapping windows of the training size (``patch`` to choose
    another multiple of the network's stride), overlapping by ``overlap``."""
    if isinstance(tta, bool) or not isinstance(tta, int) or tta < 1:
        raise ConfigError(f"tta is a number of passes >= 1, got {tta!r}")
    if not 0 <= overlap < 1:
        raise ConfigError(f"overlap is a fraction in [0, 1), got {overlap}")
    dirs = [run_dir] if isinstance(run_dir, str | Path) else list(run_dir)
    folder, out = Path(folder), Path(out)
    runs = [TrainedRun.open(d, checkpoint) for d in dirs]
    kind = _kind(runs[0])
    for run in runs[1:]:
        if _kind(run) != kind:
            raise ConfigError(
                f"{run.run_dir} segments {_kind(run)}, {runs[0].run_dir} {kind} (dimensions, "
                "channels, classes): an ensemble averages runs of the same kind"
            )
    dims, channels, classes = kind
    tta_flips(dims, tta)
    for run in runs:
        _check_patch(patch, overlap, dims, int(run.info.get("multiple", 8)))
    cases, root = _inputs(folder, dims)
    _check_inputs(cases, root, out, dims, channels)
    dev = resolve_device(device, "--device")
    members = [_member(run, dev, patch, overlap) for run in runs]
    written = []
    for case in cases:
        with torch.no_grad():
            probs = torch.stack([m(case, tta) for m in members]).mean(0)
        mask = (probs[0] > 0.5).long() if classes == 1 else probs.argmax(0)
        if dims == 2 and runs[0].info.get("binary_255"):
            mask = mask * 255  # as the run's masks were stored
        written.append(_write_mask(mask.cpu().numpy(), case, root, out))
    return written


def _kind(run: TrainedRun) -> tuple[int, int, int]:
    """(dimensions, channels, classes) a run segments."""
    return int(run.info["dims"]), int(run.info["channels"]), int(run.info["num_classes"])


def _check_patch(patch: int, overlap: float, dims: int, multiple: int) -> None:
    if dims == 2 and overlap != 0.5:  # the default: set, it would be ignored
        raise ConfigError(
            "--overlap is for volumes (2D images are predicted whole at the run's size): drop it"
        )
    if patch and (dims == 2 or patch < 2 * multiple or patch % multiple):
        raise ConfigError(
            "--patch is for volumes (2D images are predicted whole at the run's size)"
            if dims == 2
            else f"--patch {patch}: the network halves it down to 1/{multiple} (and needs 2 "
            f"voxels there), so it must be a multiple of {multiple}, at least {2 * multiple}; "
            f"try {max(2 * multiple, patch // multiple * multiple)}"
        )


def _member(
    run: TrainedRun, dev: torch.device, patch: int, overlap: float
) -> Callable[[Case, int], torch.Tensor]:
    """One run's probabilities of a case (on the CPU, in the input's own grid), with TTA."""
    cfg = run.config
    dims, channels, classes = _kind(run)
    model = run.load_into(build_seg_model(cfg, channels, classes, dims)())
    model, where = inference_placement(model, cfg, dev)
    # Patches a forward pass: as many as the run's validation planned (at its patch size).
    window_batch = planned_eval_batch(run.run_dir, dev, default=1) if not patch else 1
    backoff = EvalBackoff()

    def probabilities(x: torch.Tensor) -> torch.Tensor:
        with where.autocast():
            logits = model(where.inputs(x)).float()
        return torch.sigmoid(logits) if classes == 1 else torch.softmax(logits, 1)

    def of(case: Case, tta: int) -> torch.Tensor:
        if dims == 2:
            return _image_probs(probabilities, case, cfg.size, tta)
        windows = (window_batch, backoff)
        return _volume_probs(probabilities, case, cfg, (patch, overlap, windows), tta)

    return of


def _image_probs(probabilities: Probabilities, case: Case, size: int, tta: int) -> torch.Tensor:
    image = torch.from_numpy(read_case(case, 2).array)
    x = image_input(image, size)[None]  # as in training
    probs = with_tta(probabilities, x, tta).cpu()
    return F.interpolate(probs, size=tuple(image.shape[1:]), mode="bilinear")[0]


def _volume_probs(
    probabilities: Probabilities,
    case: Case,
    cfg: TrainConfig,
    sliding: tuple[int, float, tuple[int, EvalBackoff]],
    tta: int,
) -> torch.Tensor:
    """One volume's probabilities: sliding windows of ``sliding`` = (patch (0: the training
    size), overlap, (patches a pass, their OOM back-off)), gathered on the CPU."""
    from monai.transforms import ResampleToMatch

    patch, overlap, (window_batch, backoff) = sliding

    settings = seg_settings(cfg, 3)
    original = to_meta(read_case(case, 3))
    image, _ = preprocess(original, None, VolumeRecipe(cfg.size, settings.spacing))
    roi = (patch or cfg.size,) * 3

    def windows(v: torch.Tensor) -> torch.Tensor:
        cpu = torch.device("cpu")
        return sliding_window_fitting(
            probabilities, v, roi, window_batch, backoff, overlap=overlap, gather=cpu
        )

    probs = with_tta(windows, torch.as_tensor(image)[None], tta)[0]
    if settings.spacing:  # back to the input's own grid
        resampled = image.clone()
        resampled.set_array(probs)
        probs = torch.as_tensor(ResampleToMatch(mode="bilinear")(resampled, img_dst=original))
    return probs


def _write_mask(mask: np.ndarray, case: Case, root: Path, out: Path) -> Path:
    source = case[0]  # its geometry (affine, header) is the mask's
    suffix = volume_suffix(source)
    target = _target(case, root, out)
    if suffix in IMAGE_SUFFIXES:
        from PIL import Image

        with atomic_path(target) as tmp:
            Image.fromarray(mask.astype(np.uint8)).save(tmp, format="PNG")
    elif suffix == ".npy":
        with atomic_path(target) as tmp, open(tmp, "wb") as fh:
            np.save(fh, mask.astype(np.int64))
    else:
        import nibabel as nib

        src: Any = nib.load(str(source))
        img = nib.Nifti1Image(mask.astype(np.uint8), src.affine, src.header)
        img.set_data_dtype(np.uint8)
        with atomic_path(target) as tmp:
            nib.save(img, str(tmp.with_name(tmp.name + suffix)))
            tmp.with_name(tmp.name + suffix).replace(tmp)
    return target
