"""The classification task: its data (``data``), metrics, prediction and the task itself."""

from bigbatch.train.tasks.classification.task import ClassificationTask, build_model, prepare_data

__all__ = ["ClassificationTask", "build_model", "prepare_data"]
