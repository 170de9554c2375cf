"""The training command line's parts: config, data, model, loop, metrics, checkpoints, reports.

Small pieces composed by :func:`bigbatch.train.loop.train`; the library never imports the CLI.
From a notebook, what ``bigbatch train`` does (loaded on first use)::

    from bigbatch.train import load_config, train
    result = train(load_config("run.toml", ["epochs=3"]), "runs/a")
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bigbatch.train.config import TrainConfig, load_config
    from bigbatch.train.loop import train

__all__ = ["TrainConfig", "load_config", "train"]

_LAZY = {
    "TrainConfig": "bigbatch.train.config",
    "load_config": "bigbatch.train.config",
    "train": "bigbatch.train.loop",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bigbatch.train' has no attribute {name!r}")
