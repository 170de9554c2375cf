"""Image classification: a folder of class sub-folders or a CSV of ``file,label``; cross-entropy;
accuracy and error rate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.models import UnknownArchitectureError, timm_factory
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.data import split_items
from bigbatch.train.tasks.classification.data import (
    ImageDataset,
    ImageItems,
    build_transforms,
    class_counts,
    load_items,
)
from bigbatch.train.tasks.classification.metrics import ClassificationMetrics
from bigbatch.train.tasks.user_model import load_user_model

__all__ = ["ClassificationTask", "build_model", "prepare_data"]

Log = Callable[[str], None]


def build_model(cfg: TrainConfig, num_classes: int) -> Callable[[], nn.Module]:
    """A zero-argument factory for the configured model (timm by name, or module:factory)."""
    if cfg.model:
        user = load_user_model(cfg.model)

        def build_user() -> nn.Module:
            return user(num_classes)

        return build_user

    try:
        return timm_factory(
            cfg.arch,
            num_classes=num_classes,
            img_size=cfg.size,
            weights=cfg.weights or None,
            pretrained=cfg.pretrained,
        )
    except (UnknownArchitectureError, ValueError) as exc:  # an unknown name, unreadable weights
        raise ConfigError(str(exc)) from exc


def prepare_data(cfg: TrainConfig, log: Log = print) -> tuple[ImageItems, ImageItems]:
    items = load_items(cfg.data, cfg.image_root, bad_images=cfg.bad_images)
    if cfg.valid:
        valid = load_items(
            cfg.valid, cfg.image_root, classes=items.classes, bad_images=cfg.bad_images
        )
        train_items = items
    else:
        train_items, valid = split_items(items, cfg.valid_pct, cfg.seed)
        valid.skipped = []
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
    log(
        f"data: {len(train_items)} training and {len(valid)} validation images, "
        f"{len(items.classes)} classes ({', '.join(f'{k}: {v}' for k, v in list(counts.items())[:6])}"
        f"{', ...' if len(counts) > 6 else ''})"
    )
    return train_items, valid


class ClassificationTask:
    name = "classification"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.classes: list[str] = []
        self.class_weights: torch.Tensor | None = None

    def prepare(self, log: Log, data: Any = None) -> tuple[ImageItems, ImageItems]:
        train_items, valid_items = data if data is not None else prepare_data(self.cfg, log)
        self.classes = train_items.classes
        if self.cfg.class_weights == "auto":
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
        return build_model(self.cfg, len(self.classes))

    def input_shape(self) -> tuple[int, ...]:
        return (3, self.cfg.size, self.cfg.size)

    def datasets(self, train_items: ImageItems, valid_items: ImageItems) -> tuple[Any, Any]:
        cfg = self.cfg
        train_ds = ImageDataset(
            train_items.files,
            train_items.labels,
            build_transforms(cfg.size, cfg.item_transform, train=True, augment=cfg.augment),
        )
        valid_ds = ImageDataset(
            valid_items.files,
            valid_items.labels,
            build_transforms(cfg.size, cfg.item_transform, train=False, augment=False),
        )
        return train_ds, valid_ds

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy (with ``label_smoothing`` and ``class_weights``) as a plain mean over
        the samples: torch's weighted mean divides by the batch's summed weights instead, which
        would make the micro-batches' losses unequal parts of the window's."""
        per_sample = F.cross_entropy(
            logits.float(), targets, reduction="none", label_smoothing=self.cfg.label_smoothing
        )
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
        return {"task": self.name, "classes": self.classes}
