"""``model=module:factory``: the user's own network, for any task."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from bigbatch.train.config import ConfigError
from bigbatch.user_code import UserCodeError, load_callable

__all__ = ["load_user_model"]


def load_user_model(spec: str) -> Callable[..., nn.Module]:
    """The factory named by ``model=module:factory``; a ConfigError with the fix when it cannot
    be loaded."""
    try:
        return load_callable(spec, "model")
    except UserCodeError as exc:
        raise ConfigError(str(exc)) from exc
