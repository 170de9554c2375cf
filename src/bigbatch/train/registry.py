"""The task registry: each task's name, what it says of itself (a summary, its data, its metrics
and their directions), and where its parts live, as ``"module:attr"`` references loaded only when
used. A leaf: it imports nothing of bigbatch, so the configuration, the command line's help and
``monitor=``'s check read it without loading a task (or timm, or MONAI).

Three ways in, all the same to the loop and the command line:

- the built-in tasks, registered at the bottom of this module;
- an installed package's entry point in the group ``bigbatch.tasks``, whose object is a
  :class:`TaskEntry` (``toy = "mypkg.tasks:ENTRY"`` in its ``pyproject.toml``);
- ``task=module:Class`` for a quick script: a :class:`~bigbatch.train.tasks.base.Task` subclass
  on the import path that declares ``metric_names`` (and ``lower_is_better_names``,
  ``options_class``, ``predict_run`` where it has them).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_TASK",
    "ENTRY_POINT_GROUP",
    "TaskEntry",
    "load_ref",
    "lower_is_better",
    "register_task",
    "task_entry",
    "task_names",
]

ENTRY_POINT_GROUP = "bigbatch.tasks"
# The task a configuration without ``task=`` trains (and a run folder from before task.json).
DEFAULT_TASK = "classification"


def load_ref(ref: Any) -> Any:
    """``"package.module:attr"`` imported and looked up (dots after the colon walk attributes);
    anything else returned as it is.

    >>> load_ref("json:dumps")([1])
    '[1]'
    """
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"{ref!r} is not a reference of the form package.module:attr")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class TaskEntry:
    """A registered task. ``task`` builds it from the config (a Task subclass, a function of
    the config, or a ``"module:attr"`` reference to either); ``metrics`` are the names its
    metrics' ``as_dict`` returns that ``monitor=`` may choose and ``history.png`` plots (with
    ``lower_is_better`` where less is better); ``predict`` runs ``bigbatch predict`` on a run
    of it, ``ensemble`` ``bigbatch ensemble`` on finished runs of it; ``options`` is the dataclass of its own keys; ``summary`` and ``data_help`` are
    what the command line's help says of it and of its ``data=``.

    >>> entry = TaskEntry("toy", "mypkg.toy:ToyTask", ("mae",), frozenset({"mae"}))
    >>> entry.name, entry.metrics
    ('toy', ('mae',))
    """

    name: str
    task: Any
    metrics: tuple[str, ...]
    lower_is_better: frozenset[str] = frozenset()
    predict: Any = None
    options: Any = None  # None: no keys of its own
    summary: str = ""
    data_help: str = ""
    # Metrics that are fractions of 1 (accuracy, Dice), plotted together; others get a panel each.
    fractions: frozenset[str] = field(default_factory=frozenset)
    ensemble: Any = None
    # ``bigbatch predict``'s options of this task: a dataclass of option() fields, as ``options``.
    predict_options: Any = None
    # ``bigbatch ensemble EXPERIMENTS.toml``: members trained, then ensembled as the task does.
    experiments: Any = None
    # The installed distribution whose entry point this is ("" for the built-in tasks and
    # ``module:Class``): a run folder records it, so that a machine without the plug-in can
    # say which package to install.
    package: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.lower_is_better) - set(self.metrics)
        if unknown:
            raise ValueError(
                f"lower_is_better names metrics task {self.name!r} does not have: {sorted(unknown)}"
            )

    def build(self, cfg: Any) -> Any:
        return self._load("task")(cfg)

    def options_class(self) -> type[Any]:
        """The dataclass of the task's own keys (the empty base for a task without any)."""
        if self.options is None:
            return load_ref("bigbatch.train.tasks.options:TaskOptions")  # type: ignore[no-any-return,unused-ignore]
        return self._load("options")  # type: ignore[no-any-return,unused-ignore]

    def predictor(self) -> Callable[[Any], str] | None:
        return self._load("predict") if self.predict is not None else None

    def ensembler(self) -> Callable[[Any], str] | None:
        return self._load("ensemble") if self.ensemble is not None else None

    def experiments_fn(self) -> Callable[..., Any] | None:
        return self._load("experiments") if self.experiments is not None else None

    def predict_options_class(self) -> type[Any] | None:
        return self._load("predict_options") if self.predict_options is not None else None

    def _load(self, part: str) -> Any:
        """One of the entry's parts, loaded; a reference that does not load is a ValueError
        naming the part and the fix, not an ImportError from deep inside the command."""
        ref = getattr(self, part)
        try:
            return load_ref(ref)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(
                f"task={self.name}: its {part}={ref!r} does not load ({type(exc).__name__}: "
                f"{str(exc)[:160]}); fix that reference in the task's TaskEntry"
                + (f" (package {self.package})" if self.package else "")
            ) from exc

    def check_references(self) -> None:
        """Load every ``"module:attr"`` part now (ValueError naming the first that fails): a
        plug-in's typo is said when the task is chosen, not after training when it predicts."""
        for part in ("task", "options", "predict", "ensemble", "predict_options", "experiments"):
            if isinstance(getattr(self, part), str):
                self._load(part)


_TASKS: dict[str, TaskEntry] = {}


def register_task(
    name: str,
    task: Any,
    *,
    metrics: tuple[str, ...],
    lower_is_better: tuple[str, ...] = (),
    predict: Any = None,
    options: Any = None,
    summary: str = "",
    data_help: str = "",
    fractions: tuple[str, ...] = (),
    ensemble: Any = None,
    predict_options: Any = None,
    experiments: Any = None,
) -> TaskEntry:
    """Make ``task=name`` build ``task`` (see :class:`TaskEntry`; every part may be a
    ``"module:attr"`` reference, loaded when the task is used).

    >>> "classification" in task_names()
    True
    """
    if name in _TASKS:
        raise ValueError(f"task {name!r} is registered already")
    entry = TaskEntry(
        name,
        task,
        tuple(metrics),
        frozenset(lower_is_better),
        predict,
        options,
        summary,
        data_help,
        frozenset(fractions),
        ensemble,
        predict_options,
        experiments,
    )
    _TASKS[name] = entry
    return entry


@functools.cache
def _entry_points() -> dict[str, Any]:
    """The installed plug-ins' entry points by name (not loaded: loading imports the task)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def task_names() -> tuple[str, ...]:
    """The built-in and registered tasks, then the installed plug-ins'."""
    return tuple(dict.fromkeys([*_TASKS, *_entry_points()]))


# Plug-ins and ``module:Class`` tasks once loaded (the registered ones are in _TASKS).
_LOADED: dict[str, TaskEntry] = {}


def task_entry(name: str) -> TaskEntry:
    """The task ``name``: registered, an installed plug-in (loaded now), or ``module:Class``.
    KeyError with the choices where it is none; ValueError, naming it and the fix, where it
    is one but cannot load, or where a plug-in takes a registered task's name."""
    plugin = _entry_points().get(name)
    if name in _TASKS:
        if plugin is not None:
            raise ValueError(
                f"task={name} is two tasks here: the built-in one and the plug-in "
                f"{plugin.value} ({_distribution(plugin) or 'an installed package'}, entry point "
                f"of group {ENTRY_POINT_GROUP}): rename that entry point in the plug-in's "
                "pyproject.toml and reinstall it (or uninstall it to use the built-in task)"
            )
        return _TASKS[name]
    if name not in _LOADED:
        if plugin is not None:
            _LOADED[name] = _from_entry_point(name, plugin)
        elif ":" in name:
            _LOADED[name] = _from_class(name)
        else:
            raise KeyError(
                f"task={name!r} is not one of {', '.join(task_names())} (nor module:Class, a "
                "Task subclass on the import path)"
            )
    return _LOADED[name]


def _distribution(ep: Any) -> str:
    """The name of the installed distribution an entry point belongs to ('' if unknown)."""
    dist = getattr(ep, "dist", None)
    return str(getattr(dist, "name", "") or "")


def _from_entry_point(name: str, ep: Any) -> TaskEntry:
    package = _distribution(ep)
    try:
        obj = ep.load()
    except Exception as exc:
        raise ValueError(
            f"task={name}: its plug-in ({ep.value}, entry point of group {ENTRY_POINT_GROUP}) "
            f"does not load: {type(exc).__name__}: {str(exc)[:200]}; fix or uninstall that package"
        ) from exc
    if not isinstance(obj, TaskEntry):
        raise ValueError(
            f"task={name}: its entry point {ep.value} is a {type(obj).__name__}, not a "
            "bigbatch.train.registry.TaskEntry: point it at one"
        )
    entry = TaskEntry(**{**obj.__dict__, "name": name, "package": package})
    entry.check_references()
    return entry


def _from_class(name: str) -> TaskEntry:
    """``task=module:Class``: the class's own declarations make its entry."""
    from bigbatch.user_code import UserCodeError, load_object  # a leaf, like this module

    try:
        # The working directory is on the path here, as for model=, under either
        # `python -m bigbatch` or the `bigbatch` executable.
        cls = load_object(name, f"task={name}")
    except UserCodeError as exc:
        raise ValueError(
            f"{exc}; give module:Class with the module in the working directory or installed"
        ) from exc
    task_base = load_ref("bigbatch.train.tasks.base:Task")
    if not isinstance(cls, type) or not issubclass(cls, task_base):
        kind = cls.__name__ if isinstance(cls, type) else type(cls).__name__
        raise ValueError(
            f"task={name} is a {kind}, not a bigbatch Task: write `class {kind}"
            "(bigbatch.train.tasks.Task)` with its metric_names (the names its metrics' "
            "as_dict returns)"
        )
    metrics = getattr(cls, "metric_names", None)
    if not isinstance(metrics, tuple) or not all(isinstance(m, str) for m in metrics):
        raise ValueError(
            f"task={name}: metric_names is {metrics!r}, not a tuple of the names its metrics' "
            "as_dict returns: declare it, e.g. metric_names = ('f2', 'map')"
        )
    doc = (cls.__doc__ or "").strip().splitlines()
    experiments = getattr(cls, "run_experiments", None)
    return TaskEntry(
        name,
        cls,
        metrics,
        frozenset(getattr(cls, "lower_is_better_names", ())),
        getattr(cls, "predict_run", None),
        getattr(cls, "options_class", None),
        doc[0] if doc else "",
        getattr(cls, "data_help", ""),
        frozenset(getattr(cls, "fraction_names", ())),
        ensemble=getattr(cls, "ensemble_runs", None),
        predict_options=getattr(cls, "predict_options_class", None),
        experiments=experiments,
    )


def lower_is_better(task: str, metric: str) -> bool:
    """Whether a smaller ``metric`` is better (losses always are)."""
    return metric in ("valid_loss", "train_loss") or metric in task_entry(task).lower_is_better


# The built-in tasks: every part a reference, loaded when the task is chosen.
_TASKS_PKG = "bigbatch.train.tasks"
_CLASSIFICATION_METRICS = (
    "accuracy",
    "error_rate",
    "top5",
    "f1_macro",
    "f1_micro",
    "auroc",
    "kappa",
)
register_task(
    "classification",
    f"{_TASKS_PKG}.classification.task:ClassificationTask",
    metrics=_CLASSIFICATION_METRICS,
    lower_is_better=("error_rate",),
    predict=f"{_TASKS_PKG}.classification.predict:predict_request",
    options=f"{_TASKS_PKG}.classification.options:ClassificationOptions",
    summary="image -> class",
    data_help="a folder with one sub-folder per class, or a CSV of file,label",
    fractions=_CLASSIFICATION_METRICS,  # every one a fraction of 1
    ensemble=f"{_TASKS_PKG}.classification.predict:ensemble_request",
    experiments=f"{_TASKS_PKG}.classification.experiments:run_experiments",
)
register_task(
    "segmentation",
    f"{_TASKS_PKG}.segmentation.route:segmentation_task",
    metrics=("dice", "jaccard", "hd95"),
    lower_is_better=("hd95",),
    predict=f"{_TASKS_PKG}.segmentation.predict:predict_request",
    options=f"{_TASKS_PKG}.segmentation.options:SegmentationOptions",
    summary="image/volume -> mask",
    data_help=(
        "a folder with images/ and masks/, a CSV of image,mask, or a Kaggle RLE CSV "
        "(with image_root=)"
    ),
    fractions=("dice", "jaccard"),
    ensemble=f"{_TASKS_PKG}.segmentation.ensemble:ensemble_request",
    predict_options=f"{_TASKS_PKG}.segmentation.options:SegmentationPredictOptions",
)
register_task(
    "regression",
    f"{_TASKS_PKG}.regression.task:RegressionTask",
    metrics=("mae", "rmse", "r2"),
    lower_is_better=("mae", "rmse"),
    predict=f"{_TASKS_PKG}.regression.predict:predict_request",
    options=f"{_TASKS_PKG}.regression.options:RegressionOptions",
    summary="image -> one or more numbers",
    data_help="a CSV of file,target[,target2...] (float targets)",
    ensemble=f"{_TASKS_PKG}.regression.predict:ensemble_request",
)
