"""Checkpoints: model weights as safetensors, training state loadable with ``weights_only=True``.

Both are written atomically (temporary file, fsync, rename): a crash or a full disk while
saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigbatch.io import atomic_path, load_tensors

__all__ = ["load_state", "load_weights_file", "save_state", "save_weights"]


def save_weights(model: nn.Module, path: str | Path) -> None:
    from safetensors.torch import save_model

    with atomic_path(path) as tmp:
        try:
            save_model(model, str(tmp))
        except Exception as exc:
            # safetensors writes from Rust: a full disk comes back as its own error type.
            if "os error 28" in str(exc) or "No space left" in str(exc):
                raise OSError(errno.ENOSPC, "No space left on device", str(path)) from exc
            raise


def load_weights_file(model: nn.Module, path: str | Path) -> None:
    from safetensors.torch import load_model

    load_model(model, str(path))


def save_state(state: dict[str, Any], path: str | Path) -> None:
    # Straight to the temporary file (no second copy of the checkpoint in memory), through a
    # Python file object: a full disk is then an OSError (ENOSPC), not torch's RuntimeError.
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)


def load_state(path: str | Path) -> dict[str, Any]:
    """A training state written by :func:`save_state` (never unpickled: ``weights_only``)."""

    state = load_tensors(path, "checkpoint")
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"checkpoint {path} was not written by bigbatch train (no model state)")
    return state
