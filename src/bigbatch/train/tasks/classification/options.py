"""Image classification's own configuration keys (``cfg.options``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bigbatch.train.tasks.options import TaskOptions, option

__all__ = ["ClassificationOptions"]

# timm's augmentation policies, by the prefix of their names.
AUTO_AUGMENT_PREFIXES = ("rand", "augmix", "original", "v0", "3a", "trivial")


@dataclass
class ClassificationOptions(TaskOptions):
    item_transform: str = option(
        "squish",
        "squish: resize to size x size; crop: resize, then centre crop",
        choices=("squish", "crop"),
    )
    label_smoothing: float = option(
        0.0, "the share of each target spread over the other classes (0.1 is common); 0: none"
    )
    class_weights: str = option(
        "none",
        "auto weighs each sample by its class's inverse frequency (imbalanced data); none",
        choices=("none", "auto"),
    )
    auto_augment: str = option(
        "",
        "timm's augmentation policy for 8-bit images, e.g. rand-m9-mstd0.5 (RandAugment), "
        "trivialaugment; empty: crops and flips only",
    )
    mixup: float = option(
        0.0,
        "Mixup's Beta alpha (0.2-0.8 is common), mixing over each whole window so accumulation "
        "stays exact; 0: off",
    )
    cutmix: float = option(
        0.0, "CutMix's Beta alpha (1.0 is common), as mixup; both set: one or the other per window"
    )
    window: str = option(
        "",
        "DICOM's intensity window centre,width (e.g. 40,400 for CT soft tissue in HU); empty: "
        "the header's",
    )
    bad_images: str = option(
        "skip",
        "unreadable images: skip (and count them) or error",
        choices=("skip", "error"),
        trains=False,
    )

    def check(self, cfg: Any) -> None:
        if self.mixup < 0 or self.cutmix < 0:
            raise ValueError(
                f"mixup and cutmix are Beta alphas >= 0 (0: off), got {self.mixup}, {self.cutmix}"
            )
        if self.auto_augment and not self.auto_augment.startswith(AUTO_AUGMENT_PREFIXES):
            raise ValueError(
                f"auto_augment={self.auto_augment!r}: give a timm policy, e.g. rand-m9-mstd0.5 "
                "(RandAugment), trivialaugment, augmix-m5-w3"
            )
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")

    def check_read(self, cfg: Any) -> None:
        if self.auto_augment and not cfg.augment:  # timm's policy runs with the crops alone
            raise ValueError(
                f"auto_augment={self.auto_augment} augments the training images, and "
                "augment=false turns augmentation off: drop one of them"
            )
