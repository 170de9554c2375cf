"""Libraries that take another branch on fake tensors than on real ones, made to take the real
run's branch while a step is traced, so the prediction counts what the real step allocates.

Hugging Face transformers treats a FakeTensor as tracing (``is_tracing``), since it cannot read
its values, and then builds attention masks the real step may not build:

- ``find_packed_sequence_indices`` reports the model's own position ids as packed sequences, and
  the model builds a (batch, 1, length, length) mask that the real run, with SDPA's
  ``is_causal``, never builds. A 2-layer Llama at 1024 tokens was over-predicted by 28-34 %
  (growing with the square of the length).
- A padding mask of all ones (one sequence, or a micro-batch without padding) is dropped by the
  real run (SDPA's ``is_causal`` again) and kept on fake tensors: +15-29 % for a tiny Llama at
  256-512 tokens, micro-batch 1.
- Position ids that restart inside a row (packed sequences) are a block-diagonal mask in the
  real run; counting them as one sequence, as for the model's own ids, missed it: 7-22 % under
  for a tiny Llama at 4-8 sequences of 32-64 tokens a row.

A step's batch says what it knows of its values with :func:`known_values` (the planner's
language-model batches do); ids or masks it does not describe take the branch of the model's own
ids (one sequence per row) and of a mask with padding (kept).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["known_values", "real_branches"]

# The values of the fake tensors made while a step is traced, as their batch described them;
# None outside real_branches (a real step needs none).
_KNOWN: contextvars.ContextVar[Any] = contextvars.ContextVar("bigbatch_known_values", default=None)


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def known_values(tensor: torch.Tensor, values: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``tensor``, and while a step is traced on fake tensors, its values (``values()``, real
    tensors on the CPU, made only then) kept beside it, so that libraries' branches on them take
    the real step's way. A step's batch function wraps what it makes: position ids, masks.

    >>> ids = known_values(torch.arange(3), lambda: torch.arange(3))
    >>> ids.tolist()
    [0, 1, 2]
    """
    known = _KNOWN.get()
    if known is not None and _is_fake(tensor):
        with _outside_the_trace():
            known[tensor] = values().cpu()
    return tensor


def _outside_the_trace() -> contextlib.AbstractContextManager[Any]:
    # Real tensors, and ops on them that neither the fake mode nor the tracker sees.
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _values_of(t: Any) -> torch.Tensor | None:
    known = _KNOWN.get()
    return None if known is None or not isinstance(t, torch.Tensor) else known.get(t)


@contextlib.contextmanager
def real_branches() -> Iterator[None]:
    """While tracing a step on fake tensors, libraries take the branch a real step takes.

    Only what is already imported is touched, and it is restored on exit.

    >>> with real_branches():
    ...     pass
    """
    from torch.utils.weak import WeakTensorKeyDictionary

    token = _KNOWN.set(WeakTensorKeyDictionary())
    masking: Any = sys.modules.get("transformers.masking_utils")
    names = ("find_packed_sequence_indices", "_preprocess_mask_arguments")
    originals: dict[str, Any] = {n: getattr(masking, n, None) for n in names}
    try:
        if masking is None or None in originals.values():
            yield
            return
        find_packed, preprocess = (originals[n] for n in names)

        def find_packed_sequence_indices(position_ids: Any) -> Any:
            if not _is_fake(position_ids):
                return find_packed(position_ids)
            values = _values_of(position_ids)
            with _outside_the_trace():
                one_per_row = values is None or find_packed(values) is None
            # Unknown ids: one sequence per row, what the real run finds for the model's own.
            return None if one_per_row else find_packed(position_ids)

        def _preprocess_mask_arguments(*args: Any, **kwargs: Any) -> Any:
            early_exit, mask, *rest = preprocess(*args, **kwargs)
            given = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
            values = _values_of(given)
            with _outside_the_trace():
                unpadded = values is not None and values.ndim == 2 and bool(values.all())
            if unpadded and not early_exit:
                mask = None  # no padding: the real run's masks skip it
            elif values is not None and _is_fake(mask) and mask.ndim == 2:
                # The padding mask as the builders take it (booleans): flash_attention_2's
                # wrapper gathers its real tokens, as many as the values say.
                with _outside_the_trace():
                    _KNOWN.get()[mask] = values.bool()
            return (early_exit, mask, *rest)

        # Module attributes, looked up at each call by transformers' own mask builders.
        masking.find_packed_sequence_indices = find_packed_sequence_indices
        masking._preprocess_mask_arguments = _preprocess_mask_arguments
        yield
    finally:
        for name, original in originals.items():
            if masking is not None and original is not None:
                setattr(masking, name, original)
        _KNOWN.reset(token)
