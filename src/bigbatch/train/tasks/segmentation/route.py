"""``task=segmentation``: a Kaggle RLE CSV (told by its header) is read as the
competitions ship it; anything else is a folder or CSV of image and mask files."""

from __future__ import annotations

from bigbatch.train.config import TrainConfig
from bigbatch.train.tasks.base import Task
from bigbatch.train.tasks.segmentation.kaggle import KaggleSegmentationTask
from bigbatch.train.tasks.segmentation.rle_data import is_rle_csv
from bigbatch.train.tasks.segmentation.task import SegmentationTask

__all__ = ["segmentation_task"]


def segmentation_task(cfg: TrainConfig) -> Task:
    """The segmentation task for ``cfg.data``: a Kaggle RLE CSV's, or that of files of images
    and masks (the keys of an RLE CSV alone are refused for those by the options' checks)."""
    if is_rle_csv(cfg.data):
        return KaggleSegmentationTask(cfg)
    return SegmentationTask(cfg)
