"""Segmentation of 2D images and 3D volumes: U-Nets, BCE / Dice / BCE + Dice (per sample, so
accumulation stays exact), Dice and Jaccard summed over the validation set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bigbatch.segmentation.losses import bce_dice_loss, dice_loss, seg_bce_loss
from bigbatch.segmentation.metrics import SegmentationMetrics
from bigbatch.segmentation.models import UNet, timm_unet
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.data import split_items
from bigbatch.train.tasks.segmentation.data import SegDataset, SegItems, scan_segmentation
from bigbatch.train.tasks.user_model import load_user_model

__all__ = ["SegmentationTask", "SegmentationValidation", "build_seg_model"]

Log = Callable[[str], None]

LOSSES = {"bce_dice": bce_dice_loss, "dice": dice_loss, "bce": seg_bce_loss}
UNET_DEPTH = 3  # spatial sizes must divide by 2 ** depth


def build_seg_model(
    cfg: TrainConfig, in_channels: int, num_classes: int, dims: int
) -> Callable[[], nn.Module]:
    """arch=unet: bigbatch's GroupNorm U-Net (2D or 3D); any other name: a timm encoder under a
    U-Net decoder (2D); model=module:factory(in_channels, num_classes) for your own."""
    if cfg.model:
        user = load_user_model(cfg.model)
        return lambda: user(in_channels, num_classes)
    if cfg.arch == "unet":
        return lambda: UNet(in_channels, num_classes, dims=dims, depth=UNET_DEPTH)  # type: ignore[arg-type]
    if dims == 3:
        raise ConfigError(
            f"arch={cfg.arch}: timm encoders are 2D; train volumes with arch=unet (bigbatch's 3D "
            "U-Net) or model=module:factory"
        )

    return lambda: timm_unet(
        cfg.arch, in_channels=in_channels, num_classes=num_classes, pretrained=cfg.pretrained
    )


@dataclass
class SegmentationValidation:
    """valid_loss (per-sample mean, weighted by samples), Dice and Jaccard over the whole set."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    overlap: SegmentationMetrics
    loss_sum: float = 0.0
    count: int = 0
    names: list[str] = field(default_factory=list)

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logits = logits.float()
        self.loss_sum += float(self.loss_fn(logits, targets)) * len(targets)
        self.count += len(targets)
        self.overlap.update(logits.cpu(), targets.cpu())

    def as_dict(self) -> dict[str, float]:
        scores = self.overlap.compute()
        row: dict[str, float] = {
            "valid_loss": self.loss_sum / self.count if self.count else float("nan"),
            "dice": float(scores["dice"]),  # type: ignore[arg-type]
            "jaccard": float(scores["jaccard"]),  # type: ignore[arg-type]
        }
        per_class = scores["dice_per_class"]
        if len(self.names) > 1:
            row |= {f"dice_{n}": float(d) for n, d in zip(self.names, per_class, strict=True)}  # type: ignore[call-overload]
        return row


class SegmentationTask:
    name = "segmentation"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.classes: list[str] = []
        self.num_classes = 1
        self.dims = 2
        self.channels = 3

    def prepare(self, log: Log, data: Any = None) -> tuple[SegItems, SegItems]:
        cfg = self.cfg
        if data is not None:
            train_items, valid_items = data
        else:
            items = scan_segmentation(cfg.data, cfg.image_root, cfg.num_classes)
            if cfg.valid:
                valid_items = scan_segmentation(cfg.valid, cfg.image_root, items.num_classes)
                train_items = items
            else:
                train_items, valid_items = split_items(items, cfg.valid_pct, cfg.seed)
        self.num_classes, self.dims = train_items.num_classes, train_items.dims
        self.channels, self.classes = train_items.channels, train_items.classes
        factor = 2**UNET_DEPTH
        if cfg.size % factor:
            raise ConfigError(
                f"size={cfg.size}: a U-Net halves the size {UNET_DEPTH} times, so it must divide "
                f"by {factor}; use size={cfg.size // factor * factor or factor}"
            )
        kind = "binary" if self.num_classes == 1 else f"{self.num_classes} classes"
        what = "images" if self.dims == 2 else "volumes"
        shape = "x".join([str(cfg.size)] * self.dims)
        log(
            f"data: {len(train_items)} training and {len(valid_items)} validation {what} "
            f"({self.channels} channel(s), {kind}), trained at {shape}"
        )
        return train_items, valid_items

    def model_factory(self) -> Callable[[], nn.Module]:
        return build_seg_model(self.cfg, self.channels, self.num_classes, self.dims)

    def input_shape(self) -> tuple[int, ...]:
        return (self.channels, *[self.cfg.size] * self.dims)

    def datasets(self, train_items: SegItems, valid_items: SegItems) -> tuple[Any, Any]:
        size, augment = self.cfg.size, self.cfg.augment
        return (
            SegDataset(train_items, size, train=True, augment=augment),
            SegDataset(valid_items, size, train=False, augment=False),
        )

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return LOSSES[self.cfg.loss](logits.float(), targets)

    def metrics(self) -> SegmentationValidation:
        return SegmentationValidation(
            LOSSES[self.cfg.loss], SegmentationMetrics(self.num_classes), names=self.classes
        )

    def scores(self, row: dict[str, Any]) -> str:
        return (
            f"valid loss {row['valid_loss']:.4f}  dice {row['dice']:.4f}  "
            f"jaccard {row['jaccard']:.4f}  "
        )

    def run_info(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "classes": self.classes,
            "num_classes": self.num_classes,
            "dims": self.dims,
            "channels": self.channels,
        }
