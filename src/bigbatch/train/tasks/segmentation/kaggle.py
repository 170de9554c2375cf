"""Segmentation from a Kaggle RLE CSV: full-resolution 2D images, classes that may overlap (a
sigmoid per class) or exclude each other (a softmax with the background), the competition's
Dice per class in ``history.csv``, and, after training, each class's threshold and smallest
component tuned on the validation set (``postprocess.json``) for ``bigbatch predict``'s
submission.

The networks are segmentation_models_pytorch's (``arch=unet encoder=efficientnet_b0``), which
halve an image five times: inputs are padded to a multiple of 32 for the forward pass and the
logits cropped back, so that no pixel is resized and none is scored twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.batching import batch_len
from bigbatch.segmentation.losses import BATCH_LOSSES, multilabel_loss, per_sample_loss
from bigbatch.segmentation.postprocess import (
    pair_dice,
    resize_masks,
    resize_probabilities,
    save_rules,
    tune_rules,
)
from bigbatch.train.checkpoint import load_weights_file
from bigbatch.train.config import ConfigError
from bigbatch.train.data import split_items
from bigbatch.train.tasks.base import Log, Placement, ValidShape
from bigbatch.train.tasks.segmentation.rle_data import (
    RLEDataset,
    RLEItems,
    conversion_note,
    parse_size,
    scan_rle,
)
from bigbatch.train.tasks.segmentation.task import SegmentationTask
from bigbatch.train.tasks.segmentation.tta import with_tta

__all__ = ["CompetitionScores", "KaggleSegmentationTask", "padded_forward", "probabilities_of"]

# The per-sample losses of overlapping classes, by the name the `loss` key gives.
MULTILABEL_NAMES = {"dice_ce": "dice_bce", "dice": "dice", "ce": "bce"}
MULTIPLE = 32  # smp's encoders halve an image five times


def padded_forward(model: nn.Module, x: torch.Tensor, multiple: int = MULTIPLE) -> torch.Tensor:
    """``model(x)`` with ``x`` zero-padded (the normalised mean) at the bottom and right to a
    multiple of ``multiple``, and the logits cropped back to ``x``'s size.

    >>> padded_forward(torch.nn.Conv2d(3, 2, 1), torch.zeros(1, 3, 40, 50)).shape
    torch.Size([1, 2, 40, 50])
    """
    height, width = x.shape[-2:]
    pad = (0, -width % multiple, 0, -height % multiple)
    if not any(pad):
        return model(x)
    return model(F.pad(x, pad))[..., :height, :width]


def probabilities_of(logits: torch.Tensor, multilabel: bool) -> torch.Tensor:
    """Each class's probability ``(N, classes, H, W)``: sigmoids, or the softmax without its
    background channel."""
    logits = logits.float()
    return torch.sigmoid(logits) if multilabel else torch.softmax(logits, 1)[:, 1:]


def class_planes(targets: torch.Tensor, multilabel: bool, classes: int) -> torch.Tensor:
    """Targets as ``(N, classes, H, W)`` booleans (a label map's class k is label k + 1)."""
    if multilabel:
        return targets.bool()
    return targets.unsqueeze(1) == torch.arange(1, classes + 1, device=targets.device).view(
        1, -1, 1, 1
    )


@dataclass
class CompetitionScores:
    """valid_loss (per-sample mean) and the competition's Dice per class at threshold 0.5: the
    mean over image-class pairs, an empty prediction of an empty mask scoring 1."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    names: list[str]
    multilabel: bool
    loss_sum: float = 0.0
    count: int = 0
    dice_sums: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logits = logits.float()
        n = len(targets)
        self.loss_sum += float(self.loss_fn(logits, targets)) * n
        self.count += n
        predicted = probabilities_of(logits, self.multilabel) > 0.5
        truth = class_planes(targets, self.multilabel, len(self.names))
        # Sums of each pair's Dice (float64): the means do not depend on the batches.
        dice = pair_dice(predicted.cpu().numpy(), truth.cpu().numpy()).sum(0)
        self.dice_sums = dice if not len(self.dice_sums) else self.dice_sums + dice

    def as_dict(self) -> dict[str, float]:
        if not self.count:
            return {"valid_loss": float("nan"), "dice": float("nan")}
        per_class = self.dice_sums / self.count
        row = {"valid_loss": self.loss_sum / self.count, "dice": float(per_class.mean())}
        return row | {f"dice_{n}": float(d) for n, d in zip(self.names, per_class, strict=True)}


def class_notes(train_items: RLEItems, valid_items: RLEItems) -> list[str]:
    """What the classes' masks say that changes what a run can learn, in words: a class with
    masks only among the validation images (never learnt), and a gap in Severstal's numeric
    class ids (no outputs, no submission rows, for the missing id).

    >>> from bigbatch.segmentation.rle import RLETable
    >>> table = RLETable("image_class", ["1", "2", "4"], {"a.png": {"1": "1 2"}, "b.png": {"4": "1 2"}})
    >>> train = RLEItems(table, [Path("a.png")], [(4, 4)], True)
    >>> class_notes(train, RLEItems(table, [Path("b.png")], [(4, 4)], True))[0][:46]
    'class 4 has masks only in the validation image'
    """
    table = train_items.table

    def with_masks(items: RLEItems) -> set[str]:
        return {
            c
            for path in items.images
            for c, rle in table.masks.get(path.name, {}).items()
            if rle.strip()
        }

    notes = []
    trained = with_masks(train_items)
    for c in sorted(with_masks(valid_items) - trained, key=table.classes.index):
        notes.append(
            f"class {c} has masks only in the validation images, none in training: the run "
            "cannot learn it; change seed= or valid_pct= to move some into training"
        )
    if table.layout == "image_class" and all(c.isdigit() for c in table.classes):
        ids = {int(c) for c in table.classes}
        gaps = sorted(set(range(1, max(ids) + 1)) - ids)
        if gaps:
            notes.append(
                f"class id(s) {', '.join(map(str, gaps))} have no mask in the CSV: the run "
                f"learns and submits classes {', '.join(table.classes)} only"
            )
    return notes


class KaggleSegmentationTask(SegmentationTask):
    """task=segmentation when ``data=`` is a Kaggle RLE CSV (chosen by its header)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.image_size = parse_size(self.options.image_size, "image_size")
        self.crop = parse_size(self.options.crop, "crop")
        self.mask_size = parse_size(self.options.mask_size, "mask_size")
        self.multilabel = True
        self.layout = ""
        self.shape: tuple[int, int] | None = None  # every image's, when they share one
        self.stored_shape: tuple[int, int] | None = None  # their own size, before image_size=

    def prepare(self, log: Log, data: Any = None) -> tuple[RLEItems, RLEItems]:
        cfg = self.cfg
        if self.options.loss in BATCH_LOSSES:
            raise ConfigError(
                f"loss={self.options.loss} couples the samples; RLE data trains per-sample "
                "losses: loss=dice_ce (Dice + cross-entropy), dice or ce"
            )
        if self.options.cache.strip().lower() not in ("auto", "none"):
            raise ConfigError(
                f"cache={self.options.cache}: RLE data is decoded and augmented per sample, not "
                "cached (cache= keeps image folders and volumes); drop cache="
            )
        if cfg.valid:
            raise ConfigError(
                "valid= is a second data set of image folders; an RLE CSV holds out its "
                "validation images with valid_pct= (e.g. valid_pct=0.2)"
            )
        if data is not None:
            train_items, valid_items = data
        else:
            items = scan_rle(cfg.data, cfg.image_root, self.options.labels)
            train_items, valid_items = split_items(items, cfg.valid_pct, cfg.seed)
        self.multilabel, self.layout = train_items.multilabel, train_items.table.layout
        self.classes = train_items.classes
        self.num_classes, self.dims, self.channels = train_items.num_classes, 2, 3
        shapes = set(train_items.shapes) | set(valid_items.shapes)
        self.stored_shape = next(iter(shapes)) if len(shapes) == 1 else None
        self.shape = self.image_size or self.stored_shape
        if self.shape is None and not self.crop:
            raise ConfigError(
                f"the images differ in size ({', '.join(f'{h}x{w}' for h, w in sorted(shapes)[:3])}"
                "): give image_size=HxW to resize them, or crop=HxW to train on crops"
            )
        if (
            self.crop
            and self.shape
            and (self.crop[0] > self.shape[0] or self.crop[1] > self.shape[1])
        ):
            raise ConfigError(
                f"crop={self.options.crop} is larger than the images ({self.shape[0]}x"
                f"{self.shape[1]}): give a crop within them"
            )
        kind = "overlapping classes (a sigmoid each)" if self.multilabel else "exclusive classes"
        at = f"{self.crop[0]}x{self.crop[1]} crops" if self.crop else "whole images"
        if self.shape:
            at += f" of {self.shape[0]}x{self.shape[1]}"
        log(
            f"data: {len(train_items)} training and {len(valid_items)} validation images from "
            f"{Path(cfg.data).name} ({self.layout} layout; {len(self.classes)} classes: "
            f"{', '.join(self.classes)}; {kind}), trained on {at} (size= is not used: "
            "image_size= resizes, crop= crops)"
        )
        converted = conversion_note(train_items.modes)
        if converted:
            log(f"data: {converted}")
        for note in class_notes(train_items, valid_items):
            log(f"data: {note}")
        return train_items, valid_items

    def input_shape(self) -> tuple[int, ...]:
        height, width = self.crop or self.shape or (self.cfg.size, self.cfg.size)
        return (3, height + -height % MULTIPLE, width + -width % MULTIPLE)

    def datasets(self, train_items: RLEItems, valid_items: RLEItems) -> tuple[Any, Any]:
        return (
            RLEDataset(
                train_items,
                train=True,
                augment=self.cfg.augment,
                image_size=self.image_size,
                crop=self.crop,
            ),
            RLEDataset(valid_items, train=False, augment=False, image_size=self.image_size),
        )

    def valid_shape(self, valid_items: RLEItems) -> ValidShape:
        """Whole images are validated, larger than training's crops: at ``image_size``, the
        images' shared size, or, where they differ, the largest of the validation images'
        headers (one at a time then: they cannot share a batch)."""
        sizes = [self.shape] if self.shape else list(valid_items.shapes)
        if not sizes:
            return ValidShape(self.input_shape())
        height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
        shape = (3, height + -height % MULTIPLE, width + -width % MULTIPLE)
        what = f"whole images of {'' if self.shape else 'up to '}{height}x{width}"
        return ValidShape(shape, what=what, largest=None if self.shape else 1)

    @property
    def couples_samples(self) -> bool:
        return False

    def step(self, model: nn.Module, micro: Any, where: Placement) -> tuple[torch.Tensor, Any]:
        x, y = micro
        with where.autocast():
            logits = padded_forward(model, where.inputs(x))
        return self.loss(logits, where.targets(y)), batch_len(x)

    def infer(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return padded_forward(model, x)

    def _loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        if self.multilabel:
            return multilabel_loss(MULTILABEL_NAMES.get(self.options.loss, "dice_bce"))
        return per_sample_loss(self.options.loss, num_classes=self.num_classes)

    def metrics(self) -> CompetitionScores:
        return CompetitionScores(self._loss_fn(), self.classes, self.multilabel)

    def scores(self, row: dict[str, Any]) -> str:
        per_class = " ".join(f"{n} {row[f'dice_{n}']:.3f}" for n in self.classes)
        return f"valid loss {row['valid_loss']:.4f}  dice {row['dice']:.4f} ({per_class})  "

    def run_info(self) -> dict[str, Any]:
        return super().run_info() | {
            "rle": {
                "layout": self.layout,
                "multilabel": self.multilabel,
                "image_size": list(self.image_size) if self.image_size else None,
                "mask_size": list(self.mask_size or self.shape or ()),
                # The training images' own size (None: they differ), to say which test images
                # differ from them.
                "stored_size": list(self.stored_shape) if self.stored_shape else None,
            },
            "multiple": MULTIPLE,
        }

    def finish(
        self, model: nn.Module, loader: Iterable[Any], where: Placement, run_dir: Path, log: Log
    ) -> None:
        """With the best epoch's weights, tune each class's threshold and smallest component on
        the validation set at the submission's mask size, by the competition's Dice, on the
        probabilities ``bigbatch predict`` gives by default (the image and its flip averaged);
        write ``postprocess.json``."""
        mask_size = self.mask_size or self.shape
        if mask_size is None:
            log("postprocess: images differ in size; give mask_size=HxW to tune the thresholds")
            return
        best = run_dir / "best.safetensors"
        if not best.is_file():
            return
        load_weights_file(model, best)  # the rules belong to the weights predict uses

        def forward(x: torch.Tensor) -> torch.Tensor:
            with where.autocast():
                return probabilities_of(self.infer(model, x), self.multilabel)

        probs, truth = [], []
        model.eval()
        with torch.no_grad():
            for x, y in loader:
                # The flips bigbatch predict averages by default (tta=2).
                p = with_tta(forward, where.inputs(x), 2).cpu()
                probs.append(resize_probabilities(p, mask_size).half().numpy())
                truth.append(
                    resize_masks(class_planes(y, self.multilabel, len(self.classes)), mask_size)
                )
        if not probs:
            return
        # float16: Clouds' 1,100 validation images x 4 classes at 350 x 525 take 1.6 GB so.
        rules, scores = tune_rules(np.concatenate(probs), np.concatenate(truth))
        save_rules(run_dir / "postprocess.json", self.classes, rules, scores.tolist(), mask_size)
        shown = ", ".join(
            f"{n} {r.threshold:.2f}/{r.min_size} px -> {s:.3f}"
            for n, r, s in zip(self.classes, rules, scores, strict=True)
        )
        log(
            f"postprocess.json at {mask_size[0]}x{mask_size[1]} (threshold/smallest component -> "
            f"validation Dice): {shown}; mean {float(np.mean(scores)):.4f}"
        )
