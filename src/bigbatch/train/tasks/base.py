"""The base class of a training task: everything the loop and the planner assume about a batch,
with defaults for a task whose windows are ``(inputs, targets)`` tensors.

A task subclasses :class:`Task`, fills in its data, model, loss and metrics, and overrides a
default only where its batches differ: per-image target lists (``collate``, ``split``,
``step``), Mixup over the window (``transform_window``), sliding-window validation
(``infer``), a loss that couples the samples (``couples_samples``). The loop calls these and
never asks which task it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from bigbatch.backoff import EvalBackoff, infer_fitting
from bigbatch.batching import batch_len, split_batch
from bigbatch.device import autocast_for

__all__ = ["Log", "Metrics", "Placement", "Task", "ValidShape", "inference_placement"]

Log = Callable[[str], None]


class Metrics(Protocol):
    """Validation metrics accumulated over batches by count (never a mean of batch means);
    ``as_dict`` returns ``valid_loss`` and every name the task declares in its metrics.

    >>> class MeanError:
    ...     def __init__(self):
    ...         self.total, self.count = 0.0, 0
    ...     def update(self, logits, targets):
    ...         self.total += float((logits - targets).abs().sum())
    ...         self.count += len(targets)
    ...     def as_dict(self):
    ...         mean = self.total / max(self.count, 1)
    ...         return {"valid_loss": mean, "mae": mean}
    >>> tally = MeanError(); tally.update(torch.ones(4), torch.zeros(4)); tally.as_dict()["mae"]
    1.0
    """

    def update(self, logits: torch.Tensor, targets: Any) -> None: ...

    def as_dict(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class Placement:
    """Where the loop runs a step: the device, the precision's autocast and the inputs' memory
    format (channels_last where it pays). The loop decides these; a task's ``step`` and
    ``evaluate`` use them rather than deciding again.

    >>> where = Placement(torch.device("cpu"))
    >>> where.inputs(torch.zeros(2, 3)).device.type
    'cpu'
    """

    device: torch.device
    precision: str = "fp32"
    memory_format: torch.memory_format = torch.contiguous_format
    cudnn_benchmark: bool = False  # cuDNN times its convolution algorithms (cudnn_benchmark=)

    def inputs(self, x: Any) -> Any:
        """A batch's inputs on the device (each tensor of a tuple, list or dict too), in the
        memory format the model was placed in."""
        return tree_map_only(
            torch.Tensor,
            lambda t: t.to(self.device, non_blocking=True, memory_format=self.memory_format),
            x,
        )

    def targets(self, y: Any) -> Any:
        """A batch's targets on the device: a tensor, or per-sample lists of them."""
        return tree_map_only(torch.Tensor, lambda t: t.to(self.device, non_blocking=True), y)

    def autocast(self) -> AbstractContextManager[Any]:
        """The forward pass's autocast (none at fp32); losses run outside it, in float32."""
        return autocast_for(self.precision, self.device.type)


def inference_placement(
    model: nn.Module, cfg: Any, device: torch.device
) -> tuple[nn.Module, Placement]:
    """A trained run's ``model`` on ``device`` in eval mode, and the :class:`Placement` its
    forward passes without gradients take there, as its validation ran them: NHWC where that
    pays (:func:`~bigbatch.train.runtime.place_model`), in the run's autocast
    (:func:`~bigbatch.train.runtime.inference_precision`: fp32 for an fp16 run on a CPU).

    >>> from bigbatch.train.config import TrainConfig
    >>> model, where = inference_placement(nn.Linear(2, 2), TrainConfig(), torch.device("cpu"))
    >>> where.precision, model.training
    ('fp32', False)
    """
    from bigbatch.train.runtime import inference_precision, place_model

    model, memory_format = place_model(model, cfg.channels_last, device)
    precision = inference_precision(cfg.precision, device)
    return model.eval(), Placement(device, precision, memory_format)


@dataclass(frozen=True)
class ValidShape:
    """What validation's forward passes meet, for their plan (:meth:`Task.valid_shape`): one
    input's shape (the largest in the validation set), bytes held on the device beside each
    batch (a whole volume's input and logits while its sliding-window patches run), what the
    shape is (for the log), and the most inputs one forward pass may take (None: any).

    >>> ValidShape((3, 512, 512), what="whole images").shape
    (3, 512, 512)
    """

    shape: tuple[int, ...]
    held_bytes: int = 0
    what: str = "the training input"
    largest: int | None = None


class Task:
    """What a training task owns besides the loop: subclass it, fill in the methods that raise
    :class:`NotImplementedError`, and register it with
    :func:`bigbatch.train.tasks.register_task`.

    The defaults suit windows of ``(inputs, targets)`` tensors that share their first
    dimension, with a loss that is a mean of per-sample terms.

    >>> class Constant(Task):
    ...     name = "constant"
    ...     def loss(self, logits, targets):
    ...         return (logits - targets).pow(2).mean()
    >>> task, model = Constant(), torch.nn.Linear(3, 1)
    >>> loss, count = task.step(model, (torch.ones(4, 3), torch.zeros(4, 1)), Placement(torch.device("cpu")))
    >>> count
    4
    """

    name: str = ""
    # A task with classes sets its own list in prepare(); one without (regression) has none.
    classes: Sequence[str] = ()
    # What ``task=module:Class`` reads of the class (a registered task's entry says these):
    # its metrics' names and those where lower is better, its options dataclass, its data's
    # help, and ``predict_run(request)`` / ``ensemble_runs(request)`` as static methods.
    metric_names: ClassVar[tuple[str, ...]] = ()
    lower_is_better_names: ClassVar[tuple[str, ...]] = ()
    # Metrics that are fractions of 1 (F2, accuracy), plotted together in history.png.
    fraction_names: ClassVar[tuple[str, ...]] = ()
    options_class: ClassVar[type | None] = None
    data_help: ClassVar[str] = ""

    def __init__(self, cfg: Any = None) -> None:
        """Keep the run's configuration (:class:`~bigbatch.train.config.TrainConfig`; its
        task's own keys are ``cfg.options``). A subclass that needs no set-up of its own need
        not define ``__init__``; one that does calls ``super().__init__(cfg)``."""
        self.cfg = cfg

    def valid_shape(self, valid_items: Any) -> ValidShape:
        """What validation's forward passes meet (:class:`ValidShape`), found from the items'
        headers, not by decoding them: the planner sizes validation's batch for it. By default
        the training input (:meth:`input_shape`), which suits a task that resizes every image."""
        return ValidShape(self.input_shape())

    def use_valid_batch(self, planned: int) -> int:
        """Take validation's planned batch (forward passes of ``planned`` inputs); returns the
        validation loader's batch. A task whose forward passes are not the loader's batches
        (sliding windows over whole volumes, one volume at a time) keeps ``planned`` for them."""
        return planned

    @property
    def couples_samples(self) -> bool:
        """The loss couples the samples (a batch Dice): the loop runs each window through
        gradient caching (:func:`bigbatch.backoff.run_coupled_window`), and the plan leaves room
        for what that holds (:meth:`window_cache_bytes`). Such a task's windows are
        ``(inputs, targets)``."""
        return False

    @property
    def loss_name(self) -> str:
        return type(self).__name__

    @property
    def collate(self) -> Callable[[list[Any]], Any] | None:
        """How the loader joins samples into a batch (None: torch's ``default_collate``); a
        module-level function, so that loader workers can be spawned with it."""
        return None

    def device_images(self, train_ds: Any) -> Any:
        """The training set decoded and augmented on the device (``decode=gpu``): a pair of
        :class:`~bigbatch.train.tasks.device_images.EncodedImages` and its
        :class:`~bigbatch.train.tasks.device_images.DeviceAugment`, or a string saying why this
        task's cannot be (by default: its samples are its own, loaded by the CPU)."""
        return f"task={self.name} loads its own samples on the CPU"

    # -- what every task fills in ------------------------------------------------------------

    def prepare(self, log: Log, data: Any = None) -> tuple[Any, Any]:
        """Scan and check the data: (training items, validation items), each with ``len()``;
        ``data`` is that pair when the caller has scanned it already."""
        raise NotImplementedError(f"{type(self).__name__}.prepare")

    def model_factory(self) -> Callable[[], nn.Module]:
        """A zero-argument function building the model (called once under the meta device by
        the planner, then for real)."""
        raise NotImplementedError(f"{type(self).__name__}.model_factory")

    def input_shape(self) -> tuple[int, ...]:
        """One sample's input shape, for the planner's generic step."""
        raise NotImplementedError(f"{type(self).__name__}.input_shape")

    def datasets(self, train_items: Any, valid_items: Any) -> tuple[Any, Any]:
        """The training and validation datasets of the items :meth:`prepare` returned."""
        raise NotImplementedError(f"{type(self).__name__}.datasets")

    def loss(self, logits: torch.Tensor, targets: Any) -> torch.Tensor:
        """The training loss: a mean of per-sample terms (so that accumulation is exact), or,
        with ``couples_samples``, the loss of the whole window's outputs."""
        raise NotImplementedError(f"{type(self).__name__}.loss")

    def metrics(self) -> Metrics:
        """A fresh validation tally (its ``as_dict`` has ``valid_loss``, then the scores)."""
        raise NotImplementedError(f"{type(self).__name__}.metrics")

    def scores(self, row: dict[str, Any]) -> str:
        """The validation part of an epoch's log line."""
        return f"valid loss {row['valid_loss']:.4f}  "

    def sample_names(self, items: Any) -> list[str]:
        """Each sample's file (a case's files joined by ``;``) in ``items``, as ``split.json``
        records which were held out for validation; [] where the items are no files."""
        paths = getattr(items, "files", None)
        if not isinstance(paths, list):  # a task's own items (tensors, say): no file names
            paths = getattr(items, "images", None)
        if not isinstance(paths, list):
            return []
        return [";".join(map(str, p)) if isinstance(p, tuple) else str(p) for p in paths]

    def run_info(self) -> dict[str, Any]:
        """What ``predict`` needs besides config.json (written as task.json)."""
        return {"task": self.name, "classes": self.classes}

    # -- defaults a task overrides where its batches differ ----------------------------------

    def transform_window(self, window: Any) -> Any:
        """The whole window before it is split (Mixup/CutMix mixes across it here, so that
        each micro-batch holds exactly the samples the big batch would have)."""
        return window

    def split(self, window: Any, size: int, min_size: int = 1) -> list[Any]:
        """The window in balanced micro-batches of at most ``size`` (none under ``min_size``)."""
        return split_batch(window, size, min_size=min_size)

    def step(self, model: nn.Module, micro: Any, where: Placement) -> tuple[torch.Tensor, Any]:
        """One micro-batch's forward pass and loss: ``(loss, count)``, the loss a mean over
        ``count`` (the micro-batch's samples; a task whose loss is a mean over something else,
        boxes or tokens, returns that count), which the Accumulator weighs it by."""
        x, y = micro
        with where.autocast():
            logits = model(where.inputs(x))
        return self.loss(logits, where.targets(y)), batch_len(x)

    def example_batch(self, size: int, device: torch.device | str) -> Any:
        """A micro-batch of ``size`` samples for the planner to trace :meth:`step` on, or None
        (the default) to plan the generic step on :meth:`input_shape`."""
        return None

    def window_cache_bytes(self, window: int, precision: str) -> int:
        """With ``couples_samples``: what a window of ``window`` samples holds besides its
        micro-batches' steps (outputs, their gradient, the loss at the whole window)."""
        return 0

    def infer(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Validation's forward pass (sliding windows over whole volumes, for one)."""
        return model(x)

    def finish(
        self, model: nn.Module, loader: Iterable[Any], where: Placement, run_dir: Path, log: Log
    ) -> None:
        """After the last epoch: anything the task derives from the validation set
        (``loader``) for prediction, written into ``run_dir`` (a segmentation run's per-class
        thresholds). ``model`` is the trained model; ``run_dir / "best.safetensors"`` holds the
        best epoch's weights, for a task that derives from those. Nothing by default."""

    def evaluate(self, model: nn.Module, loader: Iterable[Any], where: Placement) -> Metrics:
        """The validation set through ``model`` into a fresh :meth:`metrics` tally."""
        metrics, backoff = self.metrics(), EvalBackoff()

        def forward(inputs: torch.Tensor) -> torch.Tensor:
            with where.autocast():
                return self.infer(model, inputs)

        model.eval()
        with torch.no_grad():
            for x, y in loader:
                # An OOM runs the batch again in smaller pieces: each sample's outputs are the
                # same, and so is the metric.
                logits = infer_fitting(forward, where.inputs(x), backoff)
                targets = where.targets(y)
                if isinstance(targets, torch.Tensor) and targets.device != logits.device:
                    targets = targets.to(logits.device)  # a volume's logits gathered on the CPU
                metrics.update(logits, targets)
        model.train()
        return metrics
