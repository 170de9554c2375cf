"""A Kaggle submission from runs trained on an RLE CSV: each test image's class probabilities
(test-time flips averaged), averaged over the runs when there are several, resized to the
submission's mask size, thresholded and cleaned by the per-class rules tuned on validation
(``postprocess.json``), and written in the training CSV's layout.

Everything is checked before the first image is predicted: the runs' classes and layout agree,
every test image is readable, the mask size is ``HxW``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigbatch.device import autocast_for
from bigbatch.images import exif_orientation
from bigbatch.io import atomic_path, check_writable
from bigbatch.segmentation.postprocess import (
    ClassRule,
    apply_rules,
    load_rules,
    resize_masks,
    resize_probabilities,
    save_rules,
    tune_rules,
)
from bigbatch.segmentation.rle import RLEError, parse_mask_size, write_rle_csv
from bigbatch.train.config import ConfigError
from bigbatch.train.data import images_to_predict, split_items
from bigbatch.train.runtime import resolve_device
from bigbatch.train.tasks.base import inference_placement
from bigbatch.train.tasks.segmentation.kaggle import padded_forward, probabilities_of
from bigbatch.train.tasks.segmentation.rle_data import (
    network_input,
    read_rgb,
    refuse_exif_orientation,
    scan_rle,
    transforms,
)
from bigbatch.train.tasks.segmentation.task import build_seg_model
from bigbatch.train.tasks.segmentation.tta import tta_flips, with_tta
from bigbatch.train.trained_run import TrainedRun

__all__ = ["SubmissionRun", "load_submission_run", "write_submission"]


@dataclass
class SubmissionRun:
    """A trained RLE run, ready to predict: its model, classes, layout and rules."""

    run_dir: Path
    model: torch.nn.Module
    classes: list[str]
    layout: str
    multilabel: bool
    pipeline: Any  # validation's transforms: the resize to the run's image_size, if any
    rules: list[ClassRule] | None  # None: no validation set, nothing was tuned
    rules_size: tuple[int, int]  # the mask size the rules' smallest components count at
    precision: str
    split: tuple[Any, ...]  # what decides its validation images (data, image_root, valid_pct, seed)
    labels: str
    stored_size: tuple[int, int] | None = None  # the training images' own size, if one


def load_submission_run(
    run_dir: str | Path, checkpoint: str = "best", device: torch.device | None = None
) -> SubmissionRun:
    """Read a run trained on an RLE CSV (ConfigError with the fix for any other run)."""
    run_dir = Path(run_dir)
    run = TrainedRun.open(run_dir, checkpoint)
    cfg, info = run.config, run.info
    rle = info.get("rle")
    if not rle:
        raise ConfigError(
            f"{run_dir} was not trained on a Kaggle RLE CSV: --mask-size and submissions are "
            "for such runs; bigbatch predict writes its masks as images"
        )
    classes = [str(c) for c in info["classes"]]
    model = run.load_into(build_seg_model(cfg, 3, int(info["num_classes"]), 2)())
    dev = device or torch.device("cpu")
    model, where = inference_placement(model, cfg, dev)
    rules_file = run_dir / "postprocess.json"
    rules, rules_size = None, tuple(rle["mask_size"] or (0, 0))
    if rules_file.is_file():
        try:
            rules, rules_size = load_rules(rules_file, classes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return SubmissionRun(
        run_dir,
        model,
        classes,
        str(rle["layout"]),
        bool(rle["multilabel"]),
        transforms(False, False, tuple(rle["image_size"]) if rle.get("image_size") else None, None),
        rules,
        (int(rules_size[0]), int(rules_size[1])),
        where.precision,
        (cfg.data, cfg.image_root, cfg.valid_pct, cfg.seed),
        str(getattr(cfg.options, "labels", "auto")),
        (int(rle["stored_size"][0]), int(rle["stored_size"][1]))
        if rle.get("stored_size")
        else None,
    )


def _probabilities(run: SubmissionRun, path: Path, tta: int, device: torch.device) -> torch.Tensor:
    """One image's ``(classes, H, W)`` probabilities, the flips of ``tta`` passes averaged; the
    image prepared as training's validation prepared it (the same resize, the same
    normalisation)."""
    x = network_input(run.pipeline(image=read_rgb(path))["image"])[None]

    def forward(v: torch.Tensor) -> torch.Tensor:
        with autocast_for(run.precision, device.type):
            logits = padded_forward(run.model, v.to(device))
        return probabilities_of(logits, run.multilabel)

    with torch.no_grad():
        return with_tta(forward, x, tta)[0].cpu()


def _averaged_at(
    runs: Sequence[SubmissionRun], path: Path, tta: int, device: torch.device, size: tuple[int, int]
) -> np.ndarray:
    """The runs' mean probabilities of one image, ``(classes, *size)``: each run's brought to
    ``size`` first, since runs trained at other resolutions predict at their own."""
    total = sum(
        resize_probabilities(_probabilities(run, path, tta, device)[None], size)[0] for run in runs
    )
    return (torch.as_tensor(total) / len(runs)).numpy()


def _check_members(runs: Sequence[SubmissionRun]) -> None:
    first = runs[0]
    for other in runs[1:]:
        if other.classes != first.classes or other.multilabel != first.multilabel:
            raise ConfigError(
                f"{other.run_dir} predicts {', '.join(other.classes)} "
                f"({'multilabel' if other.multilabel else 'exclusive'}), {first.run_dir} "
                f"{', '.join(first.classes)}: an ensemble's runs share their classes"
            )
        if other.layout != first.layout:
            raise ConfigError(
                f"{other.run_dir} was trained on a {other.layout} CSV, {first.run_dir} on a "
                f"{first.layout} one: train them on the same competition's CSV"
            )


def write_submission(
    run_dirs: Sequence[str | Path],
    images: str | Path,
    out: str | Path,
    *,
    mask_size: str = "",
    tta: int = 2,
    checkpoint: str = "best",
    device: str = "auto",
) -> tuple[Path, int, str]:
    """Write the submission CSV of every image under ``images`` to ``out``: the runs'
    probabilities averaged (one run: its own), at ``mask_size`` (``HxW``; default the size the
    rules were tuned at), through the run's rules (several runs validated on the same images:
    rules tuned again on their averaged probabilities, saved beside ``out`` as
    ``postprocess.json``); returns the path, the rows and a note on the rules used. Two
    finished runs ensembled, as ``bigbatch ensemble runs/a runs/b --images test_images`` does::

        path, rows, note = write_submission(["runs/a", "runs/b"], "test_images",
                                            "submission.csv", mask_size="350x525")
    """
    if isinstance(tta, bool) or not isinstance(tta, int) or tta < 1:
        raise ConfigError(f"tta is a number of passes >= 1, got {tta!r}")
    tta_flips(2, tta)
    target = Path(out)
    if target.is_dir():  # --out a folder: the submission goes inside it
        target = target / "submission.csv"
    check_writable(target, "--out")  # before any prediction, not after it
    try:
        size = parse_mask_size(mask_size) if mask_size else None
    except RLEError as exc:
        raise ConfigError(str(exc)) from None
    files = images_to_predict(images)  # every image readable, before any prediction
    sizes = _header_sizes(files)
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ConfigError(
            f"two test images share a name under {images}: a submission row names one"
        )
    dev = resolve_device(device, "--device")
    runs = [load_submission_run(r, checkpoint, dev) for r in run_dirs]
    _check_members(runs)
    lead = runs[0]
    if size is not None:
        _check_orientation(size, files, sizes, lead.rules_size)
    size = size or lead.rules_size
    if not size[0]:
        raise ConfigError("the run holds no mask size: give --mask-size HxW (e.g. 350x525)")
    rules, note = _rules_at(lead, size)
    if len(runs) > 1:
        saved = target.with_name("postprocess.json")
        rules, note = _ensemble_rules(runs, size, tta, dev, (rules, note), saved)

    def rows() -> Any:
        for path in files:
            masks = apply_rules(_averaged_at(runs, path, tta, dev, size), rules)
            yield path.name, dict(zip(lead.classes, masks, strict=True))

    with atomic_path(target) as tmp:
        count = write_rle_csv(tmp, lead.layout, lead.classes, rows())
    return target, count, note + _size_note(files, sizes, lead.stored_size)


def _check_orientation(
    size: tuple[int, int],
    files: Sequence[Path],
    sizes: Sequence[tuple[int, int]],
    tuned: tuple[int, int],
) -> None:
    """A ``--mask-size`` of the other orientation than the test images' (height and width
    swapped) would write every mask turned, a submission that looks valid: refused, with the
    size meant."""

    def shape(h: int, w: int) -> str:
        return "landscape" if w > h else "portrait" if h > w else "square"

    wanted = shape(*size)
    if wanted == "square":
        return
    other = [(path, hw) for path, hw in zip(files, sizes, strict=True) if shape(*hw) != "square"]
    if not other or all(shape(*hw) == wanted for _, hw in other):
        return
    path, (height, width) = next((p, hw) for p, hw in other if shape(*hw) != wanted)
    rules = f"; the run's rules were tuned at {tuned[0]}x{tuned[1]}" if tuned[0] else ""
    raise ConfigError(
        f"--mask-size {size[0]}x{size[1]} is HEIGHTxWIDTH, {wanted}, but the test images are "
        f"{shape(height, width)} (e.g. {path.name}: {height}x{width}){rules}: give --mask-size "
        f"{size[1]}x{size[0]}"
    )


def _header_sizes(files: Sequence[Path]) -> list[tuple[int, int]]:
    """Each test image's (height, width), read once from its header, where an EXIF
    orientation is refused too (its masks would be written turned)."""
    from PIL import Image

    sizes = []
    for path in files:
        with Image.open(path) as im:
            refuse_exif_orientation(path, exif_orientation(im))
            sizes.append((im.height, im.width))
    return sizes


def _size_note(
    files: Sequence[Path], sizes: Sequence[tuple[int, int]], stored: tuple[int, int] | None
) -> str:
    """Test images whose size is not the training images', said: they are resized (to the
    network's input, their masks to the mask size), which a transposed image should not be."""
    if stored is None:
        return ""
    other = [
        (path.name, height, width)
        for path, (height, width) in zip(files, sizes, strict=True)
        if (height, width) != stored
    ]
    if not other:
        return ""
    name, height, width = other[0]
    turned = sum(1 for _, h, w in other if (w, h) == stored)
    return (
        f"; {len(other)} test image(s) are not {stored[0]}x{stored[1]} like the training images "
        f"(e.g. {name}: {height}x{width}), resized to the network's input and their masks to "
        "the mask size"
        + (
            f"; {turned} of them transposed ({stored[1]}x{stored[0]}): check they are upright"
            if turned
            else ""
        )
    )


def _ensemble_rules(
    runs: Sequence[SubmissionRun],
    size: tuple[int, int],
    tta: int,
    device: torch.device,
    fallback: tuple[list[ClassRule], str],
    saved: Path,
) -> tuple[list[ClassRule], str]:
    """Rules tuned again on the runs' averaged validation probabilities (the ensemble's own
    threshold: averaging softens the probabilities); the first run's when the runs were not
    validated on the same images."""
    lead = runs[0]
    if not lead.split[2]:
        return fallback[0], fallback[1] + " (no validation set to tune the ensemble's rules on)"
    if any(r.split != lead.split for r in runs):
        rules, note = fallback
        return rules, note + " (the runs were validated on different images: not tuned again)"
    data, image_root, valid_pct, seed = lead.split
    if not Path(data).is_file() or (image_root and not Path(image_root).is_dir()):
        rules, note = fallback
        return rules, note + (
            f" (not tuned again: the runs' training data {data} is not there; put it back, or "
            "set data= and image_root= in each run's config.json to where it is now)"
        )
    items = scan_rle(data, image_root, lead.labels)
    _, valid = split_items(items, valid_pct, seed)
    probs, truth = [], []
    for i, path in enumerate(valid.images):
        probs.append(_averaged_at(runs, path, tta, device, size))
        truth.append(resize_masks(torch.from_numpy(valid.masks(i))[None], size)[0])
    rules, scores = tune_rules(np.stack(probs), np.stack(truth))
    save_rules(saved, lead.classes, rules, scores.tolist(), size)
    return rules, (
        f"per-class rules tuned on the {len(valid)} validation images' averaged probabilities "
        f"(mean Dice {float(np.mean(scores)):.4f}; {saved})"
    )


def _rules_at(run: SubmissionRun, size: tuple[int, int]) -> tuple[list[ClassRule], str]:
    """The rules for masks of ``size``: smallest components scaled by the area when the rules
    were tuned at another size."""
    if run.rules is None:
        why = (
            "the run had no validation set to tune them on"
            if (run.run_dir / "done.json").is_file()
            else "the run is unfinished: its rules are tuned when it finishes"
        )
        return [ClassRule()] * len(run.classes), f"threshold 0.5, no components dropped ({why})"
    tuned = run.rules_size
    if size == tuned:
        return run.rules, f"per-class rules of {run.run_dir / 'postprocess.json'}"
    scale = (size[0] * size[1]) / (tuned[0] * tuned[1])
    rules = [ClassRule(r.threshold, round(r.min_size * scale)) for r in run.rules]
    return rules, (
        f"per-class rules of {run.run_dir / 'postprocess.json'}, tuned at {tuned[0]}x{tuned[1]}: "
        f"smallest components scaled by the area to {size[0]}x{size[1]}"
    )
