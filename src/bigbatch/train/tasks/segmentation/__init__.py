"""The segmentation task (2D and 3D): its data (``data``), prediction and the task itself."""

from bigbatch.train.tasks.segmentation.task import SegmentationTask

__all__ = ["SegmentationTask"]
