"""Image classification: a folder of class sub-folders or a CSV of ``file,label``; cross-entropy;
accuracy and error rate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.data import split_items
from bigbatch.train.tasks.base import Task
from bigbatch.train.tasks.classification.data import (
    ImageDataset,
    ImageFormat,
    ImageItems,
    build_transforms,
    class_counts,
    load_items,
    parse_window,
    resolve_data_config,
)
from bigbatch.train.tasks.classification.metrics import ClassificationMetrics
from bigbatch.train.tasks.classification.options import ClassificationOptions
from bigbatch.train.tasks.images import build_model, device_images

__all__ = ["ClassificationTask", "build_model", "prepare_data"]

Log = Callable[[str], None]


def prepare_data(cfg: TrainConfig, log: Log = print) -> tuple[ImageItems, ImageItems]:
    items = load_items(cfg.data, cfg.image_root, bad_images=cfg.options.bad_images)
    if cfg.valid:
        valid = load_items(
            cfg.valid, cfg.image_root, classes=items.classes, bad_images=cfg.options.bad_images
        )
        train_items = items
    else:
        train_items, valid = split_items(items, cfg.valid_pct, cfg.seed)
        valid.skipped = []
    # One format for both: greyscale if both are (and the model is timm's, whose stem takes
    # in_chans=1; a model= factory builds its own 3-channel stem), floats if either is wide.
    fmt = ImageFormat(
        grey=not cfg.model and train_items.format.grey and (valid.format.grey or not len(valid)),
        wide=train_items.format.wide or valid.format.wide,
        scale=max(train_items.format.scale, valid.format.scale),
        window=parse_window(cfg.options.window),
    )
    train_items.format = valid.format = fmt
    if fmt.wide and cfg.options.auto_augment:
        raise ConfigError(
            f"auto_augment={cfg.options.auto_augment} works on 8-bit images (its operations are PIL's); "
            "these are 16-bit, float or DICOM: drop auto_augment (crops and flips still apply)"
        )
    skipped = items.skipped + (valid.skipped if cfg.valid else [])
    if skipped:
        log(
            f"skipped {len(skipped)} unreadable image(s), e.g. {skipped[0][0]} ({skipped[0][1][:80]})"
        )
    if len(valid) == 0:
        log(
            "no validation set (valid_pct=0 and no valid=): no validation metrics; "
            "best.safetensors is chosen by train_loss"
        )
    counts = class_counts(train_items)
    kind = ("greyscale" if fmt.grey else "colour") + (
        f", read as floats (/{fmt.scale:g})" if fmt.scale else ", DICOM" if fmt.wide else ""
    )
    log(
        f"data: {len(train_items)} training and {len(valid)} validation images ({kind}), "
        f"{len(items.classes)} classes ({', '.join(f'{k}: {v}' for k, v in list(counts.items())[:6])}"
        f"{', ...' if len(counts) > 6 else ''})"
    )
    return train_items, valid


class ClassificationTask(Task):
    name = "classification"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.options = cast(ClassificationOptions, cfg.options)  # its own keys
        self.classes: list[str] = []
        self.class_weights: torch.Tensor | None = None
        self.format = ImageFormat()
        self.data: dict[str, Any] = {}  # the model's data config (timm's), saved in task.json
        self._factory: Callable[[], nn.Module] | None = None

    def prepare(self, log: Log, data: Any = None) -> tuple[ImageItems, ImageItems]:
        train_items, valid_items = data if data is not None else prepare_data(self.cfg, log)
        self.classes, self.format = train_items.classes, train_items.format
        self.data = resolve_data_config(self.model_factory(), self.format.channels)
        if self.options.class_weights == "auto":
            counts = torch.tensor(list(class_counts(train_items).values()), dtype=torch.float64)
            # Inverse frequency, normalised so a balanced set weighs every sample 1.
            weights = counts.sum() / (len(counts) * counts.clamp(min=1))
            self.class_weights = weights.float()
            shown = ", ".join(
                f"{c} {w:.2f}" for c, w in zip(self.classes, weights.tolist(), strict=True)
            )
            log(f"class weights (inverse frequency): {shown[:200]}")
        return train_items, valid_items

    def model_factory(self) -> Callable[[], nn.Module]:
        if self._factory is None:  # once: pretrained weights are resolved when it is made
            self._factory = build_model(self.cfg, len(self.classes), self.format.channels)
        return self._factory

    def input_shape(self) -> tuple[int, ...]:
        return (self.format.channels, self.cfg.size, self.cfg.size)

    def datasets(self, train_items: ImageItems, valid_items: ImageItems) -> tuple[Any, Any]:
        cfg, fmt = self.cfg, self.format
        common: dict[str, Any] = {"data": self.data, "fmt": fmt}
        train_tf = build_transforms(
            cfg.size,
            cfg.options.item_transform,
            train=True,
            augment=cfg.augment,
            auto_augment=cfg.options.auto_augment,
            **common,
        )
        valid_tf = build_transforms(
            cfg.size, cfg.options.item_transform, train=False, augment=False, **common
        )
        return (
            ImageDataset(train_items.files, train_items.labels, train_tf, fmt),
            ImageDataset(valid_items.files, valid_items.labels, valid_tf, fmt),
        )

    def device_images(self, train_ds: Any) -> Any:
        return device_images(train_ds, self.cfg, self.data, self.options.auto_augment)

    def transform_window(
        self, window: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixup/CutMix over the whole window (timm's ``Mixup``), before it is split into
        micro-batches: each micro-batch then holds exactly the samples the big batch would have
        mixed, and the soft-target loss is a per-sample mean, so accumulation stays exact."""
        x, y = window
        if not (self.options.mixup or self.options.cutmix) or len(y) < 2:
            return x, y
        from timm.data import Mixup

        mixer = Mixup(
            mixup_alpha=self.options.mixup,
            cutmix_alpha=self.options.cutmix,
            label_smoothing=self.options.label_smoothing,
            num_classes=len(self.classes),
        )
        # timm draws from numpy's global generator: seeded here from torch's, so a seed (and a
        # resumed run, which restores torch's state) replays the same mixing.
        np.random.seed(int(torch.randint(0, 2**31 - 1, ())))
        even = len(y) // 2 * 2  # timm pairs samples: an odd last one stays as it is
        mixed_x, soft = mixer(x[:even].clone(), y[:even])
        if even == len(y):
            return mixed_x, soft
        rest = F.one_hot(y[even:], len(self.classes)).float()
        rest = rest * (1 - self.options.label_smoothing) + self.options.label_smoothing / len(
            self.classes
        )
        return torch.cat([mixed_x, x[even:]]), torch.cat([soft, rest])

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy (with ``label_smoothing`` and ``class_weights``) as a plain mean over
        the samples: torch's weighted mean divides by the batch's summed weights instead, which
        would make the micro-batches' losses unequal parts of the window's."""
        smoothing = self.options.label_smoothing if targets.dim() == 1 else 0.0  # mixup smoothed
        # 16-bit logits (autocast) are summed in float32; float64 ones keep their precision.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        per_sample = F.cross_entropy(logits, targets, reduction="none", label_smoothing=smoothing)
        if self.class_weights is not None and targets.dim() == 1:
            per_sample = per_sample * self.class_weights.to(per_sample.device)[targets]
        elif self.class_weights is not None:  # soft targets (mixup): the expected weight
            per_sample = per_sample * (targets @ self.class_weights.to(targets.device))
        return per_sample.mean()

    def metrics(self) -> ClassificationMetrics:
        return ClassificationMetrics(len(self.classes), self.classes)

    def scores(self, row: dict[str, Any]) -> str:
        return f"valid loss {row['valid_loss']:.4f}  accuracy {row['accuracy']:.4f}  "

    def run_info(self) -> dict[str, Any]:
        info = {"task": self.name, "classes": self.classes, "format": self.format.to_dict()}
        return info | ({"data": self.data} if self.data else {})
