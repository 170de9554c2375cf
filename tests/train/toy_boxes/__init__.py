"""A third training task in one folder: box regression with a list of boxes per image.

It exists to prove the training half's promise: a task whose batches are not ``(x, y)``
tensors (per-image target lists, a loss averaged over boxes rather than images) trains through
:func:`bigbatch.train.loop.train` from this folder plus one ``register_task`` line, touching no
other file. Its own configuration key (``max_boxes``) is a dataclass beside it.
"""

from bigbatch.train.registry import TaskEntry
from bigbatch.train.tasks import register_task
from toy_boxes.task import ToyBoxes, ToyBoxesOptions

__all__ = ["ENTRY", "ToyBoxes", "register"]

# What an installed package points its ``bigbatch.tasks`` entry point at: every part a
# reference, loaded when the task is chosen.
ENTRY = TaskEntry(
    "toy_boxes",
    "toy_boxes.task:ToyBoxes",
    ("box_l1",),
    frozenset({"box_l1"}),
    predict="toy_boxes.task:predict_run",
    options="toy_boxes.task:ToyBoxesOptions",
    summary="boxes of generated squares",
    data_help="the word generated",
    ensemble="toy_boxes.task:ensemble_run",
)


def register() -> None:
    """The one registry line (its own options, metrics and their direction)."""
    register_task(
        "toy_boxes",
        ToyBoxes,
        metrics=("box_l1",),
        lower_is_better=("box_l1",),
        options=ToyBoxesOptions,
    )
