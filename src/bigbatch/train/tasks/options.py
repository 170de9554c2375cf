"""A task's own configuration keys: a dataclass in the task's folder, registered with the task.

``bigbatch train`` reads one flat set of keys (a TOML file, ``key=value``); the keys every task
shares are :class:`~bigbatch.train.config.TrainConfig`'s, and a task's own keys (a
segmentation loss, Mixup's alpha) are its options dataclass's, reached as ``cfg.options``. A key
of another task is refused with the task that reads it, instead of being ignored.

This module loads nothing but :mod:`dataclasses`: the configuration imports it to check keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

__all__ = ["TaskOptions", "option"]


def option(default: Any, help: str, choices: tuple[str, ...] = (), trains: bool = True) -> Any:
    """A task option's field: its default, the line ``bigbatch train --help`` shows, the values
    it may take, and whether it changes the trained weights (a resumed run must keep those).

    >>> from dataclasses import dataclass, fields
    >>> @dataclass
    ... class Example(TaskOptions):
    ...     alpha: float = option(0.0, "Mixup's alpha")
    >>> fields(Example)[0].metadata["help"]
    "Mixup's alpha"
    """
    metadata = {"help": help, "choices": choices, "trains": trains}
    return field(default=default, metadata=metadata)


@dataclass
class TaskOptions:
    """The base of a task's options dataclass (and the options of a task without keys of its
    own): subclass it as a dataclass of :func:`option` fields and check their values in
    :meth:`check`.

    >>> @dataclass
    ... class TagsOptions(TaskOptions):
    ...     threshold: float = option(0.5, "a tag where its probability is above this")
    ...     def check(self, cfg):
    ...         if not 0 < self.threshold < 1:
    ...             raise ValueError(f"threshold is in (0, 1), got {self.threshold}")
    >>> TagsOptions(threshold=0.3).threshold
    0.3
    """

    # The head-only epochs of mode=fine_tune apply (a classifier's head); a decoder's last
    # layer is no head worth training alone.
    fine_tunes_head: ClassVar[bool] = True

    def check(self, cfg: Any) -> None:
        """Raise ValueError, naming the key and the fix, for a value this task cannot use;
        ``cfg`` is the whole configuration, for rules that involve shared keys."""

    def check_read(self, cfg: Any) -> None:
        """Raise ValueError for a key set where this run would not read it (``auto_augment``
        with augmentation off), naming the key to drop. Unlike :meth:`check`, it is skipped
        for a resumed run, which goes on as its saved config trained.

        >>> @dataclass
        ... class TagsOptions(TaskOptions):
        ...     top_k: int = option(0, "at most this many tags; 0: any")
        ...     def check_read(self, cfg):
        ...         if self.changed("top_k") and cfg.task != "tags":
        ...             raise ValueError(f"{self.changed('top_k')[0]} is read by task=tags")
        >>> TagsOptions().check_read(None)  # top_k at its default: nothing to refuse
        """

    def changed(self, *keys: str) -> list[str]:
        """``key=value`` for each of ``keys`` set away from its default: what to refuse where
        the data at hand would not read those keys.

        >>> @dataclass
        ... class TagsOptions(TaskOptions):
        ...     threshold: float = option(0.5, "a tag where its probability is above this")
        ...     top_k: int = option(0, "at most this many tags; 0: any")
        >>> TagsOptions(threshold=0.3).changed("threshold", "top_k")
        ['threshold=0.3']
        """
        defaults = {f.name: f.default for f in fields(self)}
        return [f"{k}={getattr(self, k)}" for k in keys if getattr(self, k) != defaults[k]]
