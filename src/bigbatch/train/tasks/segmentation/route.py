"""``task=segmentation``: a Kaggle RLE CSV (told by its header, read once here) is read as the
competitions ship it; anything else is a folder or CSV of image and mask files."""

from __future__ import annotations

from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.tasks.base import Task
from bigbatch.train.tasks.segmentation.kaggle import KaggleSegmentationTask
from bigbatch.train.tasks.segmentation.rle_data import is_rle_csv
from bigbatch.train.tasks.segmentation.task import SegmentationTask

__all__ = ["segmentation_task"]

RLE_ONLY = ("labels", "image_size", "crop", "mask_size")  # keys only an RLE CSV's task reads


def segmentation_task(cfg: TrainConfig) -> Task:
    """The segmentation task for ``cfg.data``. The keys of a Kaggle RLE CSV alone, set for
    files of images and masks, are refused (they would be ignored)."""
    if is_rle_csv(cfg.data):
        return KaggleSegmentationTask(cfg)
    given = cfg.options.changed(*RLE_ONLY)
    if given:
        raise ConfigError(
            f"{', '.join(given)}: for a Kaggle RLE CSV (image ids and EncodedPixels), and "
            f"data={cfg.data} is files of images and masks, trained at size={cfg.size}: drop "
            f"{'them' if len(given) > 1 else 'it'}"
        )
    return SegmentationTask(cfg)
