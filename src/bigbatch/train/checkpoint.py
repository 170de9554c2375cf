"""Checkpoints: model weights as safetensors, training state loadable with ``weights_only=True``.

Both are written atomically (temporary file, fsync, rename): a crash or a full disk while
saving leaves the previous checkpoint intact. :func:`host_copy` takes what a checkpoint holds at
one instant, so that the files can be written off the training thread
(:class:`bigbatch.io.BackgroundWriter`) while the next steps change the live tensors.
"""

from __future__ import annotations

import copy
import errno
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigbatch.io import atomic_path, load_tensors

__all__ = [
    "host_copy",
    "load_state",
    "load_weights_file",
    "save_state",
    "write_weights",
]


def host_copy(obj: Any) -> Any:
    """``obj`` (a state dict, or dicts and lists of them) with every tensor copied to host memory
    now, contiguous, and everything else deep-copied: what a checkpoint holds at this instant,
    whatever the training thread does to the live tensors next. Tensors that are one view of one
    storage (tied weights) stay one tensor in the copy.

    >>> import torch
    >>> live = torch.nn.Linear(2, 1)
    >>> saved = host_copy({"model": live.state_dict(), "epoch": 3})
    >>> with torch.no_grad():
    ...     _ = live.weight.add_(1.0)
    >>> bool(torch.equal(saved["model"]["weight"] + 1.0, live.weight))
    True
    """
    return _host_copy(obj, {})


def _host_copy(obj: Any, copied: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if not t.numel():  # no storage to share: every empty tensor's data_ptr is 0
            return torch.empty(t.shape, dtype=t.dtype)
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if view not in copied:
            copied[view] = torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)
        return copied[view]
    if isinstance(obj, dict):
        out = type(obj)((k, _host_copy(v, copied)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module's state dict: its version, for loading
            out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list | tuple):
        return type(obj)(_host_copy(v, copied) for v in obj)
    return copy.deepcopy(obj)


def write_weights(weights: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """A state dict from :func:`host_copy` as safetensors, written atomically. A tensor held
    under several names (tied weights) is stored once, under the first, as safetensors'
    ``save_model`` does; :func:`load_weights_file` restores the others from the model.

    >>> import pathlib, tempfile, torch
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "last.safetensors"
    >>> write_weights(host_copy(torch.nn.Linear(2, 1).state_dict()), path)
    >>> load_weights_file(torch.nn.Linear(2, 1), path)
    """
    from safetensors.torch import save_file

    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in weights.items():
        if id(tensor) in first_name:
            aliases[name] = first_name[id(tensor)]
        else:
            first_name[id(tensor)] = name
            kept[name] = tensor
    with atomic_path(path) as tmp:
        try:
            save_file(kept, str(tmp), metadata=aliases or None)
        except Exception as exc:
            # safetensors writes from Rust: a full disk comes back as its own error type.
            if "os error 28" in str(exc) or "No space left" in str(exc):
                raise OSError(errno.ENOSPC, "No space left on device", str(path)) from exc
            raise


def load_weights_file(model: nn.Module, path: str | Path) -> None:
    """Weights :func:`write_weights` wrote into ``model`` (strict)."""
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
