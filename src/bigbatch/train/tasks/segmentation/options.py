"""Segmentation's own configuration keys (``cfg.options``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bigbatch.train.tasks.options import TaskOptions, option

__all__ = ["LOSSES", "SegmentationOptions", "SegmentationPredictOptions"]

# MONAI's losses per sample, then the batch forms that couple the samples (gradient caching).
LOSSES = ("dice_ce", "dice", "dice_focal", "ce", "dice_batch", "dice_ce_batch")
RLE_ONLY = ("labels", "image_size", "crop", "mask_size")  # keys only an RLE CSV's task reads


@dataclass
class SegmentationOptions(TaskOptions):
    fine_tunes_head: ClassVar[bool] = False  # a decoder's last layer is no classifier head

    loss: str = option(
        "dice_ce",
        "MONAI's loss, per sample (exact under accumulation): dice_ce, dice, dice_focal or ce; "
        "dice_batch and dice_ce_batch couple the samples and train through gradient caching "
        "(exact, one more forward)",
        choices=LOSSES,
    )
    num_classes: int = option(0, "classes: 0 infers them from the masks (0/1 or 0/255: binary)")
    encoder: str = option(
        "",
        "2D: a timm encoder (e.g. efficientnet_b0) under arch's decoder from "
        "segmentation_models_pytorch: arch=unet, unetplusplus, fpn or deeplabv3plus; "
        "pretrained=true loads the encoder's weights through the Hugging Face cache; empty: "
        "arch is MONAI's network (or a timm name: a U-Net on that encoder)",
    )
    widths: str = option(
        "",
        "channels per level of a MONAI network, e.g. 16,32,64,128 (their number is the depth); "
        "empty: the network's default",
    )
    norm: str = option(
        "instance",
        "normalisation of a MONAI network: instance (exact under accumulation), group, or batch "
        "(inexact: see freeze_bn)",
        choices=("instance", "group", "batch"),
    )
    spacing: str = option(
        "",
        "resample volumes to this voxel size in mm (e.g. 1,1,1), from each NIfTI header, after "
        "orienting them to RAS; empty: as stored",
    )
    pos_neg: float = option(
        1.0,
        "odds of a training patch centred on a labelled voxel against one centred on "
        "background (MONAI's pos/neg ratio)",
    )
    ignore_index: int = option(
        255,
        "the void label, counted in no loss or score (255 by default; masks of only 0 and 255 "
        "are binary); -1: none",
    )
    palette: str = option(
        "",
        "the colours of RGB masks, one R,G,B per class, class 0 first: 0,0,0;255,0,0;0,255,0",
    )
    cache: str = option(
        "auto",
        "image folders and volumes: keep each case in memory after its deterministic "
        "preprocessing (reading, resampling, normalising; MONAI's CacheDataset), so epochs run "
        "only the random part: auto (up to a quarter of the free memory), none, or a size (8GB)",
    )
    labels: str = option(
        "auto",
        "Kaggle RLE CSV data: multilabel (a sigmoid per class, Dice + BCE per class; classes "
        "may overlap), exclusive (one label per pixel, background included) or auto "
        "(multilabel when a pixel carries two classes)",
        choices=("auto", "multilabel", "exclusive"),
    )
    image_size: str = option(
        "",
        "RLE CSV data: train and validate at HxW (e.g. 704x1056; masks resized by nearest "
        "neighbour); empty: the images' own size (full resolution)",
    )
    crop: str = option(
        "",
        "RLE CSV data: train on random HxW crops (e.g. 512x512) of the images; validation "
        "sees whole images; empty: whole images",
    )
    mask_size: str = option(
        "",
        "RLE CSV data: the submission's mask size HxW (Clouds: 350x525), at which the "
        "per-class thresholds and smallest components are tuned after training "
        "(postprocess.json); empty: the images' size",
    )
    regions: str = option(
        "",
        "score unions of labels as structures, e.g. wt:1,2,3;tc:1,3;et:3 (BraTS's nested regions)",
    )

    def check(self, cfg: Any) -> None:
        if cfg.mode == "fine_tune":
            raise ValueError(
                "mode=fine_tune trains a classifier's head alone first; segmentation trains "
                "every layer (from weights= or pretrained= when given): use mode=auto or fit"
            )
        if self.num_classes < 0:
            raise ValueError(
                f"num_classes must be >= 0 (0: from the masks), got {self.num_classes}"
            )
        if self.cache.strip().lower() not in ("auto", "none"):
            from bigbatch.memory.budget import parse_bytes

            try:
                parse_bytes(self.cache)
            except ValueError:
                raise ValueError(
                    f"cache={self.cache!r}: give auto, none or a size such as 8GB"
                ) from None
        if self.pos_neg < 0:
            raise ValueError(
                f"pos_neg must be >= 0 (0: background centres only), got {self.pos_neg}"
            )

    def check_read(self, cfg: Any) -> None:
        """The keys of a Kaggle RLE CSV for files of images and masks, and those of the
        networks bigbatch builds where another network is built: refused, not ignored."""
        from bigbatch.segmentation.networks import MONAI_ARCHS
        from bigbatch.train.tasks.segmentation.rle_data import is_rle_csv

        given = self.changed(*RLE_ONLY)
        if given and Path(cfg.data).exists() and not is_rle_csv(cfg.data):
            raise ValueError(
                f"{', '.join(given)}: for a Kaggle RLE CSV (image ids and EncodedPixels), and "
                f"data={cfg.data} is files of images and masks, trained at size={cfg.size}: drop "
                f"{'them' if len(given) > 1 else 'it'}"
            )

        unread = self.changed("encoder", "widths", "norm") if cfg.model else []
        if unread:
            raise ValueError(
                f"{', '.join(unread)}: for the networks bigbatch builds, and model={cfg.model} "
                f"builds your own: drop {'them' if len(unread) > 1 else 'it'}"
            )
        if (self.encoder or cfg.arch not in MONAI_ARCHS) and self.changed("widths"):
            named = f"arch={cfg.arch}" + (f" encoder={self.encoder}" if self.encoder else "")
            raise ValueError(
                f"widths={self.widths}: the channels of MONAI's networks, and {named} is "
                "segmentation_models_pytorch's decoder on a timm encoder, whose channels are "
                "the encoder's: drop widths, or train one of MONAI's networks"
            )


@dataclass
class SegmentationPredictOptions(TaskOptions):
    """``bigbatch predict``'s options for a segmentation run (``--patch``, ``--overlap``,
    ``--mask-size``), declared as its training keys are."""

    patch: int = option(
        0,
        "volumes: the edge of the overlapping windows (a multiple of the network's stride); "
        "0: the training patch size",
    )
    overlap: float = option(0.5, "volumes: how much neighbouring windows overlap (0 to <1)")
    mask_size: str = option(
        "",
        "a run trained on a Kaggle RLE CSV: the submission's masks as HEIGHTxWIDTH (e.g. "
        "350x525); empty: the size its postprocess.json was tuned at",
    )
